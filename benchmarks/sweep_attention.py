"""Attention launch knobs, and the FP8 batch-64 x 128K indexer spread (tuning notes, not a test).

Run on the GPU host (scripts/bench_kernels.py's harness: CUDA-graph replays, L2 flushed,
median of 10):

* ``python3 benchmarks/sweep_attention.py``: ``msa_attention`` alone for bf16 / FP8 / NVFP4
  KV at batch 8 (decode and verify rows) and 64 (decode), 32K context, over warps per
  program x pipeline stages x register cap x split-K programs per SM; each variant's output is compared
  with the default's (max abs difference printed).
* ``--merge``: the split merge fused into the attention up to 0 / 4 / any number of splits;
  attention alone and the whole decode (or verify), bf16 / FP8 / NVFP4 at 32K, batch 1 / 8 / 64.
* ``--settle``: the FP8 index-K indexer at batch 64 x 128K, timed again and again after
  idle spells and busy spells; prints wall-clock stamps to line up with a clock log. (Run
  16's ``--alloc`` timed it on the index-K caches of an fp8 and an NVFP4 case, then on copies.)
* ``--graphs``: the same indexer, four CUDA-graph captures per fresh case (score buffer inside
  each capture's pool, or allocated once outside), then 40 eager launches timed with events.
* ``--graphs-pdl``: six captures per fresh case of that indexer (and of the bf16 batch 8 x 512K
  one) with programmatic dependent launch on and off, then of the whole decode path (run 25).
* ``--cold``: one capture of the FP8 batch 64 x 128K decode on a fresh case replayed 400 times,
  then two more captures: does a cold first capture warm up?
* ``--splits``: split programs per SM x the largest split count merged in the attention, verify
  at batch 8 beside the decodes those knobs also move; ``--few-splits``: 2-16 splits at batch 1 and 8.
* ``--warps``: 16 warps per attention program against 8, with all or half the splits.
* ``--ncu``: one eager attention call each (bf16 / FP8 / NVFP4, batch 1 and 64) for ``ncu``.
"""

from __future__ import annotations

import pathlib
import sys
import time

import torch

_root = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_root / "benchmarks"), str(_root / "scripts")]
from bench_kernels import _time, replay_times, warm_up  # noqa: E402
from sweep_fusion import (  # noqa: E402
    ITERS,
    Problem,
    attend,
    full_path,
    index_path,
    kvq,
    ma,
    msa_attention,
    msa_topk,
    mt,
    time_graph,
)
from sweep_grid import line  # noqa: E402
from sweep_pdl import indexer  # noqa: E402

DEFAULTS = (dict(ma._WARPS), dict(ma._STAGES), dict(ma._MAXNREG), ma._SPLIT_PROGRAMS_PER_SM)
# (warps, stages, register cap) per program; every one at 0.5 / 1 / 2 split programs per SM
VARIANTS = [(8, s, r) for s in (1, 2, 3) for r in (None, 80)] + [(4, s, None) for s in (1, 2)]


def set_knobs(warps=None, stages=None, maxnreg=None, per_sm=None):
    ma._WARPS = {m: warps or DEFAULTS[0][m] for m in DEFAULTS[0]}
    ma._STAGES = {m: stages or DEFAULTS[1][m] for m in DEFAULTS[1]}
    ma._MAXNREG = {m: maxnreg or DEFAULTS[2][m] for m in DEFAULTS[2]}
    ma._SPLIT_PROGRAMS_PER_SM = per_sm or DEFAULTS[3]


