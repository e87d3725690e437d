#!/usr/bin/env python3
"""Decode throughput of one M3 checkpoint served by sglang.Engine, in several modes, in one run.

Modes (each its own engine, started one after another): ``eager`` (no CUDA graphs),
``graphs`` (CUDA-graph decode), ``eagle3_eager`` and ``eagle3_graphs`` (sglang-m3's EAGLE3
chain worker, ``--num-steps`` drafts a step, 3 by default; graphs capture the target's
verify and the draft's passes), ``eagle3_graphs_sync`` (the same with
``--disable-overlap-schedule``: the overlap scheduler's share of the step, same call).
For every batch size: ``batch`` greedy requests of ``--input-len`` prompt tokens and
``--output-len`` new tokens (EOS ignored), timed after one warm-up round, each timed round
``--repeats`` times from a flushed radix cache and its median kept; output tokens/s over the
whole requests, decode tokens/s (the tokens after each request's first over the time past a
prefill-only round of the same requests: ``max_new_tokens=1``), mean
acceptance length (speculative modes) and the ratios to the ``eager`` and ``graphs``
modes at the same batch are written as JSON.

    python3 scripts/bench_e2e.py --out benchmarks/e2e.json [--model-path P --draft-path D]

Defaults: the embedded tiny M3 and its tiny draft (``sglang-m3 tiny-path`` /
``draft-path``). The tiny model is launch-bound, so its ratios measure per-step overhead
(host work, kernel launches, verify rows), not HBM traffic.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import statistics
import sys
import time

from sglang_m3.bench.stats import timed_rounds

MODES = ("eager", "graphs", "eagle3_eager", "eagle3_graphs", "eagle3_graphs_sync")
SPEC = dict(speculative_algorithm="EAGLE3", speculative_eagle_topk=1)  # a chain: one draft per step


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", default=None, help="M3 checkpoint (default: the embedded tiny M3)")
    p.add_argument("--draft-path", default=None, help="EAGLE3 draft (default: the embedded tiny draft)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {MODES}")
    p.add_argument("--batches", default="1,8", help="comma list of batch sizes")
    p.add_argument(
        "--prompts",
        default="corpus",
        choices=["corpus", "probe"],
        help="corpus: distinct --input-len cuts of the shipped corpus; probe: the prompts the tiny draft memorised "
        "(acceptance near its maximum: the worker's cost and benefit at high acceptance, not a real draft's)",
    )
    p.add_argument("--num-steps", type=int, default=3, help="EAGLE3 draft tokens per step (K; K + 1 verify rows)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--repeats", type=timed_rounds, default=3, help="timed rounds per measurement (median kept)")
    p.add_argument("--max-total-tokens", type=int, default=65536, help="KV pool size (small pools start fast)")
    p.add_argument("--out", default="bench_results/e2e.json", help="JSON output path")
    args = p.parse_args(argv)
    return args


def prompts(args, n: int) -> list[list[int]]:
    """``n`` prompts: distinct corpus cuts of ``--input-len`` tokens (no radix hits), or the probe set."""
    from sglang_m3.tiny.prompts import corpus_ids, probe_prompts
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    if args.prompts == "probe":
        probe = probe_prompts(tokenizer)
        return [probe[i % len(probe)] for i in range(n)]
    ids, length = corpus_ids(tokenizer), args.input_len
    return [ids[i * length + i : (i + 1) * length + i] for i in range(n)]


def engine_args(mode: str, args, batches: list[int]) -> dict:
    """``sglang.Engine`` arguments of one mode."""
    if mode not in MODES:
        raise SystemExit(f"--modes: unknown mode {mode!r}; choose from {', '.join(MODES)}")
    kw = dict(
        model_path=args.model_path,
        device=args.device,
        dtype=args.dtype,
        log_level="error",
        mem_fraction_static=0.5,
        max_total_tokens=args.max_total_tokens,
        disable_cuda_graph="graphs" not in mode,
        cuda_graph_max_bs_decode=max(batches),
    )
    if mode.startswith("eagle3"):
        if args.num_steps < 1:
            raise SystemExit(f"--num-steps={args.num_steps}: EAGLE3 drafts at least one token a step")
        kw.update(
            SPEC,
            speculative_num_steps=args.num_steps,
            speculative_num_draft_tokens=args.num_steps + 1,
            speculative_draft_model_path=args.draft_path,
        )
    if mode.endswith("_sync"):
        kw["disable_overlap_schedule"] = True
    return kw


def rates(tokens: int, batch: int, elapsed: float, prefill: float) -> dict:
    """Output tokens/s over the whole requests, and decode tokens/s: each request's tokens after
    its first (the prefill's) over the time the requests took past a prefill-only round."""
    decode = elapsed - prefill
    return dict(
        output_tokens_per_s=tokens / elapsed,
        prefill_s=prefill,
        decode_tokens_per_s=(tokens - batch) / decode if decode > 0 else None,
    )


def ratios(record: dict, records: list[dict]) -> dict:
    """``record``'s output and decode rates over those of the ``eager`` and ``graphs`` modes at its batch
    (None where that mode did not run)."""
    out = {}
    for base_mode in ("eager", "graphs"):
        base = next((r for r in records if r["mode"] == base_mode and r["batch"] == record["batch"]), None)
        for key, rate in (("", "output_tokens_per_s"), ("decode_", "decode_tokens_per_s")):
            ok = base is not None and record.get(rate) and base.get(rate)
            out[f"{key}vs_{base_mode}"] = record[rate] / base[rate] if ok else None
    return out


def median_round(run, flush, repeats: int, clock=time.perf_counter):
    """(median seconds of ``repeats`` calls of ``run``, each after ``flush``: no radix hits; the last
    call's result)."""
    times, result = [], None
    for _ in range(repeats):
        flush()
        start = clock()
        result = run()
        times.append(clock() - start)
    return statistics.median(times), result


def run_mode(mode: str, args, batches: list[int]) -> list[dict]:
    import sglang as sgl

    engine = sgl.Engine(**engine_args(mode, args, batches))
    records = []
    try:
        for bs in batches:
            batch = prompts(args, bs)
            sampling = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
            engine.generate(input_ids=batch, sampling_params=sampling)  # warm-up (and graph paths)
            prefill_only = {**sampling, "max_new_tokens": 1}
            prefill, _ = median_round(
                lambda: engine.generate(input_ids=batch, sampling_params=prefill_only), engine.flush_cache, args.repeats
            )
            elapsed, outs = median_round(
                lambda: engine.generate(input_ids=batch, sampling_params=sampling), engine.flush_cache, args.repeats
            )
            tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
            steps = sum(o["meta_info"].get("spec_verify_ct") or 0 for o in outs)
            records.append(
                dict(
                    mode=mode,
                    batch=bs,
                    output_tokens=tokens,
                    elapsed_s=elapsed,
                    **rates(tokens, bs, elapsed, prefill),
                    mean_acceptance_length=(tokens - bs) / steps if steps else None,  # first token: prefill
                )
            )
            print(json.dumps(records[-1]), flush=True)
            engine.flush_cache()
    finally:
        engine.shutdown()
    return records


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    from sglang_m3.tiny import default_checkpoint
    from sglang_m3.tiny.draft import default_draft

    args.model_path = args.model_path or str(default_checkpoint("m3-tiny", "vl"))
    args.draft_path = args.draft_path or str(default_draft("m3-tiny"))
    batches = [int(b) for b in args.batches.split(",")]
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    modes = args.modes.split(",")
    for mode in modes:
        engine_args(mode, args, batches)  # an unknown mode fails before any engine starts
    records = []
    for mode in modes:
        records += run_mode(mode, args, batches)
        _write(out, args, argv, records)  # after every mode: a later failure keeps what was measured
    print(f"wrote {out}")
    return json.loads(out.read_text())


def _write(out: pathlib.Path, args, argv: list[str], records: list[dict]) -> None:
    for r in records:
        r.update(ratios(r, records))
    summary = dict(
        benchmark="e2e_decode",
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command="python3 scripts/bench_e2e.py " + " ".join(argv),
        model_path=args.model_path,
        draft_path=args.draft_path,
        prompts=args.prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        num_steps=args.num_steps,
        dtype=args.dtype,
        repeats=args.repeats,
        records=records,
    )
    try:
        import torch

        summary["device_name"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001 -- informational only
        pass
    out.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
