"""Async HTTP client for OpenAI-compatible servers, with the policies the
benchmarks rely on.

Why not the ``openai`` SDK: the benchmarks also need SGLang's native
endpoints (``/generate``, ``/server_info``), raw SSE timing for TTFT, and
one explicit retry policy whose every attempt is counted in the results.  A
thin aiohttp client keeps all of that visible and testable.

Policy: connection errors, timeouts, HTTP 429 and 5xx are retried with
exponential backoff; other 4xx are not (retrying a bad request cannot help).
A request that still fails is *returned as a failure record* by
:func:`run_all`, never dropped, so accuracy denominators stay honest.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

try:  # the ``bench`` extra; without it the modules still import (their pure helpers work), requests do not
    import aiohttp
except ImportError:
    aiohttp = None
try:
    from tqdm import tqdm
except ImportError:
    tqdm = None


class BenchError(Exception):
    """A problem the user must fix (no server, no dataset); CLIs exit non-zero with it."""


def missing_extra(module: str) -> BenchError:
    """The error for a missing dependency of the ``bench`` extra."""
    return BenchError(
        f"the benchmarks need {module!r}, which is not installed: pip install 'sglang-m3[bench]' "
        '(from a clone: pip install -e ".[bench]")'
    )


class RequestFailed(Exception):
    """A request that failed after all retries; recorded, not raised to the user."""

    def __init__(self, message: str, attempts: int):
        super().__init__(message)
        self.attempts = attempts


_RETRYABLE_STATUS = {408, 429, 500, 502, 503, 504}


class Client:
    """One aiohttp session against ``base_url`` (the OpenAI root, ``.../v1``).

    ``root_url`` is ``base_url`` without the trailing ``/v1``: SGLang serves
    its native endpoints there.
    """

    def __init__(
        self,
        base_url: str,
        timeout: float = 600.0,
        max_retries: int = 3,
        retry_delay: float = 1.0,
        api_key: str | None = None,
    ):
        if aiohttp is None:
            raise missing_extra("aiohttp")
        self.base_url = base_url.rstrip("/")
        self.root_url = self.base_url.removesuffix("/v1")
        self.timeout = timeout
        self.max_retries = max_retries
        self.retry_delay = retry_delay
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Client:
        # limit=0: concurrency is bounded by run_all's semaphore, not the pool.
        self._session = aiohttp.ClientSession(
            headers=self._headers,
            timeout=aiohttp.ClientTimeout(total=self.timeout),
            connector=aiohttp.TCPConnector(limit=0),
        )
        return self

    async def __aexit__(self, *exc) -> None:
        await self._session.close()

    def url(self, path: str, native: bool = False) -> str:
        return (self.root_url if native else self.base_url) + path

    async def check(self) -> list[str]:
        """Model ids served at ``base_url``; BenchError if nothing answers there.

        Called before any benchmark work so that a wrong ``--base-url`` fails
        in a second with an actionable message instead of N retried requests.
        """
        url = self.url("/models")
        try:
            async with self._session.get(url) as resp:
                if resp.status == 404:
                    return []
                resp.raise_for_status()
                body = await resp.json(content_type=None)
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError, OSError) as exc:
            raise BenchError(
                f"cannot connect to an OpenAI-compatible server at {self.base_url} "
                f"({type(exc).__name__}: {exc}). Start the server or pass --base-url."
            ) from exc
        except aiohttp.ClientResponseError as exc:
            raise BenchError(f"GET {url} failed with HTTP {exc.status}: {exc.message}") from exc
        return [m.get("id") for m in body.get("data", []) if isinstance(m, dict)]

    async def get_json(self, path: str, native: bool = False) -> dict | None:
        """GET without retries; None when the endpoint does not exist or fails."""
        try:
            async with self._session.get(self.url(path, native)) as resp:
                if resp.status != 200:
                    return None
                return await resp.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return None

    async def post_json(self, path: str, payload: dict, native: bool = False) -> tuple[dict, int]:
        """POST with the retry policy; returns (response JSON, attempts used)."""
        url = self.url(path, native)
        last_error = ""
        for attempt in range(1, self.max_retries + 2):
            try:
                async with self._session.post(url, json=payload) as resp:
                    text = await resp.text()
                    if resp.status == 200:
                        return json.loads(text), attempt
                    last_error = f"HTTP {resp.status}: {text[:300]}"
                    if resp.status not in _RETRYABLE_STATUS:
                        raise RequestFailed(last_error, attempt)
            except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
                last_error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if attempt <= self.max_retries:
                await asyncio.sleep(self.retry_delay * 2 ** (attempt - 1))
        raise RequestFailed(last_error, self.max_retries + 1)

    async def chat(self, model: str, messages: list[dict], **params: Any) -> tuple[dict, int]:
        """Non-streaming chat completion; returns (response JSON, attempts)."""
        return await self.post_json("/chat/completions", {"model": model, "messages": messages, **params})

    async def stream(self, path: str, payload: dict) -> AsyncIterator[tuple[float, dict]]:
        """POST a streaming request; yields (arrival time, parsed SSE event).

        No retries: a retried request would corrupt its latency measurement,
        so the serving benchmark counts the failure instead.
        """
        try:
            async with self._session.post(self.url(path), json={**payload, "stream": True}) as resp:
                if resp.status != 200:
                    raise RequestFailed(f"HTTP {resp.status}: {(await resp.text())[:300]}", 1)
                async for raw in resp.content:
                    line = raw.decode("utf-8").strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:") :].strip()
                    if data == "[DONE]":
                        return
                    yield time.perf_counter(), json.loads(data)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            raise RequestFailed(f"{type(exc).__name__}: {exc}", 1) from exc


def reply_fields(response: dict) -> dict:
    """Content, reasoning and token counts of a chat completion response."""
    choice = (response.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    return {
        "response": message.get("content") or "",
        "reasoning": message.get("reasoning_content") or message.get("reasoning"),
        "finish_reason": choice.get("finish_reason"),
        "completion_tokens": (response.get("usage") or {}).get("completion_tokens"),
    }


async def run_all(
    items: Sequence[Any],
    worker: Callable[[Any], Awaitable[dict]],
    parallel: int,
    desc: str,
) -> list[dict]:
    """Run ``worker`` on every item with at most ``parallel`` in flight.

    Results keep the input order.  A worker raising RequestFailed yields a
    record ``{"error": ..., "attempts": ...}`` for that item; any other
    exception is a bug and propagates.
    """
    if tqdm is None:
        raise missing_extra("tqdm")
    semaphore = asyncio.Semaphore(max(1, parallel))
    bar = tqdm(total=len(items), desc=desc, disable=None, dynamic_ncols=True)

    async def one(item: Any) -> dict:
        async with semaphore:
            try:
                return await worker(item)
            except RequestFailed as exc:
                return {"error": str(exc), "attempts": exc.attempts}
            finally:
                bar.update(1)

    try:
        return list(await asyncio.gather(*(one(item) for item in items)))
    finally:
        bar.close()
