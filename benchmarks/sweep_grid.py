"""Indexer kernels and grids for bf16 index-K (tuning notes, not a test).

Run on the GPU host: ``python3 benchmarks/sweep_grid.py``. Times, each as a CUDA-graph replay
with the L2 flushed (scripts/bench_kernels.py's harness), median of 10, the bf16 indexer
alone and the full decode with the tensor-core tile kernel at 4 or 8 warps or with the
select as its own launch. Earlier sweeps of this script (grid rules, the FMA row kernel and
pages per iteration, since removed): benchmarks/NOTES.md, runs 10 and 13. ``--probe`` runs
one eager call of each kernel for ``ncu``; ``--fuse`` times verify (batch 8) and batch-1/8
512K decode with the select fused up to 1024 keys per tile or not; ``--score`` the stages;
``--select`` the in-register top-k as bitonic ``tl.topk`` or rounds of arg-max, beside the
score kernel without its select. (Runs 26-27 timed index-K pages read in row slices x stages x
programs per SM with a ``--pieces`` sweep since removed with its knob: benchmarks/NOTES.md 26-27.)
"""

from __future__ import annotations

import pathlib
import sys

import torch

_root = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_root / "benchmarks"), str(_root / "scripts")]
from bench_kernels import attend, index_path  # noqa: E402
from sweep_fusion import ITERS, Problem, kvq, ma, mt, run_path, time_graph  # noqa: E402
from sweep_pdl import indexer  # noqa: E402

DEFAULT_STAGES = dict(mt._SCORE_STAGES)
DEFAULT_ARGMAX = mt._SELECT_ARGMAX_MIN_KEYS
VARIANTS = {  # bf16 index-K, tensor-core tile kernel: warps; select fused or its own launch
    "tile,w4": {},
    "tile,w8": dict(warps=8),
    "tile,2-launch": dict(fuse=0),
}


def set_knobs(warps=4, fuse=64, stages=None):
    mt._SCORE_WARPS = warps
    mt._FUSE_SELECT_MAX_ROWS = fuse
    mt._SCORE_STAGES = {**DEFAULT_STAGES, **(stages or {})}


def line(text, out):
    print(text, flush=True)
    out.append(text)


def main():
    flush = torch.empty(64 << 20, dtype=torch.float32, device="cuda")
    summary = []
    for ctx in (32768, 131072):
        for batch in (1, 8, 64):
            p = Problem(kvq, "bf16", batch, ctx)
            floor = p.floor_us("indexer", 1)
            for name, kw in VARIANTS.items():
                set_knobs(**kw)
                t = time_graph(indexer(p), ITERS, flush)
                line(f"indexer bf16 b={batch:<3d} ctx={ctx:<7d} {name:14s} {t:8.2f} us  floor {floor:7.2f}", summary)
            del p
            torch.cuda.empty_cache()
    for batch, ctx in ((8, 32768), (8, 131072)):
        p = Problem(kvq, "bf16", batch, ctx)
        for rep in range(2):
            for name, kw in VARIANTS.items():
                set_knobs(**kw)
                t = run_path(p, "decode", flush)
                floor = p.floor_us("decode", 1)
                line(
                    f"decode bf16 b={batch:<3d} ctx={ctx} rep{rep} {name:14s} {t:8.2f} us  floor {floor:6.1f}", summary
                )
        del p
        torch.cuda.empty_cache()
    set_knobs()
    print("\n".join(["", "== summary =="] + summary))


def fuse_sweep():
    """Select fused into the score kernel up to 1024 keys per tile (default) vs 0 (verify, twice) / 4096 keys."""
    flush = torch.empty(64 << 20, dtype=torch.float32, device="cuda")
    cases = [(dt, 8, ctx, "verify") for dt in ("bf16", "fp8", "nvfp4") for ctx in (32768, 131072)]
    cases += [("bf16", 1, 524288, "decode"), ("fp8", 8, 524288, "decode")]
    for dtype, batch, ctx, mode in cases:
        p = Problem(kvq, dtype, batch, ctx)
        for rep in range(2 if mode == "verify" else 1):
            for keys in (1024, 0 if mode == "verify" else 4096):
                mt._FUSE_SELECT_MAX_KEYS = keys
                t = run_path(p, mode, flush)
                print(
                    f"{mode} {dtype:5s} b={batch:<2d} ctx={ctx:<6d} rep{rep} fuse<={keys:<4d} keys {t:8.2f} us",
                    flush=True,
                )
        del p
        torch.cuda.empty_cache()
    mt._FUSE_SELECT_MAX_KEYS = 1024


