"""Speculative-decoding acceptance probe against a running SGLang server.

SGLang's OpenAI endpoints do not return speculative statistics, its native
``/generate`` does, in ``meta_info`` of each finished request (SGLang 0.5.17,
``TokenizerManager._calculate_spec_decoding_metrics``):

* ``completion_tokens`` and ``spec_verify_ct`` (verify steps; each emits the
  accepted drafts plus one bonus token),
* ``spec_num_correct_drafts`` / ``spec_num_proposed_drafts`` (the server's
  own acceptance rate, proposed = steps x (speculative_num_draft_tokens - 1)),
* ``spec_correct_drafts_histogram``: entry k = number of verify steps that
  accepted exactly k drafts.

So each prompt is rendered with the server's chat template via
``POST /v1/tokenize`` (``messages`` -> token ids) and then generated with
``POST /generate`` from those ids.  Reported: mean acceptance length (1 +
accepted drafts / verify steps; the token the prefill emits is not a verify
step's), acceptance rate ((length - 1) / drafts per step), the server's
rate, per-position acceptance (fraction of steps that accepted draft
position j, from the histogram), both histograms and, for
GSM8K prompts, the accuracy of the speculative outputs as a sanity check.
Drafts per step: ``--num-draft-tokens``, else the server's
``speculative_num_steps`` from ``/server_info`` (or its
``speculative_num_draft_tokens - 1``), else 3.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from . import cli
from .client import BenchError, run_all
from .datasets import load_gsm8k
from .extract import answers_equal, extract_gsm8k_answer, gsm8k_gold
from .gsm8k import build_messages
from .plot import plot_acceptance
from .plot import require as require_plot
from .stats import describe

DEFAULT_DRAFT_TOKENS = 3


def parse_args(argv: list[str] | None):
    p = cli.make_parser(
        "acceptance",
        "Speculative decoding acceptance statistics of a running SGLang server (native /generate).",
        16,
        "gsm8k",
    )
    p.add_argument(
        "--prompts-file",
        default=None,
        help="JSONL of {'messages': [...]} chat prompts to use instead of zero-shot GSM8K test questions",
    )
    p.add_argument(
        "--num-draft-tokens",
        type=int,
        default=None,
        help="draft tokens per verify step (default: the server's speculative_num_steps, "
        f"else its speculative_num_draft_tokens - 1, else {DEFAULT_DRAFT_TOKENS})",
    )
    cli.add_generation_args(p, thinking_max_tokens=4096, plain_max_tokens=512)
    p.add_argument("--plot", default=None, help="histogram PNG (default: --output with .png)")
    return p.parse_args(argv)


def load_prompts(args) -> list[dict]:
    """``[{"messages": [...], "gold": str | None}]`` from --prompts-file or GSM8K test."""
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        if not all(isinstance(r, dict) and isinstance(r.get("messages"), list) for r in rows):
            raise BenchError(f"{args.prompts_file}: every line must be a JSON object with a 'messages' list")
        prompts = [{"messages": r["messages"], "gold": None} for r in rows]
    else:
        prompts = [
            {"messages": build_messages(r["question"], []), "gold": gsm8k_gold(r["answer"])}
            for r in load_gsm8k(args.data_path, "test")
        ]
    return prompts[: args.num_questions]


async def draft_tokens_per_step(client, args) -> tuple[int, dict]:
    """(drafts per step, server's speculative settings); BenchError if spec is off."""
    info = await client.get_json("/server_info", native=True) or await client.get_json("/get_server_info", native=True)
    settings = {k: v for k, v in (info or {}).items() if k.startswith("speculative_") and not isinstance(v, dict)}
    if info is not None and not info.get("speculative_algorithm"):
        raise BenchError(
            f"the server at {client.root_url} runs without speculative decoding "
            "(server_info.speculative_algorithm is empty); start it with --speculative-algorithm"
        )
    if args.num_draft_tokens:
        return args.num_draft_tokens, settings
    if settings.get("speculative_num_steps"):
        return int(settings["speculative_num_steps"]), settings
    if settings.get("speculative_num_draft_tokens"):  # e.g. NGRAM, which has no draft steps
        return int(settings["speculative_num_draft_tokens"]) - 1, settings
    print(f"warning: server info unavailable, assuming {DEFAULT_DRAFT_TOKENS} draft tokens per step", file=sys.stderr)
    return DEFAULT_DRAFT_TOKENS, settings


def request_length(r: dict) -> float:
    """Tokens committed per verify step: 1 + accepted drafts / steps when the server counts
    accepted drafts (exact), else completion tokens / steps (SGLang's ``spec_accept_length``,
    which also counts the one token the prefill emits)."""
    if r.get("spec_num_correct_drafts") is not None:
        return 1 + r["spec_num_correct_drafts"] / r["spec_verify_ct"]
    return r["completion_tokens"] / r["spec_verify_ct"]


def aggregate(records: list[dict], drafts: int) -> dict:
    """Acceptance statistics over the records that carry speculative stats."""
    stats = [r for r in records if r.get("spec_verify_ct")]
    tokens = sum(r["completion_tokens"] for r in stats)
    steps = sum(r["spec_verify_ct"] for r in stats)
    length = sum(request_length(r) * r["spec_verify_ct"] for r in stats) / steps
    out = {
        "mean_acceptance_length": length,
        "acceptance_rate": (length - 1) / drafts,
        "num_draft_tokens": drafts,
        "total_completion_tokens": tokens,
        "total_verify_steps": steps,
        "per_request_acceptance_length": describe([request_length(r) for r in stats]),
    }
    proposed = sum(r.get("spec_num_proposed_drafts") or 0 for r in stats)
    if proposed:
        out["server_acceptance_rate"] = sum(r.get("spec_num_correct_drafts") or 0 for r in stats) / proposed
    hists = [r["spec_correct_drafts_histogram"] for r in stats if r.get("spec_correct_drafts_histogram")]
    if hists:
        total = [0] * max(drafts + 1, *(len(h) for h in hists))
        for h in hists:
            for k, n in enumerate(h):
                total[k] += n
        out["accepted_drafts_histogram"] = total
        # Position j is accepted in every step that accepted at least j drafts.
        out["per_position_acceptance"] = [sum(total[j:]) / sum(total) for j in range(1, len(total))]
    return out


async def run_acceptance(args) -> dict:
    prompts = load_prompts(args)
    plot_path = args.plot or (str(Path(args.output).with_suffix(".png")) if args.output else None)
    if plot_path:
        require_plot()  # fail before the run, not after it
    params = cli.generation_params(args, thinking_max_tokens=4096, plain_max_tokens=512)
    sampling = {"max_new_tokens": params["max_tokens"], "temperature": params["temperature"]}
    async with cli.connect(args) as (client, model):
        drafts, settings = await draft_tokens_per_step(client, args)

        async def probe(i: int) -> dict:
            body = {"model": model, "messages": prompts[i]["messages"]}
            if "chat_template_kwargs" in params:
                body["chat_template_kwargs"] = params["chat_template_kwargs"]
            tokenized, attempts_t = await client.post_json("/tokenize", body)
            out, attempts_g = await client.post_json(
                "/generate", {"input_ids": tokenized["tokens"], "sampling_params": sampling}, native=True
            )
            meta = out.get("meta_info") or {}
            keep = (
                "completion_tokens",
                "spec_verify_ct",
                "spec_num_correct_drafts",
                "spec_num_proposed_drafts",
                "spec_correct_drafts_histogram",
            )
            return {
                "response": out.get("text", ""),
                "prompt_tokens": len(tokenized["tokens"]),
                **{k: meta[k] for k in keep if k in meta},
                "attempts": max(attempts_t, attempts_g),
            }

        start = time.perf_counter()
        records = await run_all(range(len(prompts)), probe, args.parallel, "acceptance")
        elapsed = time.perf_counter() - start

    cli.check_not_all_failed(records)
    if not any(r.get("spec_verify_ct") for r in records):
        raise BenchError(
            "the server returned no speculative statistics (meta_info.spec_verify_ct) from /generate; "
            "is speculative decoding enabled?"
        )
    for i, r in enumerate(records):
        r["index"] = i
        if prompts[i]["gold"] is not None and "error" not in r:
            r["correct"] = answers_equal(extract_gsm8k_answer(r["response"]), prompts[i]["gold"])
    summary = {"benchmark": "acceptance", **aggregate(records, drafts)}
    scored = [r for r in records if "correct" in r]
    if scored:
        summary["accuracy"] = sum(r["correct"] for r in scored) / len(scored)
    summary.update(
        {
            "num_requests": len(records),
            "num_errors": sum("error" in r for r in records),
            "num_without_stats": sum("error" not in r and not r.get("spec_verify_ct") for r in records),
            "model": model,
            "base_url": args.base_url,
            "server_speculative_settings": settings,
            "thinking": args.thinking,
            **sampling,
            "elapsed_s": elapsed,
        }
    )
    if plot_path:
        lengths = [request_length(r) for r in records if r.get("spec_verify_ct")]
        plot_acceptance(summary, lengths, plot_path)
        summary["plot"] = plot_path
    cli.write_output(args.output, summary, records)
    return summary


def main(argv: list[str] | None = None) -> dict:
    """CLI entry point; returns the summary (also written to ``--output``)."""
    args = parse_args(argv)
    return cli.run(lambda: run_acceptance(args))