def attention_sweep():
    flush = torch.empty(64 << 20, dtype=torch.float32, device="cuda")
    summary = []
    for dtype in ("bf16", "fp8", "nvfp4"):
        for batch in (8, 64):
            p = Problem(kvq, dtype, batch, 32768)
            for mode in ("decode", "verify") if batch == 8 else ("decode",):
                ids = index_path(p, msa_topk, mode)()

                def att(p=p, mode=mode, ids=ids):
                    return attend(p, msa_attention, mode, ids)

                set_knobs()
                ref = att().float()
                for warps, stages, maxnreg in VARIANTS:
                    for per_sm in (0.5, 1, 2):
                        set_knobs(warps, stages, maxnreg, per_sm)
                        err = (att().float() - ref).abs().max().item()
                        t = time_graph(att, ITERS, flush)
                        line(
                            f"attention {dtype:5s} b={batch:<3d} {mode:6s} w{warps} s{stages} regs {maxnreg or '-':3}"
                            f" per_sm {per_sm:<3} {t:8.2f} us  max|diff| {err:.2e}",
                            summary,
                        )
            del p
            torch.cuda.empty_cache()
    set_knobs()
    print("\n".join(["", "== summary =="] + summary))


def knob_sweep(cases, variants, dtypes=("bf16", "fp8", "nvfp4")):
    """Attention alone and the whole path for each variant (``msa_sparse_attn`` attribute -> value),
    twice; two untimed captures first on each fresh case (the first ones on fresh data run slow,
    run 27). Every attribute is restored afterwards."""
    flush = torch.empty(64 << 20, dtype=torch.float32, device="cuda")
    ours = (kvq, msa_topk, msa_attention)
    defaults = {name: getattr(ma, name) for v in variants for name in v}
    summary = []
    for dtype in dtypes:
        for batch, ctx, mode in cases:
            p = Problem(kvq, dtype, batch, ctx)
            ids = index_path(p, msa_topk, mode)()
            for _ in range(2):
                time_graph(full_path(p, ours, mode), 1, flush)
            for rep in range(2):
                for variant in variants:
                    for name, value in {**defaults, **variant}.items():
                        setattr(ma, name, value)
                    ta = time_graph(lambda p=p, m=mode, i=ids: attend(p, msa_attention, m, i), ITERS, flush)
                    td = time_graph(full_path(p, ours, mode), ITERS, flush)
                    label = " ".join(f"{k.strip('_').lower()}={_show(v)}" for k, v in variant.items())
                    line(
                        f"{dtype:5s} b={batch:<3d} ctx={ctx:<7d} {mode:6s} #{rep} {label:40s}"
                        f"  attention {ta:7.2f} us  {mode} {td:7.2f} us",
                        summary,
                    )
            for name, value in defaults.items():
                setattr(ma, name, value)
            del p
            torch.cuda.empty_cache()
    print("\n".join(["", "== summary =="] + summary))


def _show(value):
    if isinstance(value, dict):  # per KV mode (0 plain, 1 FP8, 2 NVFP4)
        return "/".join(str(v) for v in value.values())
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def _splits(per_sm, most):
    return {"_SPLIT_PROGRAMS_PER_SM": per_sm, "_FUSE_MERGE_MAX_SPLITS": most}


def merge_sweep():
    """The split merge fused into the attention up to 0 / 4 / any number of splits (runs 21-22;
    run 21 also timed key tiles smaller than the block at batch 1 / 8: no gain, removed)."""
    cases = [(1, 32768, "decode"), (8, 32768, "decode"), (8, 32768, "verify"), (64, 32768, "decode")]
    knob_sweep(cases, [_splits(1, 0), _splits(1, 4), _splits(1, 1 << 20)])


def splits_sweep():
    """Split programs per SM x fused merge for verify at batch 8 (32 rows: 8 splits by default,
    merged by the merge launch) beside the decodes the same knobs move (run 29)."""
    cases = [(8, 32768, "verify"), (8, 131072, "verify"), (8, 32768, "decode"), (64, 32768, "decode")]
    knob_sweep(cases, [_splits(*v) for v in [(1, 4), (0.5, 4), (0.5, 0), (1, 8), (2, 4), (2, 16)]])


