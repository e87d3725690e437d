#!/usr/bin/env python3
"""EAGLE3 spec-step phases of a real-width M3: plain decode, the whole spec step, verify, draft.

Target: the released config.json cut to ``--cuts`` (``D+S``: the first D dense and first S sparse layers,
``scripts/bench_scaled.py``'s ``cut_config``), ``--load-format dummy``, ``--tp-size`` / ``--ep-size`` (1),
CUDA graphs captured only at ``--batches``. Draft: a generated (temp dir, never committed)
``LlamaForCausalLMEagle3`` config with the shape of the public M3 drafts (``Inferact/MiniMax-M3-EAGLE3`` /
``-GQA``): 1 layer, the target's hidden size (6144) and head_dim (128), 64 q heads, ``--draft-kv-heads`` KV
heads (4: the GQA draft; 64: the MHA one), full vocabulary (200,064, no ``d2t``; ``--draft-vocab N`` heads it
with the first N ids instead, as vocabulary-pruned drafts do: timing only, dummy weights carry no ``d2t``),
rope theta as the target's, dummy weights too. ``intermediate_size`` is not public: 12,288 is our choice (with
an own embedding, which sglang-m3 does not load since the target's is shared: 2.96B params GQA / 3.15B MHA,
beside the ~3.3B the public drafts report). Captured layers: outputs ``(0, (N-1)//2, N-2)`` of the N-layer cut
(first, middle, last-but-one: (0, 1, 2) at 1+3, (0, 3, 6) at 1+7; the released draft's (2, 30, 57) do not
exist in a cut). Random weights accept ~nothing (AL ~1): the run times the phases, and speed-ups at given
acceptance lengths are *projected*.

Per cut, two engines, each its own process (one failing keeps the rest): ``decode`` (no speculation) and
``spec`` (EAGLE3, K = ``--num-steps`` = 3, topk 1, K + 1 = 4 draft tokens). Per batch (``--input-len``
prompts):

* ``t_decode``: streamed full-batch TPOT of the plain engine (``bench_scaled.decode_tpot``);
* ``t_step``: streamed time per verify step of the spec engine, while the whole batch decodes (steps counted
  by ``meta_info["spec_verify_ct"]``, or by streamed chunks where that is absent); both the lower median of
  ``--repeats`` rounds (each kept in the raw record's ``ms_repeats``);
* ``t_verify``, ``t_draft``: from a torch-profiler GPU trace of spec steps (CUDA only). ASSUMPTION (worker.py
  ``_decode`` / draft_graphs.py): with graphs on, one spec step is exactly three ``cudaGraphLaunch`` calls in
  this order: the draft chain (K - 1 draft decodes), the target's verify, the draft catch-up; acceptance and
  the static-buffer copies run as eager kernels between them. GPU work (trace cat ``kernel`` / ``gpu_memcpy`` /
  ``gpu_memset``) is assigned to the launch whose runtime event (cat ``cuda_runtime``) has the same
  ``args.correlation``; a phase's time is the span from its first kernel's start to its last kernel's end.
  The verify launch is the one of each three that runs the target's MoE kernels (the draft has none); in a
  trace without MoE kernels, the one with the most kernels. (Kernel counts alone mislead at real width: the
  chain's two draft decodes launch as many kernels as a 4-layer target's verify.) The script fails (an
  ``error`` record, exit status 1) if the launches don't repeat in threes with the verify so placed, or their
  kernel counts vary from step to step (a leading partial step and a trailing one whose catch-up had not run
  when the trace stopped are dropped, and counted);
* ``overhead = t_step - t_verify - t_draft`` (host work, eager acceptance kernels, launch gaps);
* projections to the released layer counts (its dense / sparse layer lists) from the first cut alone
  (``first_cut_projection``): each MoE layer costs the first cut's measured MoE time per layer (from its
  trace: the routing the dummy weights make, which is not random: see benchmarks/e2e.md), the rest of its
  time scales with the non-expert floor bytes of a dense or sparse layer (``sizing``); fixed part = head +
  draft + host. Every other cut's measurement checks it (error reported); a least-squares fit over all
  cuts is given beside it. Projected speed-up
  ``AL x t_decode / t_step`` at ``--accept-lengths`` beside the same ratio of the HBM floors
  (``decode_step_bytes``; verify = the same with K + 1 rows per request, experts touched by bs x (K + 1)
  rows, plus ``draft_step_bytes``). A graph's shape does not depend on acceptance, so ``t_step`` measured at
  AL ~1 holds at any AL (the context grows faster: negligible over a step).

Routing: with dummy weights greedy decoding repeats one token per request (checked on CPU with the tiny
M3 and ``--load-format dummy``), so each row routes to the same experts at every step and the experts a
batch touches depend on its prompts and the cut, not on chance. ``--temperature 1`` samples near-uniform
tokens from the dummy head's near-flat logits, so rows route close to random routing, as real text does
more nearly; it adds the sampler's cost to every step, verify rows included. ``--top-p`` below 1 makes the
sampled requests filter their distribution too (what the EAGLE3 worker's acceptance then shapes per verify row).
Sampling leaves the verify rows' drafts greedy (the dummy draft's proposals repeat: at batch 1 a verify read
2.3x a decode step's experts on an H100, random routing 3.8x). ``--routing uniform`` (``bench_scaled``'s)
routes every token of every layer at random instead, whatever the tokens, so each cut's MoE time per layer is
random routing's and the projection from one cut carries to another (1+3 -> 1+7 within 4 % on one H200).

Memory: the 1+7 cut is ~102 GiB of weights + 5.5 GiB of draft; 64 x 8K prompts fit at bf16 KV with the GQA
draft; the 64-KV-head draft adds 32 KiB / token of draft KV (use it with 1+3 or smaller batches).

    python3 scripts/bench_spec.py --cuts 1+3,1+7 --routing uniform --out benchmarks/e2e_spec_uniform.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gzip
import importlib.util
import json
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

from sglang_m3.bench.stats import timed_rounds

HERE = pathlib.Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("bench_scaled", HERE / "bench_scaled.py")
scaled = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scaled)

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
SPEC_PHASES = ("draft_chain", "verify", "draft_catch_up")  # graph launches of one spec step, in order
DRAFT_HEADS = 64
DRAFT_INTERMEDIATE = 12288  # not public: our choice (see the docstring)
NEED_CUDA = "phases need CUDA: t_verify / t_draft come from the graph launches of a GPU trace"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cuts", default="1+3,1+7", help="comma list of DENSE+SPARSE layer cuts of the release")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--ep-size", type=int, default=1)
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--input-len", type=int, default=8192)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--repeats", type=timed_rounds, default=3, help="timed rounds per time row (median_low kept)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy; see Routing above)")
    p.add_argument("--top-p", type=float, default=1.0, help="top-p of the sampled requests (1: off)")
    p.add_argument("--modes", default="decode,spec", help="engines per cut: decode (plain), spec (EAGLE3)")
    p.add_argument("--num-steps", type=int, default=3, help="K: draft tokens per step (topk 1, K + 1 verify rows)")
    p.add_argument("--draft-kv-heads", type=int, default=4, help="4: the GQA draft; 64: the MHA draft")
    p.add_argument("--draft-heads", type=int, default=DRAFT_HEADS)
    p.add_argument("--draft-intermediate", type=int, default=DRAFT_INTERMEDIATE)
    p.add_argument("--draft-vocab", type=int, default=None, help="draft_vocab_size (default: the full vocabulary)")
    p.add_argument("--draft-path", default=None, help="an EAGLE3 draft directory instead of the generated one")
    p.add_argument("--model-path", default=None, help="an M3 checkpoint directory instead of the cuts")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--profile-steps", type=int, default=8, help="spec / decode steps traced per batch (CUDA)")
    p.add_argument("--accept-lengths", default="2.8,3.0,3.4")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--mem-fraction-static", type=float, default=0.88)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--hbm-tbps", type=float, default=0.0, help="HBM bandwidth of the floors (0: measure this GPU's)")
    scaled.add_routing_arg(p)
    p.add_argument("--out", default="bench_results/spec_phases.json")
    p.add_argument(
        "--resume",
        default=None,
        help="an earlier --out of the same command: the (cut, mode, batch) it measured are kept, only the rest run",
    )
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: LABEL:MODE in this process
    p.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--draft-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--results", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.temperature < 0:
        p.error(f"--temperature={args.temperature}: a sampling temperature is at least 0")
    if not 0 < args.top_p <= 1:
        p.error(f"--top-p={args.top_p}: top-p lies in (0, 1]")
    scaled.check_routing(p, args)
    return args


def sampling_shape(args) -> dict:
    """The measured requests' sampling fields (``bench_scaled.stream_sampling``)."""
    return {"temperature": args.temperature, "top_p": args.top_p}


