"""Serving latency/throughput sweep over the OpenAI streaming API.

For every (input length, output length, concurrency) level, ``n`` streaming
requests run with at most ``concurrency`` in flight; per request:

* TTFT: request start to the first chunk carrying text (content or reasoning),
* TPOT: (latency - TTFT) / (output tokens - 1),
* output tokens: the final ``usage`` chunk (``stream_options.include_usage``),
  else the number of text chunks.

Prompts (``--api``):

* ``completions`` (default): token ids sent as ``prompt`` to ``/v1/completions``,
  so the server sees exactly ``--input-len`` tokens, as SGLang's own
  ``bench_serving`` with random ids. ``--dataset random`` draws them with
  ``--seed`` from the tokenizer's vocabulary less its added (special) tokens,
  read from ``tokenizer.json`` (``--tokenizer``, else the server's
  ``/model_info`` tokenizer path when it is local); ``--dataset gsm8k`` cuts
  windows from the GSM8K test questions tokenized by the server's
  ``/v1/tokenize``.
* ``chat``: ``--input-len`` words (random common words or GSM8K text) as one
  user message through the server's chat template, which adds its own tokens.

The prompt length the server reports in ``usage`` is recorded per request and
as ``mean_prompt_tokens`` per level and overall.  Output length is forced with
``max_tokens`` plus ``ignore_eos`` (an extra field SGLang and vLLM accept;
``--no-ignore-eos`` for servers that reject it).  Streamed requests are never
retried (that would corrupt their timing); failures are counted per level.
Headline: ``output_throughput`` = best output tokens/s at the highest
concurrency.
"""

from __future__ import annotations

import functools
import random
import sys
import time
from pathlib import Path

from . import cli
from .client import BenchError, RequestFailed, run_all
from .datasets import load_gsm8k
from .plot import plot_serving
from .plot import require as require_plot
from .stats import describe
from .vocab import hub_tokenizer_file, local_tokenizer_file, vocab_ids

# Common short English words (--api chat): about one token each for BPE tokenizers.
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
    p.add_argument("--seed", type=int, default=0, help="seed of the random token prompts")
    p.add_argument(
        "--input-len",
        type=_csv_ints,
        default="128",
        help="comma-separated prompt lengths: tokens the server sees (--api completions), "
        "or words of the user message (--api chat; the chat template adds its tokens)",
    )
    p.add_argument("--output-len", type=_csv_ints, default="128", help="comma-separated output lengths (tokens)")
    p.add_argument(
        "--dataset",
        choices=["random", "gsm8k"],
        default="random",
        help="prompt source: random tokens (or words with --api chat), or windows of the GSM8K test questions "
        "(--data-path)",
    )
    p.add_argument(
        "--api",
        choices=["completions", "chat"],
        default="completions",
        help="completions: token-id prompts of exactly --input-len tokens to /v1/completions (default); "
        "chat: text prompts through the server's chat template, /v1/chat/completions",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer.json, a folder holding it, or a Hugging Face model id, whose vocabulary random token-id "
        "prompts are drawn from (default: the server's /model_info tokenizer_path or model_path, if local)",
    )
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


async def find_tokenizer(client, args, model: str) -> Path:
    """The ``tokenizer.json`` random token ids are drawn from."""
    if args.tokenizer:
        path = local_tokenizer_file(args.tokenizer) or hub_tokenizer_file(args.tokenizer)
        if path is None:
            raise BenchError(
                f"--tokenizer {args.tokenizer}: no tokenizer.json there "
                "(pass the file, a folder holding it, or a Hugging Face model id)"
            )
        return path
    info = await client.get_json("/model_info", native=True) or await client.get_json("/get_model_info", native=True)
    tried = [s for s in ((info or {}).get("tokenizer_path"), (info or {}).get("model_path"), model) if s]
    for spec in tried:
        path = local_tokenizer_file(spec)
        if path is not None:
            return path
    raise BenchError(
        f"random token-id prompts need the served model's tokenizer.json; none found at {tried} (the server's "
        "/model_info tokenizer_path and model_path, the model name). Pass --tokenizer (tokenizer.json, a folder "
        "holding it, or a Hugging Face model id), or --api chat for text prompts through the chat template"
    )


async def tokenize(client, model: str, text: str) -> list[int]:
    """Token ids of ``text`` by the server's own tokenizer (SGLang's ``/v1/tokenize``), no special tokens added."""
    try:
        out, _ = await client.post_json("/tokenize", {"model": model, "prompt": text, "add_special_tokens": False})
    except RequestFailed as exc:
        raise BenchError(
            f"--dataset gsm8k with --api completions tokenizes the questions with the server's /v1/tokenize, "
            f"which failed ({exc}); use --api chat for text prompts"
        ) from exc
    return [int(t) for t in out["tokens"]]