def few_splits_sweep():
    """Batch 1 and 8 decode: the attention's 16 splits (one page each, merge launch) against 8 / 4 /
    2 (several pages per program; up to 4 merged in the attention itself) and 16 fused (run 30)."""
    sms = ma.sm_count(torch.device("cuda"))
    for batch in (1, 8):
        per_sm = {n: (batch * n - 0.5) / sms for n in (2, 4, 8)}  # splits double while rows x splits < that
        variants = [(1, 4), (per_sm[8], 4), (per_sm[8], 8), (per_sm[4], 4), (per_sm[2], 4), (1, 16)]
        knob_sweep([(batch, 8192, "decode"), (batch, 131072, "decode")], [_splits(*v) for v in variants])


def warps_sweep():
    """16 warps per attention program (half the elements per thread on a critical path that is one
    program per SM at batch 1 / 8) against 8, and with half the splits (verify at batch 8 then fits
    one program per SM)."""
    cases = [(1, 32768, "decode"), (8, 32768, "decode"), (8, 32768, "verify"), (64, 32768, "decode")]
    w16 = {"_WARPS": {0: 16, 1: 16, 2: 16}}
    knob_sweep(cases, [{"_WARPS": dict(ma._WARPS)}, w16, {**w16, "_SPLIT_PROGRAMS_PER_SM": 0.5}])


def ncu_probe():
    """Eager attention calls for ``ncu``: bf16 / FP8 / NVFP4 at batch 1 and 64, 32K, decode rows;
    six compile calls first, then the six to profile (``ncu --launch-skip 6``)."""
    cases = []
    for batch in (1, 64):
        for dtype in ("bf16", "fp8", "nvfp4"):
            p = Problem(kvq, dtype, batch, 32768)
            cases.append((p, index_path(p, msa_topk, "decode")()))
    for _ in range(2):
        for p, ids in cases:
            attend(p, msa_attention, "decode", ids)
            torch.cuda.synchronize()


def settle_probe():
    """Run 16 timed the same FP8 indexer on two allocations at 294 us and then, a few ms later,
    on both again at 262: not the allocation. Here: does the slow phase follow idle time?"""
    flush = torch.empty(64 << 20, dtype=torch.float32, device="cuda")
    p = Problem(kvq, "fp8", 64, 131072)
    graph_fn = indexer(p)
    t0 = time.perf_counter()

    def run(tag, n):
        for i in range(n):
            t = time_graph(graph_fn, ITERS, flush)
            print(f"+{time.perf_counter() - t0:7.3f} s {time.strftime('%H:%M:%S')} {tag} #{i}: {t:8.2f} us", flush=True)

    def busy(seconds):
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            for _ in range(20):
                flush.add_(1)
                graph_fn()
            torch.cuda.synchronize()

    time.sleep(1.0)
    run("after set-up + 1 s idle", 6)
    time.sleep(1.0)
    run("after 1 s idle", 3)
    time.sleep(1.0)
    busy(0.5)
    run("after 1 s idle + 0.5 s busy", 3)
    time.sleep(3.0)
    run("after 3 s idle", 3)
    run("no idle", 3)


def graphs_probe():
    """Run 18: even after 200 warm-up executions, the first CUDA graphs timed on a fresh case ran
    slow. Per capture: the address of msa_topk's score buffer (allocated inside the capture,
    from the graph's private pool), the time; then the same with that buffer allocated once
    outside any capture; then eager launches timed with events."""
    flush = torch.empty(64 << 20, dtype=torch.float32, device="cuda")
    fixed = {}

    class Torch:  # msa_topk's module-level torch, logging (or pinning) its float32 score buffer
        pin = False

        def __getattr__(self, name):
            return getattr(torch, name)

        def empty(self, shape, **kw):
            if kw.get("dtype") is torch.float32 and len(shape) == 3:
                if self.pin:
                    buf = fixed.setdefault(tuple(shape), torch.empty(shape, **kw))
                else:
                    buf = torch.empty(shape, **kw)
                print(f"    scores at {buf.data_ptr():#x} (capturing: {torch.cuda.is_current_stream_capturing()})")
                return buf
            return torch.empty(shape, **kw)

    proxy = Torch()
    mt.torch = proxy
    for pin in (False, True, False):
        proxy.pin = pin
        p = Problem(kvq, "fp8", 64, 131072)
        fn = indexer(p)
        for i in range(4):
            t = time_graph(fn, ITERS, flush)
            print(f"{'pinned' if pin else 'in-graph'} scores, graph #{i}: {t:8.2f} us", flush=True)
        del p
        torch.cuda.empty_cache()
    mt.torch = torch
    p = Problem(kvq, "fp8", 64, 131072)
    fn = indexer(p)
    times = []
    for _ in range(40):
        flush.add_(1)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(round(a.elapsed_time(b) * 1e3, 1))
    print("eager, fresh case, 40 launches (us):", times, flush=True)


