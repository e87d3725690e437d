"""Options and plumbing shared by every benchmark CLI.

Every benchmark has the same shape: parse options, connect (fail fast with a
clear message), run requests, write ``{summary..., "records": [...]}`` JSON,
return the summary.  Keeping that here means the four scripts cannot drift
apart in option names, error handling or output layout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from .client import BenchError, Client

DEFAULT_BASE_URL = "http://127.0.0.1:30000/v1"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Append "(default: X)" only to help texts that do not explain their default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        return text if "default" in text else super()._get_help_string(action)


def make_parser(
    name: str,
    description: str,
    default_parallel: int | None,
    data: str | None,
    num_questions_help: str = "limit the number of questions (default: all)",
    parallel_help: str = "max concurrent requests",
) -> argparse.ArgumentParser:
    """Parser with the common options; ``data`` names the dataset folder (or None)."""
    p = argparse.ArgumentParser(
        prog=f"bench_{name}.py",
        description=description,
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--base-url", default=DEFAULT_BASE_URL, help="OpenAI-compatible API root of the server")
    p.add_argument("--model", default=None, help="model name sent in requests (default: first id from GET /models)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="bearer token, if the server wants one (default: $OPENAI_API_KEY)",
    )
    if data:
        what = f"{data} folder"
        if data == "gsm8k":
            what = "GSM8K test.jsonl, or a folder holding test.jsonl (and train.jsonl)"
        p.add_argument(
            "--data-path",
            default=None,
            help=f"local {what} (default: $SGLANG_M3_DATA/{data} if present, else download)",
        )
    p.add_argument("--num-questions", type=int, default=None, help=num_questions_help)
    p.add_argument("--parallel", type=int, default=default_parallel, help=parallel_help)
    p.add_argument(
        "--output",
        default=f"bench_results/{name}.json",
        help="results JSON: summary at top level plus per-request 'records' ('' to skip; default: %(default)s)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    p.add_argument("--max-retries", type=int, default=3, help="retries after a timeout, connection error, 429 or 5xx")
    p.add_argument("--retry-delay", type=float, default=1.0, help="first retry backoff in seconds (doubles each retry)")
    return p


def add_generation_args(p: argparse.ArgumentParser, thinking_max_tokens: int, plain_max_tokens: int) -> None:
    """Sampling options of the accuracy benchmarks."""
    p.add_argument(
        "--thinking",
        choices=["on", "off"],
        default=None,
        help="send chat_template_kwargs.enable_thinking (default: send nothing, the template's default)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help=f"max generated tokens (default: {thinking_max_tokens} with --thinking on, else {plain_max_tokens})",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")


def generation_params(args: argparse.Namespace, thinking_max_tokens: int, plain_max_tokens: int) -> dict:
    """Request body fields for the sampling options (extra fields are SGLang's)."""
    max_tokens = args.max_tokens or (thinking_max_tokens if args.thinking == "on" else plain_max_tokens)
    params = {"max_tokens": max_tokens, "temperature": args.temperature}
    if args.thinking is not None:
        params["chat_template_kwargs"] = {"enable_thinking": args.thinking == "on"}
    return params


@asynccontextmanager
async def connect(args: argparse.Namespace):
    """Yield ``(client, model)`` once the server answered GET /models."""
    async with Client(args.base_url, args.timeout, args.max_retries, args.retry_delay, args.api_key) as client:
        models = await client.check()
        model = args.model or (models[0] if models else None)
        if model is None:
            raise BenchError(f"{args.base_url}/models lists no model; pass --model")
        yield client, model


def check_not_all_failed(records: list[dict]) -> None:
    """Refuse to report a score when no request succeeded: that is an outage, not 0%."""
    if records and all("error" in r for r in records):
        raise BenchError(f"all {len(records)} requests failed; first error: {records[0]['error']}")


def run_counts(records: list[dict], model: str, args: argparse.Namespace, params: dict) -> dict:
    """What every accuracy benchmark's summary reports beside its score: failed, unanswered and retried
    requests, and the run's settings."""
    return {
        "num_errors": sum("error" in r for r in records),
        "num_no_answer": sum(r["pred"] is None and "error" not in r for r in records),
        "num_retried": sum(r["attempts"] > 1 for r in records),
        "model": model,
        "base_url": args.base_url,
        "num_shots": args.num_shots,
        "thinking": args.thinking,
        **params,
    }


def write_output(path: str | None, summary: dict, records: list[dict]) -> None:
    """Write ``{**summary, "records": records}`` and print the summary."""
    if path:
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({**summary, "records": records}, indent=2, ensure_ascii=False) + "\n")
        print(f"results written to {out}", file=sys.stderr)
    print(json.dumps(summary, indent=2))


def run(coro_fn: Callable[[], Awaitable[dict]]) -> dict:
    """Run a benchmark coroutine; a BenchError exits non-zero with its message."""
    try:
        return asyncio.run(coro_fn())
    except BenchError as exc:
        sys.exit(f"error: {exc}")