async def prompt_pool(client, args, model: str) -> tuple[list, dict]:
    """What prompts are cut from: token ids (``--api completions``) or words (chat), and a summary of it."""
    if args.dataset == "gsm8k":
        text = " ".join(r["question"] for r in load_gsm8k(args.data_path, "test"))
        if args.api == "chat":
            return text.split(), {"prompt_format": "text"}
        return await tokenize(client, model, text), {"prompt_format": "token_ids", "tokenizer": "server /v1/tokenize"}
    if args.api == "chat":
        return list(_WORDS), {"prompt_format": "text"}
    path = await find_tokenizer(client, args, model)
    return vocab_ids(path), {"prompt_format": "token_ids", "tokenizer": str(path)}


def make_prompts(args, pool: list, input_len: int, n: int, rng: random.Random) -> list:
    """``n`` distinct prompts of ``input_len`` units of ``pool`` (distinct: no prefix-cache hits): token-id
    lists for ``--api completions``, text for chat."""
    if args.dataset == "random":
        prompts = [rng.choices(pool, k=input_len) for _ in range(n)]
    else:
        if len(pool) < input_len:
            unit = "words" if args.api == "chat" else "tokens"
            raise BenchError(f"GSM8K has only {len(pool)} {unit}, fewer than --input-len {input_len}")
        starts = [rng.randrange(len(pool) - input_len + 1) for _ in range(n)]
        prompts = [pool[s : s + input_len] for s in starts]
    return [" ".join(p) for p in prompts] if args.api == "chat" else prompts


async def stream_one(client, args, model: str, prompt: str | list[int], *, output_len: int) -> dict:
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
        "mean_prompt_tokens": _mean(prompt_tokens),
        "ttft_ms": ms("ttft"),
        "tpot_ms": ms("tpot"),
        "latency_ms": ms("latency"),
    }


def _mean(values: list) -> float | None:
    return sum(values) / len(values) if values else None


async def run_serving(args) -> dict:
    rng = random.Random(args.seed)
    levels, records = [], []
    plot_path = args.plot or (str(Path(args.output).with_suffix(".png")) if args.output else None)
    if plot_path:
        require_plot()  # fail before the run, not after it
    async with cli.connect(args) as (client, model):
        pool, source = await prompt_pool(client, args, model)
        for prompt in make_prompts(args, pool, args.input_len[0], args.warmup, rng):
            try:
                await stream_one(client, args, model, prompt, output_len=min(args.output_len[0], 16))
            except RequestFailed as exc:
                raise BenchError(f"warm-up streaming request failed: {exc}") from exc
        for input_len in args.input_len:
            for output_len in args.output_len:
                for conc in args.concurrency:
                    n = args.num_questions or max(8, 4 * conc)
                    prompts = make_prompts(args, pool, input_len, n, rng)
                    start = time.perf_counter()
                    send = functools.partial(stream_one, client, args, model, output_len=output_len)
                    results = await run_all(prompts, send, conc, f"in={input_len} out={output_len} c={conc}")
                    duration = time.perf_counter() - start
                    level = {"concurrency": conc, "input_len": input_len, "output_len": output_len}
                    levels.append(level_summary(results, duration, **level))
                    records += [{**level, **r} for r in results]
    cli.check_not_all_failed(records)
    if source["prompt_format"] == "token_ids":
        for lv in levels:  # what the server reported against what was sent
            seen = lv["mean_prompt_tokens"]
            if seen is not None and seen != lv["input_len"]:
                print(
                    f"warning: sent {lv['input_len']} prompt tokens, the server reported {seen:g} on average",
                    file=sys.stderr,
                )
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
        **source,
        # The server's usage.prompt_tokens over every request that reported it (None: none did).
        "mean_prompt_tokens": _mean([r["prompt_tokens"] for r in records if r.get("prompt_tokens") is not None]),
        "ignore_eos": args.ignore_eos,
        "levels": levels,
    }
    if plot_path:
        plot_serving(levels, f"{model} @ {args.base_url} ({args.api}, streaming)", plot_path)
        summary["plot"] = plot_path
    cli.write_output(args.output, summary, records)
    return summary


def main(argv: list[str] | None = None) -> dict:
    """CLI entry point; returns the summary (also written to ``--output``)."""
    args = parse_args(argv)
    return cli.run(lambda: run_serving(args))
