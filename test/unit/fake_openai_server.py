"""A fake OpenAI-compatible (and SGLang-native) server for benchmark tests.

It answers with whatever ``answer_fn`` returns for the request's prompt, so a
test knows the truth (gold labels -> 100%, shuffled labels -> chance), and it
can inject failures per request through ``fail_fn``.  Runs in a thread on
127.0.0.1 with an ephemeral port; stdlib only, so it shares nothing with the
client under test.

Endpoints: GET /v1/models, POST /v1/chat/completions and /v1/completions
(JSON or SSE with a final ``usage`` chunk; ``prompt`` may be token ids, one
prompt token each; text counts one per word), POST /v1/tokenize (fake
tokenizer: the UTF-8 bytes of the messages' JSON, or of ``prompt``), POST
/generate (meta_info with SGLang 0.5.17's speculative fields), GET
/server_info, GET /model_info (with ``tokenizer_path`` when given).
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def prompt_of(body: dict) -> str:
    """The text a test's answer_fn sees: last user message, or the prompt (token ids: joined by spaces)."""
    if "messages" in body:
        return [m for m in body["messages"] if m["role"] == "user"][-1]["content"]
    prompt = body.get("prompt", "")
    return " ".join(str(t) for t in prompt) if isinstance(prompt, list) else prompt


class _Server(ThreadingHTTPServer):
    request_queue_size = 256  # the default 5 drops connections when the benchmark opens 64 at once
    daemon_threads = True
    block_on_close = False  # hung "timeout" handlers must not block stop


class FakeOpenAIServer:
    """Context manager; ``url`` is the OpenAI root (``http://127.0.0.1:P/v1``).

    answer_fn(prompt) -> reply text.
    fail_fn(path, prompt, attempt) -> None | "<HTTP status>" | "timeout" | "close",
        attempt counting from 1 per (path, prompt); "timeout" hangs ``hang_s``.
    spec_steps_fn(prompt) -> accepted drafts per verify step, or None for a
        server without speculative decoding.
    """

    def __init__(
        self,
        answer_fn: Callable[[str], str] = lambda prompt: "ok",
        fail_fn: Callable[[str, str, int], str | None] | None = None,
        spec_steps_fn: Callable[[str], list[int]] | None = None,
        num_steps: int = 3,
        server_info: bool = True,
        model: str = "fake-model",
        token_delay: float = 0.0,
        first_token_delay: float = 0.0,
        hang_s: float = 5.0,
        tokenizer_path: str | None = None,
    ):
        self.answer_fn = answer_fn
        self.fail_fn = fail_fn
        self.spec_steps_fn = spec_steps_fn
        self.num_steps = num_steps
        self.server_info = server_info
        self.model = model
        self.token_delay = token_delay
        self.first_token_delay = first_token_delay
        self.hang_s = hang_s
        self.tokenizer_path = tokenizer_path
        self.attempts: Counter = Counter()
        self.requests: list[tuple[str, dict]] = []
        self._lock = threading.Lock()
        self._httpd: _Server | None = None

    def __enter__(self) -> FakeOpenAIServer:
        self._httpd = _Server(("127.0.0.1", 0), _make_handler(self))
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}/v1"

    def _record(self, path: str, body: dict, prompt: str) -> str | None:
        with self._lock:  # fail_fn runs under the lock too: tests may keep state in it
            self.requests.append((path, body))
            self.attempts[(path, prompt)] += 1
            return self.fail_fn(path, prompt, self.attempts[(path, prompt)]) if self.fail_fn else None

    def generate_tokens(self, body: dict, prompt: str) -> list[str]:
        words = self.answer_fn(prompt).split(" ")
        tokens = [w + " " for w in words[:-1]] + words[-1:]
        limit = body.get("max_tokens")
        if body.get("ignore_eos") and limit:
            tokens = (tokens * limit)[:limit]
        return tokens[:limit] if limit else tokens