def graphs_pdl_probe():
    """Run 25: is programmatic dependent launch what puts a capture in the slow state? Fresh cases
    of the FP8 indexer at batch 64 x 128K and the bf16 one at batch 8 x 512K (the two cases seen
    slow), six CUDA-graph captures each, with PDL on and off; then the whole decode path of fresh
    cases after the bench's warm-up (run 25b ran that part as an inline script)."""
    flush = torch.empty(64 << 20, dtype=torch.float32, device="cuda")
    for dtype, batch, ctx in (("fp8", 64, 131072), ("bf16", 8, 524288)):
        for pdl in (True, False, True, False):
            ma._PDL = pdl
            p = Problem(kvq, dtype, batch, ctx)
            fn = indexer(p)
            times = [round(time_graph(fn, ITERS, flush), 1) for _ in range(6)]
            print(f"{dtype} b={batch} ctx={ctx} pdl {pdl:d}: six captures {times} us", flush=True)
            del p, fn
            torch.cuda.empty_cache()
    ma._PDL = True
    ours = (kvq, msa_topk, msa_attention)
    for dtype, batch, ctx in (("fp8", 64, 131072), ("bf16", 8, 524288), ("fp8", 64, 131072)):
        p = Problem(kvq, dtype, batch, ctx)
        warm_up(p, ours, 200)
        fn = full_path(p, ours, "decode")
        times = [round(time_graph(fn, ITERS, flush), 1) for _ in range(6)]
        print(f"{dtype} b={batch} ctx={ctx} decode, 200 eager warm-up, then six captures: {times} us", flush=True)
        del p, fn
        torch.cuda.empty_cache()


def cold_capture_probe():
    """Next after run 25: does a cold first capture warm up if it is replayed long enough? Fresh
    FP8 batch 64 x 128K cases; the decode path captured once and replayed 400 times (L2 flushed
    before each), the median of every 40 replays printed; then a second and a third capture of
    the same path, 40 replays each. Twice. Run 26: 315.9 then 284-285 us per window of 40, the
    later captures 285; the first 64 replays are printed one by one since (with ``_time``'s warm-up
    replays, 64 or more, taken out of every window)."""
    flush = torch.empty(64 << 20, dtype=torch.float32, device="cuda")
    ours = (kvq, msa_topk, msa_attention)
    for case in range(2):
        p = Problem(kvq, "fp8", 64, 131072, seed=case)
        warm_up(p, ours, 200)
        fn = full_path(p, ours, "decode")
        fn()
        torch.cuda.synchronize()
        for capture in range(3):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            if capture == 0:
                first = [round(t) for t in replay_times(graph.replay, 64, flush)]
                print(f"case {case} capture 0: its first 64 replays {first} us", flush=True)
            windows = [round(_time(graph.replay, 40, flush), 1) for _ in range(10 if capture == 0 else 1)]
            print(f"case {case} capture {capture}: medians of 40 replays {windows} us", flush=True)
        del p, fn, graph
        torch.cuda.empty_cache()


if __name__ == "__main__":
    {
        "--settle": settle_probe,
        "--graphs": graphs_probe,
        "--merge": merge_sweep,
        "--graphs-pdl": graphs_pdl_probe,
        "--cold": cold_capture_probe,
        "--splits": splits_sweep,
        "--few-splits": few_splits_sweep,
        "--warps": warps_sweep,
        "--ncu": ncu_probe,
    }.get(sys.argv[-1], attention_sweep)()
