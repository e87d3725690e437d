"""Serving latency/throughput sweep over the OpenAI streaming API.

For every (input length, output length, concurrency) level, ``n`` streaming
requests run with at most ``concurrency`` in flight; per request:

* TTFT: request start to the first chunk carrying text (content or reasoning),
* TPOT: (latency - TTFT) / (output tokens - 1),
* output tokens: the final ``usage`` chunk (``stream_options.include_usage``),
  else the number of text chunks.

Output length is forced with ``max_tokens`` plus ``ignore_eos`` (an extra
field SGLang and vLLM accept; ``--no-ignore-eos`` for servers that reject it).
Prompts carry no tokenizer assumption: ``--input-len`` words, either random
common words or GSM8K questions concatenated; the real prompt token count is
reported from ``usage``.  Streamed requests are never retried (that would
corrupt their timing); failures are counted per level.  Headline:
``output_throughput`` = best output tokens/s at the highest concurrency.
"""

from __future__ import annotations

import functools
import random
import time
from pathlib import Path

from . import cli
from .client import BenchError, RequestFailed, run_all
from .datasets import load_gsm8k
from .plot import plot_serving
from .stats import describe

# Common short English words: about one token each for BPE tokenizers.
_WORDS = (
    "the of and to in is was for on are with as at be by this had not but from or have an they which one "
    "you were her all she there would their we him been has when who will more no if out so said what up "
    "its about into than them can only other new some could time these two may then do first any my now "
    "such like our over man me even most made after also did many before must through back years where "
    "much your way well down should because each just those people how too little state good very make "
    "world"
).split()


def _csv_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None):
    p = cli.make_parser(
        "serving",
        "TTFT / TPOT / throughput sweep of a running OpenAI-compatible server (streaming).",
        None,
        "gsm8k",
        num_questions_help="requests per level (default: max(8, 4 x concurrency))",
        parallel_help="run this single concurrency level (overrides --concurrency)",
    )
    p.add_argument("--concurrency", type=_csv_ints, default="1,4,16", help="comma-separated concurrency levels")
    p.add_argument("--input-len", type=_csv_ints, default="128", help="comma-separated prompt lengths (words)")
    p.add_argument("--output-len", type=_csv_ints, default="128", help="comma-separated output lengths (tokens)")
    p.add_argument(
        "--dataset",
        choices=["random", "gsm8k"],
        default="random",
        help="prompt source: random words, or GSM8K test questions (--data-path) cut to --input-len",
    )
    p.add_argument("--api", choices=["chat", "completions"], default="chat", help="endpoint to stream from")
    p.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="do not send ignore_eos (default: send it; without it outputs may be shorter than --output-len)",
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed requests sent before the sweep")
    p.add_argument("--plot", default=None, help="PNG plot (default: --output with .png)")
    args = p.parse_args(argv)
    if args.parallel is not None:
        args.concurrency = [args.parallel]
    return args


def make_prompts(args, input_len: int, n: int, rng: random.Random) -> list[str]:
    """``n`` distinct prompts of ``input_len`` words (distinct: no prefix-cache hits)."""
    if args.dataset == "random":
        return [" ".join(rng.choices(_WORDS, k=input_len)) for _ in range(n)]
    words = " ".join(r["question"] for r in load_gsm8k(args.data_path, "test")).split()
    if len(words) < input_len:
        raise BenchError(f"GSM8K has only {len(words)} words, fewer than --input-len {input_len}")
    starts = [rng.randrange(len(words) - input_len + 1) for _ in range(n)]
    return [" ".join(words[s : s + input_len]) for s in starts]


async def stream_one(client, args, model: str, prompt: str, *, output_len: int) -> dict:
    """One timed streaming request."""
    body = {"model": model, "max_tokens": output_len, "temperature": 0.0, "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.api == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    path = "/chat/completions" if args.api == "chat" else "/completions"
    start = time.perf_counter()
    first = None
    chunks, usage = 0, None
    async for now, event in client.stream(path, body):
        usage = event.get("usage") or usage
        for choice in event.get("choices") or []:
            delta = choice.get("delta") or {}
            text = choice.get("text") or delta.get("content") or delta.get("reasoning_content")
            if text:
                chunks += 1
                first = first or now
    if first is None:
        raise RequestFailed("stream ended without any output text", 1)
    latency = time.perf_counter() - start
    output_tokens = (usage or {}).get("completion_tokens") or chunks
    return {
        "ttft": first - start,
        "latency": latency,
        "tpot": (latency - (first - start)) / (output_tokens - 1) if output_tokens > 1 else None,
        "output_tokens": output_tokens,
        "prompt_tokens": (usage or {}).get("prompt_tokens"),
        "usage_reported": usage is not None,
        "attempts": 1,
    }


def level_summary(records: list[dict], duration: float, **level) -> dict:
    ok = [r for r in records if "error" not in r]
    out_tokens = sum(r["output_tokens"] for r in ok)
    prompt_tokens = [r["prompt_tokens"] for r in ok if r["prompt_tokens"] is not None]

    def ms(key: str) -> dict:
        return describe([r[key] * 1000 for r in ok if r[key] is not None])

    return {
        **level,
        "num_requests": len(records),
        "num_failed": len(records) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_output_tokens": out_tokens,
        "mean_prompt_tokens": sum(prompt_tokens) / len(prompt_tokens) if prompt_tokens else None,
        "ttft_ms": ms("ttft"),
        "tpot_ms": ms("tpot"),
        "latency_ms": ms("latency"),
    }


async def run_serving(args) -> dict:
    rng = random.Random(args.seed)
    levels, records = [], []
    async with cli.connect(args) as (client, model):
        for prompt in make_prompts(args, args.input_len[0], args.warmup, rng):
            try:
                await stream_one(client, args, model, prompt, output_len=min(args.output_len[0], 16))
            except RequestFailed as exc:
                raise BenchError(f"warm-up streaming request failed: {exc}") from exc
        for input_len in args.input_len:
            for output_len in args.output_len:
                for conc in args.concurrency:
                    n = args.num_questions or max(8, 4 * conc)
                    prompts = make_prompts(args, input_len, n, rng)
                    start = time.perf_counter()
                    send = functools.partial(stream_one, client, args, model, output_len=output_len)
                    results = await run_all(prompts, send, conc, f"in={input_len} out={output_len} c={conc}")
                    duration = time.perf_counter() - start
                    level = {"concurrency": conc, "input_len": input_len, "output_len": output_len}
                    levels.append(level_summary(results, duration, **level))
                    records += [{**level, **r} for r in results]
    cli.check_not_all_failed(records)
    top = max(args.concurrency)
    summary = {
        "benchmark": "serving",
        "output_throughput": max(lv["output_throughput"] for lv in levels if lv["concurrency"] == top),
        "max_concurrency": top,
        "num_failed": sum(lv["num_failed"] for lv in levels),
        "model": model,
        "base_url": args.base_url,
        "api": args.api,
        "dataset": args.dataset,
        "ignore_eos": args.ignore_eos,
        "levels": levels,
    }
    plot_path = args.plot or (str(Path(args.output).with_suffix(".png")) if args.output else None)
    if plot_path:
        plot_serving(levels, f"{model} @ {args.base_url} ({args.api}, streaming)", plot_path)
        summary["plot"] = plot_path
    cli.write_output(args.output, summary, records)
    return summary


def main(argv: list[str] | None = None) -> dict:
    """CLI entry point; returns the summary (also written to ``--output``)."""
    args = parse_args(argv)
    return cli.run(lambda: run_serving(args))
