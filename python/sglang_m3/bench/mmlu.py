"""MMLU accuracy (57 subjects, 5-shot from dev) over the OpenAI chat API.

The prompt is the standard MMLU few-shot document of Hendrycks et al.
("The following are multiple choice questions (with answers) about X." then
k solved dev questions and the test question ending in "Answer:"), sent as
one user message with a one-line instruction to answer with a letter, since
chat models otherwise tend to explain.  :func:`extract.extract_choice` finds
the letter in whatever comes back.  Reported: per-subject accuracy with 95%
Wilson intervals, micro accuracy (all questions pooled; the top-level
``accuracy``) and macro accuracy (mean over subjects).  Failed requests count
as wrong and are listed in ``num_errors``.
"""

from __future__ import annotations

import time

from . import cli
from .client import reply_fields, run_all
from .datasets import load_mmlu
from .extract import extract_choice
from .stats import accuracy_summary


def format_question(row: dict, with_answer: bool) -> str:
    options = "\n".join(f"{letter}. {text}" for letter, text in zip("ABCD", row["choices"]))
    answer = f" {row['answer']}\n\n" if with_answer else ""
    return f"{row['question']}\n{options}\nAnswer:{answer}"


def build_prompt(subject: str, row: dict, shots: list[dict]) -> str:
    """The few-shot document for one test question."""
    header = (
        f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}. "
        "Answer the last question with the letter (A, B, C or D) of the correct option.\n\n"
    )
    return header + "".join(format_question(s, True) for s in shots) + format_question(row, False)


def parse_args(argv: list[str] | None):
    p = cli.make_parser(
        "mmlu",
        "MMLU accuracy of a running OpenAI-compatible server.",
        64,
        "mmlu",
        num_questions_help="at most this many test questions per subject (default: all)",
    )
    p.add_argument("--num-shots", type=int, default=5, help="solved dev questions per prompt (dev has 5)")
    p.add_argument("--subjects", default=None, help="comma-separated subset of subjects (default: all found)")
    cli.add_generation_args(p, thinking_max_tokens=8192, plain_max_tokens=64)
    return p.parse_args(argv)


async def run_mmlu(args) -> dict:
    subjects = args.subjects.split(",") if args.subjects else None
    test = load_mmlu(args.data_path, "test", subjects)
    dev = load_mmlu(args.data_path, "dev", list(test))
    items = [(subject, row) for subject, rows in test.items() for row in rows[: args.num_questions]]
    params = cli.generation_params(args, thinking_max_tokens=8192, plain_max_tokens=64)
    async with cli.connect(args) as (client, model):

        async def ask(item: tuple[str, dict]) -> dict:
            subject, row = item
            prompt = build_prompt(subject, row, dev[subject][: args.num_shots])
            response, attempts = await client.chat(model, [{"role": "user", "content": prompt}], **params)
            return {**reply_fields(response), "attempts": attempts}

        start = time.perf_counter()
        results = await run_all(items, ask, args.parallel, "mmlu")
        elapsed = time.perf_counter() - start

    records = []
    for (subject, row), result in zip(items, results):
        pred = None if "error" in result else extract_choice(result["response"], row["choices"])
        records.append(
            {
                "subject": subject,
                "question": row["question"],
                "gold": row["answer"],
                "pred": pred,
                "correct": pred == row["answer"],
                **result,
            }
        )
    cli.check_not_all_failed(records)
    per_subject = {}
    for subject in test:
        mine = [r for r in records if r["subject"] == subject]
        if mine:
            per_subject[subject] = accuracy_summary(sum(r["correct"] for r in mine), len(mine))
    summary = {
        "benchmark": "mmlu",
        **accuracy_summary(sum(r["correct"] for r in records), len(records)),
        "macro_accuracy": sum(s["accuracy"] for s in per_subject.values()) / len(per_subject),
        "num_subjects": len(per_subject),
        **cli.run_counts(records, model, args, params),
        "elapsed_s": elapsed,
        "per_subject": per_subject,
    }
    cli.write_output(args.output, summary, records)
    return summary


def main(argv: list[str] | None = None) -> dict:
    """CLI entry point; returns the summary (also written to ``--output``)."""
    args = parse_args(argv)
    return cli.run(lambda: run_mmlu(args))
