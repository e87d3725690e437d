"""Decode at batch 64 x 128K (FP8 and bf16) and batch 1 x 32K: PDL / fusion variants, twice each.

Run on the GPU host: ``python3 benchmarks/sweep_pdl.py`` (tuning notes, not a test).
"""

from __future__ import annotations

import pathlib
import sys

import torch

_root = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_root / "benchmarks"), str(_root / "scripts")]
from bench_kernels import index_path  # noqa: E402
from sweep_fusion import ITERS, Problem, knobs, kvq, msa_topk, run_path, time_graph  # noqa: E402

VARIANTS = {
    "default": dict(fuse_rows=64, merge=False, pdl=True, warps=(8, 8, 8)),
    "no-pdl": dict(fuse_rows=64, merge=False, pdl=False, warps=(8, 8, 8)),
    "no-pdl,2-launch": dict(fuse_rows=0, merge=False, pdl=False, warps=(8, 8, 8)),
    "pdl,merge-fused": dict(fuse_rows=64, merge=True, pdl=True, warps=(8, 8, 8)),
}


def indexer(p):
    return index_path(p, msa_topk, "decode")


def main():
    flush = torch.empty(64 << 20, dtype=torch.float32, device="cuda")
    for dtype, batch, ctx in (("fp8", 64, 131072), ("bf16", 64, 131072), ("bf16", 1, 32768)):
        p = Problem(kvq, dtype, batch, ctx)
        for rep in range(2):
            for name, kw in VARIANTS.items():
                knobs(**kw)
                t = run_path(p, "decode", flush)
                ti = time_graph(indexer(p), ITERS, flush)
                print(f"{dtype} b={batch} ctx={ctx} rep{rep} {name:16s} decode {t:8.2f} us  indexer {ti:8.2f} us")
        del p
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