def _make_handler(server: FakeOpenAIServer):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # keep pytest output clean
            pass

        def _send_json(self, obj: dict, status: int = 200) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/v1/models":
                self._send_json({"object": "list", "data": [{"id": server.model, "object": "model"}]})
            elif self.path in ("/server_info", "/get_server_info") and server.server_info:
                algo = "EAGLE" if server.spec_steps_fn else None
                self._send_json(
                    {
                        "speculative_algorithm": algo,
                        "speculative_num_steps": server.num_steps,
                        "speculative_eagle_topk": 1,
                        "speculative_num_draft_tokens": server.num_steps + 1,
                    }
                )
            elif self.path == "/model_info" and server.tokenizer_path:
                info = {"model_path": server.model, "tokenizer_path": server.tokenizer_path, "is_generation": True}
                self._send_json(info)
            else:
                self._send_json({"error": "not found"}, 404)

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/generate":
                prompt = prompt_of(json.loads(bytes(body["input_ids"]).decode()))
            else:
                prompt = prompt_of(body)
            failure = server._record(self.path, body, prompt)
            try:
                if failure and failure.isdigit():
                    return self._send_json({"error": "injected failure"}, int(failure))
                if failure == "timeout":
                    time.sleep(server.hang_s)
                    return self._send_json({"error": "too late"}, 500)
                if failure == "close":
                    self.close_connection = True
                    return self.connection.shutdown(2)
                if self.path in ("/v1/chat/completions", "/v1/completions"):
                    return self._complete(body, prompt)
                if self.path == "/v1/tokenize":
                    text = body["prompt"] if "prompt" in body else json.dumps({"messages": body["messages"]})
                    ids = list(text.encode())
                    return self._send_json({"tokens": ids, "count": len(ids), "max_model_len": 1 << 20})
                if self.path == "/generate":
                    return self._generate(body, prompt)
                self._send_json({"error": "not found"}, 404)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (timeout test); nothing to answer

        def _complete(self, body: dict, prompt: str) -> None:
            chat = self.path.endswith("chat/completions")
            tokens = server.generate_tokens(body, prompt)
            usage = {
                "prompt_tokens": len(prompt.split()),
                "completion_tokens": len(tokens),
                "total_tokens": len(prompt.split()) + len(tokens),
            }
            if not body.get("stream"):
                choice = {"index": 0, "finish_reason": "stop"}
                if chat:
                    choice["message"] = {"role": "assistant", "content": "".join(tokens)}
                else:
                    choice["text"] = "".join(tokens)
                return self._send_json({"id": "x", "model": server.model, "choices": [choice], "usage": usage})
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            time.sleep(server.first_token_delay)
            for i, tok in enumerate(tokens):
                if i:
                    time.sleep(server.token_delay)
                delta = {"delta": {"content": tok}} if chat else {"text": tok}
                self._event({"choices": [{"index": 0, **delta, "finish_reason": None}]})
            if (body.get("stream_options") or {}).get("include_usage"):
                self._event({"choices": [], "usage": usage})
            self.wfile.write(b"data: [DONE]\n\n")

        def _event(self, obj: dict) -> None:
            self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
            self.wfile.flush()

        def _generate(self, body: dict, prompt: str) -> None:
            text = server.answer_fn(prompt)
            meta = {"id": "x", "finish_reason": {"type": "stop"}, "prompt_tokens": len(body["input_ids"])}
            steps = server.spec_steps_fn(prompt) if server.spec_steps_fn else None
            if steps is None:
                meta["completion_tokens"] = len(text.split())
            else:  # what SGLang 0.5.17's TokenizerManager._calculate_spec_decoding_metrics emits
                hist = [0] * (server.num_steps + 1)
                for k in steps:
                    hist[k] += 1
                correct, proposed, tokens = sum(steps), len(steps) * server.num_steps, sum(steps) + len(steps)
                meta.update(
                    {
                        "completion_tokens": tokens,
                        "spec_verify_ct": len(steps),
                        "spec_accept_length": tokens / len(steps),
                        "spec_accept_rate": correct / proposed,
                        "spec_num_correct_drafts": correct,
                        "spec_num_proposed_drafts": proposed,
                        "spec_correct_drafts_histogram": hist,
                    }
                )
            self._send_json({"text": text, "output_ids": [], "meta_info": meta})

    return Handler
