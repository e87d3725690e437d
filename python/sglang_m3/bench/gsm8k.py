"""GSM8K accuracy over the OpenAI-compatible chat API.

Prompts are chat conversations: with ``--num-shots k`` the k worked examples
(sampled once, with ``--seed``, from the *train* split so they never overlap
the test questions) are user/assistant turns teaching the ``#### n`` answer
format; with ``--num-shots 0`` a single instruction asks for that format.
The same shots are used for every question so the server's prefix cache can
share them.  Scoring: :func:`extract.extract_gsm8k_answer` on the reply with
reasoning stripped, compared numerically with the gold ``#### n``.  A request
that fails after retries counts as wrong and is listed in ``num_errors``.
"""

from __future__ import annotations

import random
import re
import time

from . import cli
from .client import reply_fields, run_all
from .datasets import load_gsm8k
from .extract import answers_equal, extract_gsm8k_answer, gsm8k_gold
from .stats import accuracy_summary

INSTRUCTION = (
    "Solve the following math problem step by step. "
    "Write the final answer as a plain number on the last line, in the form '#### <number>'."
)
_CALCULATOR_RE = re.compile(r"<<[^>]*>>")


def build_messages(question: str, shots: list[dict]) -> list[dict]:
    """Chat messages for one question; shots are GSM8K train records."""
    messages: list[dict] = []
    for i, shot in enumerate(shots):
        prefix = INSTRUCTION + "\n\n" if i == 0 else ""
        messages.append({"role": "user", "content": f"{prefix}Question: {shot['question']}"})
        # Drop the <<48/2=24>> calculator annotations: no model should imitate them.
        messages.append({"role": "assistant", "content": _CALCULATOR_RE.sub("", shot["answer"])})
    prefix = "" if shots else INSTRUCTION + "\n\n"
    messages.append({"role": "user", "content": f"{prefix}Question: {question}"})
    return messages


def parse_args(argv: list[str] | None):
    p = cli.make_parser("gsm8k", "GSM8K accuracy of a running OpenAI-compatible server.", 64, "gsm8k")
    p.add_argument("--num-shots", type=int, default=5, help="few-shot examples from the train split (0: zero-shot)")
    p.add_argument("--seed", type=int, default=0, help="seed of the few-shot examples' sample")
    cli.add_generation_args(p, thinking_max_tokens=16384, plain_max_tokens=1024)
    return p.parse_args(argv)


async def run_gsm8k(args) -> dict:
    test = load_gsm8k(args.data_path, "test")[: args.num_questions]
    shots = (
        random.Random(args.seed).sample(load_gsm8k(args.data_path, "train"), args.num_shots) if args.num_shots else []
    )
    params = cli.generation_params(args, thinking_max_tokens=16384, plain_max_tokens=1024)
    async with cli.connect(args) as (client, model):

        async def ask(index: int) -> dict:
            response, attempts = await client.chat(model, build_messages(test[index]["question"], shots), **params)
            return {**reply_fields(response), "attempts": attempts}

        start = time.perf_counter()
        results = await run_all(range(len(test)), ask, args.parallel, "gsm8k")
        elapsed = time.perf_counter() - start

    records = []
    for i, (row, result) in enumerate(zip(test, results)):
        gold = gsm8k_gold(row["answer"])
        pred = None if "error" in result else extract_gsm8k_answer(result["response"])
        records.append(
            {
                "index": i,
                "question": row["question"],
                "gold": gold,
                "pred": pred,
                "correct": answers_equal(pred, gold),
                **result,
            }
        )
    cli.check_not_all_failed(records)
    summary = {
        "benchmark": "gsm8k",
        **accuracy_summary(sum(r["correct"] for r in records), len(records)),
        **cli.run_counts(records, model, args, params),
        "completion_tokens": sum(r.get("completion_tokens") or 0 for r in records),
        "elapsed_s": elapsed,
    }
    cli.write_output(args.output, summary, records)
    return summary


def main(argv: list[str] | None = None) -> dict:
    """CLI entry point; returns the summary (also written to ``--output``)."""
    args = parse_args(argv)
    return cli.run(lambda: run_gsm8k(args))