STAGE_VARIANTS = {"s2": 2, "s3": 3, "s4": 4}  # index-K pages in flight per score program: stages - 1


def score_sweep():
    """Score-kernel pipelining (``--score``): bf16 / FP8 indexer at batch 1/8/64 x 32K/128K and the
    decode at batch 8 (both contexts) and 64 x 128K with 2-4 stages, every variant twice. Run 13
    (NOTES.md) also timed the FP8 FMA row kernel and per-page page-id loads, since removed."""
    flush = torch.empty(64 << 20, dtype=torch.float32, device="cuda")
    summary = []
    for dtype in ("bf16", "fp8"):
        for ctx, batch in ((32768, 8), (131072, 8), (131072, 1), (32768, 64), (131072, 64)):
            p = Problem(kvq, dtype, batch, ctx)
            floor = p.floor_us("indexer", 1)
            for rep in range(2):
                for name, stages in STAGE_VARIANTS.items():
                    set_knobs(stages={dtype == "fp8": stages})
                    ti = time_graph(indexer(p), ITERS, flush)
                    t = run_path(p, "decode", flush) if batch > 1 else float("nan")
                    line(
                        f"{dtype:4s} b={batch:<3d} ctx={ctx:<7d} rep{rep} {name:4s} indexer {ti:8.2f} us"
                        f"  decode {t:8.2f} us  (indexer floor {floor:7.2f})",
                        summary,
                    )
            del p
            torch.cuda.empty_cache()
    set_knobs()
    print("\n".join(["", "== summary =="] + summary))


class _NoSelect:  # stands in for the select launch: "score only"
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def select_sweep():
    """The in-register top-k as bitonic ``tl.topk`` or rounds of arg-max (ids checked against the
    default's), indexer alone and the whole path, then the score kernel with no select ("score
    only"), bf16 / FP8 index-K (run 23). Run 22 (NOTES.md) also timed index-K pages loaded by TMA (a
    host-built tensor descriptor) instead of cp.async, at 2-4 stages: within 1 us everywhere (removed)."""
    flush = torch.empty(64 << 20, dtype=torch.float32, device="cuda")
    summary = []
    select_kernel = mt._topk_select_kernel
    cases = [(b, c, "decode") for b in (1, 8, 64) for c in (32768, 131072)]
    cases += [(1, 8192, "decode"), (1, 524288, "decode"), (8, 524288, "decode")]
    cases += [(8, 32768, "verify"), (8, 131072, "verify")]
    for dtype in ("bf16", "fp8"):
        for batch, ctx, mode in cases:
            p = Problem(kvq, dtype, batch, ctx)
            path = index_path(p, mt.msa_topk, mode)
            ref = path()
            for rep in range(2):
                for argmax in (False, True):
                    mt._SELECT_ARGMAX_MIN_KEYS = 0 if argmax else 1 << 30
                    err = (path() != ref).sum().item()
                    ti = time_graph(path, ITERS, flush)
                    t = run_path(p, mode, flush)
                    line(
                        f"{dtype:4s} b={batch:<3d} ctx={ctx:<7d} {mode} #{rep} argmax {argmax:d} indexer {ti:7.2f} us"
                        f"  {mode} {t:8.2f} us  ids differ {err}",
                        summary,
                    )
            mt._SELECT_ARGMAX_MIN_KEYS = DEFAULT_ARGMAX
            set_knobs(fuse=0)
            mt._topk_select_kernel = _NoSelect()
            ts = time_graph(path, ITERS, flush)
            mt._topk_select_kernel = select_kernel
            set_knobs()
            line(f"{dtype:4s} b={batch:<3d} ctx={ctx:<7d} {mode} score only {ts:8.2f} us", summary)
            del p
            torch.cuda.empty_cache()
    print("\n".join(["", "== summary =="] + summary))


def probe():
    """One eager call each, for ``ncu``: the bf16 indexer at batch 8 x 32K, FP8 / NVFP4 attention at batch 1 x 32K."""
    p = Problem(kvq, "bf16", 8, 32768)
    indexer(p)()
    for dtype in ("fp8", "nvfp4"):
        p = Problem(kvq, dtype, 1, 32768)
        attend(p, ma.msa_attention, "decode", indexer(p)())
    torch.cuda.synchronize()


if __name__ == "__main__":
    {
        "--probe": probe,
        "--fuse": fuse_sweep,
        "--score": score_sweep,
        "--select": select_sweep,
    }.get(sys.argv[-1], main)()