def conditions(args) -> dict:
    """What a row was measured under besides its shape: sampling and routing (``--resume`` keeps them equal)."""
    return {**sampling_shape(args), "routing": args.routing}


def parse_cuts(text: str) -> list[tuple[int, int]]:
    cuts = []
    for part in text.split(","):
        d, sep, s = part.strip().partition("+")
        if not sep:
            raise SystemExit(f"--cuts: {part!r} is not DENSE+SPARSE (e.g. 1+3)")
        cuts.append((int(d), int(s)))
    return cuts


# -- the real-width draft ---------------------------------------------------------------------


def draft_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """Outputs of the first, middle and last-but-one layer of an N-layer (cut) target."""
    return (0, (num_layers - 1) // 2, num_layers - 2)


def real_width_draft_config(
    target_cfg: dict, kv_heads=4, heads=DRAFT_HEADS, intermediate=DRAFT_INTERMEDIATE, vocab: int | None = None
) -> dict:
    """The public M3 drafts' shape over ``target_cfg`` (tiny/eagle3.draft_config with the widths changed):
    the target's hidden size, head_dim and rope theta; the full vocabulary (no ``d2t``) unless ``vocab``."""
    from sglang_m3.tiny.eagle3 import draft_config

    t = target_cfg.get("text_config", target_cfg)
    if vocab is not None and not 0 < vocab <= t["vocab_size"]:
        raise ValueError(f"--draft-vocab={vocab}: must lie in [1, vocab_size={t['vocab_size']}]")
    draft_vocab = t["vocab_size"] if vocab is None else vocab
    cfg = draft_config(target_cfg, draft_aux_layer_ids(t["num_hidden_layers"]), draft_vocab_size=draft_vocab)
    cfg.update(num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=intermediate)
    return cfg


def make_draft_dir(target_dir: pathlib.Path, args) -> pathlib.Path:
    out = pathlib.Path(tempfile.mkdtemp(prefix="m3-draft-"))
    cfg = real_width_draft_config(
        json.loads((target_dir / "config.json").read_text()),
        args.draft_kv_heads,
        args.draft_heads,
        args.draft_intermediate,
        args.draft_vocab,
    )
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in target_dir.iterdir():  # tokenizer files, should anything read them from the draft's path
        if f.name.startswith("tokenizer"):
            shutil.copy(f, out / f.name)
    return out


# -- streamed timings ------------------------------------------------------------------------


async def _stream_spec(engine, ids, new, marks, shape: dict | None = None):
    sampling = scaled.stream_sampling(new, shape)
    async for chunk in await engine.async_generate(input_ids=ids, sampling_params=sampling, stream=True):
        meta = chunk["meta_info"]
        marks.append((time.perf_counter(), meta["completion_tokens"], meta.get("spec_verify_ct")))
    return marks


def full_batch_steps(marks: list[list[tuple]]) -> dict:
    """Seconds per step while every request decodes, from ``(time, completion tokens, verify count or None)``
    marks per request. The window runs from the last request's first mark to the first request's last mark.
    SGLang reports ``spec_verify_ct`` only with a request's final chunk, and streamed chunks may coalesce, so a
    request's steps in the window are its tokens there divided by its own acceptance length (final
    completion tokens / final verify count); without a count, its chunks in the window (one per step)."""
    start, end = scaled.full_batch_window(marks)

    def at(m, t):
        return max(x[1] for x in m if x[0] <= t)

    steps, tokens, counted = [], [], True
    for m in marks:
        got = at(m, end) - at(m, start)
        verify_ct = m[-1][2]
        if verify_ct:
            steps.append(got * verify_ct / m[-1][1])
        else:
            counted = False
            steps.append(sum(1 for x in m if start < x[0] <= end))
        tokens.append(got)
    if min(steps) < 4:
        raise RuntimeError(f"no full-batch window of 4+ steps (steps {steps}): raise --output-len")
    mean_steps = sum(steps) / len(steps)
    return dict(
        seconds_per_step=(end - start) / mean_steps,
        accept_length=sum(tokens) / sum(steps),
        steps=mean_steps,
        steps_from="spec_verify_ct" if counted else "chunks",
    )


def spec_step(engine, prompts, new, shape: dict | None = None) -> dict:
    scaled.admit_together(engine, prompts)
    marks = [[] for _ in prompts]
    streams = (_stream_spec(engine, p, new, m, shape) for p, m in zip(prompts, marks))
    engine.loop.run_until_complete(asyncio.gather(*streams))
    return full_batch_steps(marks)


def trace_steps(engine, prompts, new, trace_dir: pathlib.Path, steps: int, shape: dict | None = None) -> pathlib.Path:
    """A GPU torch-profiler trace of ``steps`` decode-stage batches (``bench_scaled.trace_streams``)."""
    scaled.admit_together(engine, prompts)
    marks = [[] for _ in prompts]
    streams = [_stream_spec(engine, p, new, m, shape) for p, m in zip(prompts, marks)]
    return scaled.trace_streams(engine, streams, marks, trace_dir, "GPU", steps, ready=2)


# -- trace reduction -------------------------------------------------------------------------


def graph_launches(events: list[dict]) -> tuple[list[dict], dict]:
    """Per ``cudaGraphLaunch`` (in launch order): the GPU work linked to it by ``args.correlation``:
    ``start`` / ``end`` (us), ``span`` (end - start), ``busy`` (GPU busy time), ``kernels`` (count),
    ``parts`` (busy us per ``bench_scaled.COMPONENTS`` component, ``bench_scaled.busy_parts``: where
    kernels overlap each instant counts once). Launches with no GPU work recorded (the trace stopped
    before they ran) are left out. Also the GPU work linked to no graph launch:
    ``{"kernels": n, "events": [(start, duration, name), ...]}``."""
    runtime = sorted(
        (e for e in events if e.get("cat") == "cuda_runtime" and str(e.get("name", "")).startswith("cudaGraphLaunch")),
        key=lambda e: e["ts"],
    )
    by_corr = {e.get("args", {}).get("correlation"): i for i, e in enumerate(runtime)}
    by_corr.pop(None, None)
    work = [[] for _ in runtime]
    eager = []
    for e in events:
        if e.get("cat") not in GPU_CATS or "dur" not in e:
            continue
        i = by_corr.get(e.get("args", {}).get("correlation"))
        (eager if i is None else work[i]).append((float(e["ts"]), float(e["dur"]), str(e.get("name", ""))))
    launches = []
    for kernels in filter(None, work):
        kernels.sort()
        parts = scaled.busy_parts(kernels)
        start, end = kernels[0][0], max(ts + dur for ts, dur, _ in kernels)
        launches.append(
            dict(start=start, end=end, span=end - start, busy=sum(parts.values()), kernels=len(kernels), parts=parts)
        )
    return launches, dict(kernels=len(eager), events=sorted(eager))


def step_phases(launches: list[dict], eager: dict | None = None, names=SPEC_PHASES) -> dict:
    """ms per step of each phase (mean span and busy over whole steps), from graph launches that repeat
    as ``names`` (the spec step: chain, verify, catch-up; plain decode: one). Raises ValueError when they
    don't: fewer launches than one step, a count that is not a whole number of steps after dropping a
    leading partial step, kernel counts that vary from step to step, or (spec) a verify launch that is not
    the only one of its step with MoE kernels (or, without any, not the largest)."""
    n = len(names)
    counts = [x["kernels"] for x in launches]
    moe = [x["parts"].get("moe", 0.0) > 0 for x in launches]
    if len(launches) < n:
        raise ValueError(f"{len(launches)} graph launches with GPU work in the trace: fewer than one step ({n})")

    def is_verify(step: list[int], k: int) -> bool:
        others = [j for j in range(n) if j != k]
        if any(moe[j] for j in step):
            return moe[step[k]] and not any(moe[step[j]] for j in others)
        return all(counts[step[k]] > counts[step[j]] for j in others)

    def fits(offset):
        body = counts[offset:]
        if len(body) < n or any(body[j] != body[j % n] for j in range(len(body))):
            return False
        return "verify" not in names or is_verify(list(range(offset, offset + n)), names.index("verify"))

    offset = next((o for o in range(n) if fits(o)), None)
    if offset is None:
        raise ValueError(
            f"graph launches do not repeat as {names} (kernels per launch: {counts}); the benchmark assumes "
            f"{n} graph launches per step in that order (spec/worker.py, spec/draft_graphs.py)"
        )
    trailing = (len(launches) - offset) % n  # a last step cut short (its catch-up still running at the stop)
    body = launches[offset : len(launches) - trailing]
    steps = len(body) // n
    out = {"steps": steps, "dropped_launches": offset + trailing, "kernels": dict(zip(names, counts[offset:][:n]))}
    for k, name in enumerate(names):
        ph = body[k::n]
        out[name] = sum(x["span"] for x in ph) / steps / 1e3
        out[name + "_busy"] = sum(x["busy"] for x in ph) / steps / 1e3
        parts = {}
        for x in ph:
            for c, us in x["parts"].items():
                parts[c] = parts.get(c, 0.0) + us
        out[name + "_parts"] = {c: round(us / steps / 1e3, 4) for c, us in sorted(parts.items(), key=lambda i: -i[1])}
    firsts = [body[j * n]["start"] for j in range(steps)]
    if steps > 1:
        out["gpu_step"] = (firsts[-1] - firsts[0]) / (steps - 1) / 1e3  # profiler-inflated host gaps included
    if eager is not None:
        lo, hi = body[0]["start"], body[-1]["end"]
        inside = [k for k in eager["events"] if lo <= k[0] <= hi]
        out["eager_gpu"] = sum(scaled.busy_parts(inside).values()) / steps / 1e3
        out["eager_kernels"] = len(inside) / steps
    return out


def trace_phases(path: pathlib.Path, names=SPEC_PHASES) -> dict:
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    launches, eager = graph_launches(events)
    return step_phases(launches, eager, names)


# -- the engines ---------------------------------------------------------------------------------


def run_one(args) -> None:
    """One (cut, mode) engine in this process; JSON lines appended to ``--results``."""
    import sglang as sgl
    import torch
    from sglang_m3.config import M3Config

    label, _, mode = args.one.rpartition(":")
    vocab = M3Config.from_hf(json.loads((pathlib.Path(args.model_dir) / "config.json").read_text())).vocab_size
    batches = scaled._ints(args.batches)
    need = max(b * (args.input_len + args.output_len + scaled.ADMIT_SLACK + 2 * args.num_steps) for b in batches)
    engine_args = scaled.engine_base_args(args, args.load_format, need, batches, args.mem_fraction_static)
    if mode == "spec":
        K = args.num_steps
        engine_args.update(
            speculative_algorithm="EAGLE3",
            speculative_num_steps=K,
            speculative_eagle_topk=1,
            speculative_num_draft_tokens=K + 1,
            speculative_draft_model_path=args.draft_dir,
            speculative_draft_load_format=args.load_format,
        )
    elif mode != "decode":
        raise SystemExit(f"--modes: unknown mode {mode!r} (decode, spec)")

    def emit(**record):
        with open(args.results, "a") as f:
            f.write(json.dumps(dict(cut=label, mode=mode, **record)) + "\n")

    t0 = time.perf_counter()
    engine = sgl.Engine(**engine_args)
    device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    emit(kind="startup", seconds=time.perf_counter() - t0, device=device)
    try:
        warm = scaled._prompts(2, min(4096, args.input_len), 1, vocab)
        engine.generate(input_ids=warm, sampling_params={"max_new_tokens": 8, "ignore_eos": True})
        for b in batches:
            try:
                new = args.output_len  # the batch is admitted together (bench_scaled.admit_together)
                prompts = scaled._prompts(b, args.input_len, args.input_len + b, vocab)
                shape = sampling_shape(args)
                rounds = [
                    spec_step(engine, prompts, new, shape)
                    if mode == "spec"
                    else {"seconds_per_step": scaled.decode_tpot(engine, prompts, new, shape)}
                    for _ in range(args.repeats)
                ]
                ms = [1e3 * r["seconds_per_step"] for r in rounds]
                mid = sorted(rounds, key=lambda r: r["seconds_per_step"])[(len(rounds) - 1) // 2]  # median_low's
                emit(kind="time", batch=b, ms=1e3 * mid.pop("seconds_per_step"), ms_repeats=ms, **mid)
                engine.flush_cache()
                if args.device == "cuda" and args.profile_steps:
                    trace_dir = pathlib.Path(tempfile.gettempdir()) / "m3-spec-traces" / f"{label}-{mode}-b{b}"
                    shutil.rmtree(trace_dir, ignore_errors=True)
                    prompts = scaled._prompts(b, args.input_len, 7 * args.input_len + b, vocab)
                    path = trace_steps(engine, prompts, new, trace_dir, args.profile_steps, shape)
                    names = SPEC_PHASES if mode == "spec" and args.num_steps > 1 else SPEC_PHASES[1:]
                    names = ("decode",) if mode == "decode" else names
                    emit(kind="phases", batch=b, trace=str(path), **trace_phases(path, names))
                    engine.flush_cache()
            except Exception as exc:  # noqa: BLE001 -- recorded; the other batches still run
                traceback.print_exc()
                emit(kind="error", batch=b, error=f"{type(exc).__name__}: {exc}")
                engine.flush_cache()
    finally:
        engine.shutdown()


# -- floors, merging, projections --------------------------------------------------------------


def step_floors(cfg, draft, batch: int, context: int, kv_dtype: str, num_steps: int, hbm_tbps: float, tp=1, ep=1):
    """HBM floors (ms) of a plain decode step and of a spec step (verify with K + 1 rows per request +
    the draft's passes): the bytes one rank moves at ``tp`` / ``ep`` (bf16; all-reduces not counted);
    ``*_experts``: the routed experts' part of each (random routing)."""
    import torch
    from sglang_m3.mem.layout import bytes_per_token, layout_for
    from sglang_m3.parallel import rank_heads
    from sglang_m3.sizing import decode_step_bytes, draft_step_bytes, rank_weights

    layout = layout_for(kv_dtype, torch.bfloat16)
    kv_heads = rank_heads(cfg.num_heads, cfg.num_kv_heads, tp, 0).kv_heads
    draft_kv_heads = rank_heads(draft.num_heads, draft.num_kv_heads, tp, 0).kv_heads
    kv = bytes_per_token(cfg, layout, (draft_kv_heads,), kv_heads=kv_heads)
    w = rank_weights(cfg, tp, ep)
    decode = decode_step_bytes(cfg, batch, context, kv, w)
    verify = decode_step_bytes(cfg, batch, context, kv, w, rows=num_steps + 1)
    drafting = sum(draft_step_bytes(draft, batch, context, num_steps, kv["draft"], tp=tp).values())
    ms = lambda b: b / (hbm_tbps * 1e12) * 1e3  # noqa: E731
    return {
        "floor_decode": ms(sum(decode.values())),
        "floor_verify": ms(sum(verify.values())),
        "floor_draft": ms(drafting),
        "floor_step": ms(sum(verify.values()) + drafting),
        "floor_decode_experts": ms(decode["experts"]),
        "floor_verify_experts": ms(verify["experts"]),
        "floor_step_experts": ms(verify["experts"]),
    }


def layer_costs(points: list[tuple[int, int, float]], dense_per_sparse: float) -> dict:
    """``t = fixed + dense x per_dense + sparse x per_sparse`` over ``(dense, sparse, t)`` points: least
    squares for both slopes where the points vary both counts (3+ points), else the sparse slope alone and
    ``per_dense = dense_per_sparse x per_sparse``."""
    import numpy as np

    d = np.array([p[0] for p in points], float)
    s = np.array([p[1] for p in points], float)
    t = np.array([p[2] for p in points], float)
    if len(set(s)) < 2:
        raise ValueError(f"per-layer costs need cuts with different sparse counts (got {points})")
    if len(set(d)) > 1 and len(points) >= 3:
        fixed, pd, ps = np.linalg.lstsq(np.stack([np.ones_like(d), d, s], 1), t, rcond=None)[0]
        how = "least squares over dense and sparse counts"
    else:
        a = np.stack([np.ones_like(s), s + dense_per_sparse * d], 1)
        fixed, ps = np.linalg.lstsq(a, t, rcond=None)[0]
        pd = dense_per_sparse * ps
        how = "sparse slope over the cuts; dense = sparse x HBM-byte ratio"
    return {"fixed": float(fixed), "per_dense": float(pd), "per_sparse": float(ps), "how": how}


def project(costs: dict, dense: int, sparse: int) -> float:
    return costs["fixed"] + dense * costs["per_dense"] + sparse * costs["per_sparse"]


def speedups(t_decode: float, t_step: float, accept_lengths) -> dict:
    return {f"{al:g}": al * t_decode / t_step for al in accept_lengths}


def merge(records: list[dict], cuts: list[tuple[int, int]], labels: list[str]) -> list[dict]:
    """One row per (cut, batch): t_decode, t_step, t_verify, t_draft, overhead (ms) and what they came from."""
    rows = []
    for (dense, sparse), label in zip(cuts, labels):
        batches = sorted({r["batch"] for r in records if r["cut"] == label and "batch" in r})
        for b in batches:
            got = {(r["mode"], r["kind"]): r for r in records if r["cut"] == label and r.get("batch") == b}
            dec, spec = got.get(("decode", "time")), got.get(("spec", "time"))
            ph, dph = got.get(("spec", "phases")), got.get(("decode", "phases"))
            row = dict(cut=label, dense=dense, sparse=sparse, batch=b)
            row["t_decode"] = dec["ms"] if dec else None
            row["t_step"] = spec["ms"] if spec else None
            row["accept_length_measured"] = spec.get("accept_length") if spec else None
            if ph:
                row["t_verify"] = ph["verify"]
                row["t_draft"] = ph.get("draft_chain", 0.0) + ph["draft_catch_up"]
                row["t_draft_chain"], row["t_draft_catch_up"] = ph.get("draft_chain"), ph["draft_catch_up"]
                row["t_eager_gpu"] = ph.get("eager_gpu")
                row["moe_verify"] = ph["verify_parts"].get("moe", 0.0)
                if row["t_step"] is not None:
                    row["overhead"] = row["t_step"] - row["t_verify"] - row["t_draft"]
            else:
                row["t_verify"] = row["t_draft"] = row["overhead"] = None
            if dph:
                row["t_decode_graph"] = dph["decode"]
                row["moe_decode"] = dph["decode_parts"].get("moe", 0.0)
            errors = [r["error"] for (m, k), r in got.items() if k == "error"]
            if errors:
                row["errors"] = errors
            rows.append(row)
    return rows


PHASE_MOE = {"t_decode": "moe_decode", "t_step": "moe_verify", "t_verify": "moe_verify"}  # the phase's MoE ms


def first_cut_projection(t0: float, moe0: float | None, f0: dict, fd: dict, fs: dict, cut0, cuts) -> dict:
    """Times at other ``(dense, sparse)`` layer counts from one cut's time ``t0``: each MoE layer costs the
    cut's measured MoE time per MoE layer (``moe0``: the routing its weights actually make), the rest of
    ``t0`` scales with the non-expert floor bytes (``f0`` / ``fd`` / ``fs``: ``{"all", "experts"}`` of the
    cut, of the cut with one more dense layer, and with one more sparse MoE layer). Without ``moe0`` (no
    trace) everything scales with the floor's bytes, experts at random routing included."""
    d0, s0 = cut0
    if moe0 is None:
        rest, per_moe, ne = t0, 0.0, lambda f: f["all"]
    else:
        rest, per_moe, ne = t0 - moe0, moe0 / s0, lambda f: f["all"] - f["experts"]
    per_dense = rest * (ne(fd) - ne(f0)) / ne(f0)
    per_sparse = per_moe + rest * (ne(fs) - ne(f0)) / ne(f0)
    costs = {
        "fixed": t0 - d0 * per_dense - s0 * per_sparse,
        "per_dense": per_dense,
        "per_sparse": per_sparse,
        "per_sparse_moe": per_moe,
        "how": "MoE per layer from the first cut's trace, the rest by non-expert floor bytes"
        if moe0 is not None
        else "everything by floor bytes (no trace)",
    }
    return dict(costs, at={f"{d}+{s}": project(costs, d, s) for d, s in cuts})


def projections(rows: list[dict], args, released, drafts: dict, accept_lengths) -> dict:
    """Per batch and time (t_decode, t_step, t_verify): the projection from the first cut alone
    (``first_cut_projection``) to the released layer counts, checked against every other cut's
    measurement; a least-squares fit over all cuts beside it; projected speed-ups (from the first
    cut's projection) beside the floors'.

    Dummy weights do not route a request's verify rows at random (they touch fewer experts; likely the
    dummy draft's tokens repeat: not checked), so ``random_routing`` projects again with each phase's
    MoE time replaced by the experts random routing touches (``sizing.experts_touched``) times one
    expert's measured time: the first cut's batch-1 decode MoE time over its MoE layers x top-k (one
    row reads exactly top-k experts)."""
    from sglang_m3.config import M3Config
    from sglang_m3.sizing import experts_touched

    out = {}
    D, S = len(released.dense_layer_ids), len(released.sparse_layer_ids)
    draft = next(iter(drafts.values()))
    cut0 = M3Config.from_hf(scaled.cut_config(rows[0]["dense"], rows[0]["sparse"]))
    moe_layers0 = sum(cut0.moe_layers)
    one_row = next((r for r in rows if r["cut"] == rows[0]["cut"] and r["batch"] == 1 and r.get("moe_decode")), None)
    per_expert = one_row["moe_decode"] / (moe_layers0 * cut0.top_k) if one_row else None

    def floors(dense, sparse, b, tbps=args.hbm_tbps):
        cfg = released if (dense, sparse) == (D, S) else M3Config.from_hf(scaled.cut_config(dense, sparse))
        return step_floors(
            cfg, draft, b, args.input_len, args.kv_cache_dtype, args.num_steps, tbps, args.tp_size, args.ep_size
        )

    for b in sorted({r["batch"] for r in rows}):
        mine = [r for r in rows if r["batch"] == b]
        for r in mine:
            r.update({k: round(v, 4) for k, v in floors(r["dense"], r["sparse"], b).items()})
        d0, s0 = mine[0]["dense"], mine[0]["sparse"]
        byte_floors = {cut: floors(*cut, b, 1.0) for cut in ((d0, s0), (d0 + 1, s0), (d0, s0 + 1))}
        full = floors(D, S, b)
        entry = {"released_layers": {"dense": D, "sparse": S}, "floors_released": full}
        for key in ("t_decode", "t_step", "t_verify"):
            r0 = mine[0]
            if r0.get(key) is None:
                continue
            fkey = "floor_" + key[2:]
            f0, fd, fs = (
                {"all": byte_floors[c][fkey], "experts": byte_floors[c][fkey + "_experts"]}
                for c in ((d0, s0), (d0 + 1, s0), (d0, s0 + 1))
            )
            others = [(r["dense"], r["sparse"], r[key]) for r in mine[1:] if r.get(key) is not None]
            proj = first_cut_projection(
                r0[key], r0.get(PHASE_MOE[key]), f0, fd, fs, (d0, s0), [(D, S)] + [(d, s) for d, s, _ in others]
            )
            at = proj["at"]
            e = {
                "from_first_cut": dict(proj, cut=f"{d0}+{s0}", released=at[f"{D}+{S}"]),
                "check": [
                    dict(cut=f"{d}+{s}", measured=t, predicted=at[f"{d}+{s}"], error=at[f"{d}+{s}"] / t - 1)
                    for d, s, t in others
                ],
            }
            if per_expert is not None and r0.get(PHASE_MOE[key]) is not None:
                rows_per_req = 1 if key == "t_decode" else args.num_steps + 1
                moe = moe_layers0 * experts_touched(cut0.num_experts, cut0.top_k, b * rows_per_req) * per_expert
                t_random = r0[key] - r0[PHASE_MOE[key]] + moe
                rnd = first_cut_projection(t_random, moe, f0, fd, fs, (d0, s0), [(D, S)])
                e["random_routing"] = dict(cut_time=t_random, per_expert=per_expert, released=rnd["at"][f"{D}+{S}"])
            pts = [(r0["dense"], r0["sparse"], r0[key])] + others
            if len({p[1] for p in pts}) > 1:
                ratio = (fd["all"] - f0["all"]) / (fs["all"] - f0["all"])
                fit = layer_costs(pts, ratio)
                e["fit_over_cuts"] = dict(fit, released=project(fit, D, S))
            entry[key] = e
        if "t_decode" in entry and "t_step" in entry:
            td, ts = (entry[k]["from_first_cut"]["released"] for k in ("t_decode", "t_step"))
            entry["speedup_projected_released"] = speedups(td, ts, accept_lengths)
            if "random_routing" in entry["t_decode"] and "random_routing" in entry["t_step"]:
                td, ts = (entry[k]["random_routing"]["released"] for k in ("t_decode", "t_step"))
                entry["speedup_projected_released_random_routing"] = speedups(td, ts, accept_lengths)
            entry["speedup_floor_released"] = speedups(full["floor_decode"], full["floor_step"], accept_lengths)
        for r in mine:
            if r.get("t_decode") and r.get("t_step"):
                r["speedup_projected"] = speedups(r["t_decode"], r["t_step"], accept_lengths)
                r["speedup_floor"] = speedups(r["floor_decode"], r["floor_step"], accept_lengths)
        out[str(b)] = entry
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.one:
        run_one(args)
        return {}
    from sglang_m3.config import DraftConfig, M3Config
    from sglang_m3.sizing import draft_weight_bytes

    argv = sys.argv[1:] if argv is None else argv
    if args.resume:
        resumed = json.loads(pathlib.Path(args.resume).read_text())
        # a file from before an option was measured at its default
        measured = {k: resumed.get(k, v) for k, v in conditions(parse_args([])).items()}
        if measured != conditions(args):
            raise SystemExit(
                f"--temperature={args.temperature} --top-p={args.top_p} --routing={args.routing}: {args.resume} "
                f"was measured with {measured}; its rows and these would not compare"
            )
        args.hbm_tbps = args.hbm_tbps or resumed["hbm_tbps"]  # the floors of the run being continued
    scaled.resolve_hbm_tbps(args)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.model_path:
        cfg = M3Config.from_hf(json.loads((pathlib.Path(args.model_path) / "config.json").read_text()))
        cuts, labels = [(len(cfg.dense_layer_ids), len(cfg.sparse_layer_ids))], ["model"]
    else:
        cuts = parse_cuts(args.cuts)
        labels = [f"{d}+{s}" for d, s in cuts]
    accept_lengths = [float(x) for x in args.accept_lengths.split(",") if x]
    records, drafts, draft_info, failed = [], {}, {}, []
    if args.resume:
        records = [r for r in json.loads(pathlib.Path(args.resume).read_text())["raw"] if r["kind"] != "error"]
    measured = {(r["cut"], r["mode"], r["batch"]) for r in records if r["kind"] == "time"}
    for (dense, sparse), label in zip(cuts, labels):
        if args.model_path:
            model_dir = pathlib.Path(args.model_path)
        else:
            model_dir = scaled.make_model_dir(argparse.Namespace(dense_layers=dense, sparse_layers=sparse))
        draft_dir = pathlib.Path(args.draft_path) if args.draft_path else make_draft_dir(model_dir, args)
        target = M3Config.from_hf(json.loads((model_dir / "config.json").read_text()))
        drafts[label] = draft = DraftConfig.from_path(str(draft_dir), target)
        w = draft_weight_bytes(draft, own_embed=True, tp=args.tp_size)
        draft_info[label] = dict(
            path=str(draft_dir) if args.draft_path else "generated (temp dir)",
            config=json.loads((draft_dir / "config.json").read_text()),
            params_with_own_embed=sum(w.values()) // 2,
            params_served=(sum(w.values()) - w["embed"]) // 2,
        )
        for mode in args.modes.split(","):
            one = f"{label}:{mode}"
            todo = [b for b in scaled._ints(args.batches) if (label, mode, b) not in measured]
            if not todo:
                print(f"{one}: kept from {args.resume}", flush=True)
                continue
            results = out.with_name(f"{out.stem}.{label}-{mode}.partial.jsonl")
            results.write_text("")
            cmd = [sys.executable, __file__, *argv, "--batches", ",".join(map(str, todo)), "--one", one]
            cmd += ["--model-dir", str(model_dir)]
            cmd += ["--draft-dir", str(draft_dir), "--results", str(results)]
            proc = subprocess.run(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=scaled.engine_env(args)
            )
            for line in results.read_text().splitlines():
                records.append(json.loads(line))
                print(line, flush=True)
                if records[-1]["kind"] == "error":
                    failed.append(f"{one} batch {records[-1]['batch']}: {records[-1]['error']}")
            results.unlink()
            if proc.returncode:
                print(proc.stdout[-6000:], file=sys.stderr)
                failed.append(f"{one}: exit {proc.returncode}")
            _write(out, args, argv, cuts, labels, records, drafts, draft_info, accept_lengths, failed)
        if not args.model_path:
            shutil.rmtree(model_dir, ignore_errors=True)
        if not args.draft_path:
            shutil.rmtree(draft_dir, ignore_errors=True)
    _write(out, args, argv, cuts, labels, records, drafts, draft_info, accept_lengths, failed)  # kept engines too
    summary = json.loads(out.read_text())
    print(f"wrote {out}")
    for f in failed:
        print(f"FAILED: {f}", file=sys.stderr)
    if failed and __name__ == "__main__":
        sys.exit(1)
    return summary


def _write(out, args, argv, cuts, labels, records, drafts, draft_info, accept_lengths, failed) -> None:
    from sglang_m3.config import M3Config

    rows = merge(records, cuts, labels)
    resumed = json.loads(pathlib.Path(args.resume).read_text()) if args.resume else None
    summary = dict(
        benchmark="spec_phases",
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command="python3 scripts/bench_spec.py " + " ".join(argv),
        model=args.model_path or "released M3 config cut to DENSE+SPARSE layers, dummy weights",
        spec=dict(algorithm="EAGLE3", num_steps=args.num_steps, topk=1, num_draft_tokens=args.num_steps + 1),
        input_len=args.input_len,
        repeats=args.repeats,
        **conditions(args),
        tp_size=args.tp_size,
        ep_size=args.ep_size,
        kv_cache_dtype=args.kv_cache_dtype,
        hbm_tbps=args.hbm_tbps,
        draft=draft_info,
        notes=[
            "times in ms; t_step measured at the dummy draft's acceptance (~1): graph shapes do not depend on it",
            "speedup_* are projected (AL x t_decode / t_step at the given acceptance lengths), not measured",
        ]
        + ([] if args.device == "cuda" else [NEED_CUDA]),
        errors=failed,
        resumed_from={k: resumed.get(k) for k in ("date", "command", "resumed_from")} if resumed else None,
        records=rows,
        raw=records,
    )
    if not args.model_path and rows:
        released = M3Config.from_hf(json.loads(scaled.RELEASED.read_text()))
        try:
            summary["projections"] = projections(rows, args, released, drafts, accept_lengths)
        except Exception as exc:  # noqa: BLE001 -- the measurements are still written
            summary["projections"] = {"error": f"{type(exc).__name__}: {exc}"}
    out.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
