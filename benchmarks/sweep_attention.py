"""Attention launch knobs, and the FP8 batch-64 x 128K indexer spread (tuning notes, not a test).

Run on the GPU host (scripts/bench_kernels.py's harness: CUDA-graph replays, L2 flushed,
median of 10):

* ``python3 benchmarks/sweep_attention.py``: ``msa_attention`` alone for bf16 / FP8 / NVFP4
  KV at batch 8 (decode and verify rows) and 64 (decode), 32K context, over warps per
  program x pipeline stages x split-K programs per SM; each variant's output is compared
  with the default's (max abs difference printed).
* ``--alloc``: the FP8 index-K indexer at batch 64 x 128K on the index-K caches of an fp8
  and an NVFP4 bench case (identical contents, different allocations), alternately and
  twice, then on a fresh copy of each; prints wall-clock stamps to line up with a clock log.
"""

from __future__ import annotations

import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from sweep_fusion import BLOCK, ITERS, LOCAL, SCALE, TOPK, Problem, kvq, ma, msa_attention, msa_topk, time_graph  # noqa: E402
from sweep_grid import line  # noqa: E402
from sweep_pdl import indexer  # noqa: E402

DEFAULTS = (dict(ma._WARPS), dict(ma._STAGES), ma._SPLIT_PROGRAMS_PER_SM)


def set_knobs(warps=None, stages=None, per_sm=None):
    ma._WARPS = {m: warps or DEFAULTS[0][m] for m in DEFAULTS[0]}
    ma._STAGES = {m: stages or DEFAULTS[1][m] for m in DEFAULTS[1]}
    ma._SPLIT_PROGRAMS_PER_SM = per_sm or DEFAULTS[2]


def attention_sweep():
    flush = torch.empty(64 << 20, dtype=torch.float32, device="cuda")
    summary = []
    for dtype in ("bf16", "fp8", "nvfp4"):
        for batch in (8, 64):
            p = Problem(kvq, dtype, batch, 32768)
            ks = dict(k_scales=p.kv["k"][1], v_scales=p.kv["v"][1])
            for mode in ("decode", "verify") if batch == 8 else ("decode",):
                req, pos, iq, q = p.rows[mode]
                ids = msa_topk(iq, p.idx_k, p.page_table, req, pos, block_size=BLOCK, topk=TOPK, local_blocks=LOCAL)

                def att(p=p, req=req, pos=pos, q=q, ids=ids, ks=ks):
                    return msa_attention(
                        q, p.kv["k"][0], p.kv["v"][0], p.page_table, req, pos, ids, block_size=BLOCK, scale=SCALE, **ks
                    )

                set_knobs()
                ref = att().float()
                for warps in (4, 8):
                    for stages in (1, 2, 3):
                        for per_sm in (0.5, 1, 2):
                            set_knobs(warps, stages, per_sm)
                            err = (att().float() - ref).abs().max().item()
                            t = time_graph(att, ITERS, flush)
                            line(
                                f"attention {dtype:5s} b={batch:<3d} {mode:6s} w{warps} s{stages} per_sm {per_sm:<3}"
                                f" {t:8.2f} us  max|diff| {err:.2e}",
                                summary,
                            )
            del p
            torch.cuda.empty_cache()
    set_knobs()
    print("\n".join(["", "== summary =="] + summary))


def alloc_probe():
    flush = torch.empty(64 << 20, dtype=torch.float32, device="cuda")
    cases = {d: Problem(kvq, d, 64, 131072) for d in ("fp8", "nvfp4")}
    assert torch.equal(cases["fp8"].idx_k.view(torch.uint8), cases["nvfp4"].idx_k.view(torch.uint8))
    time.sleep(1.0)

    def run(tag, p):
        t = time_graph(indexer(p), ITERS, flush)
        print(f"{time.strftime('%H:%M:%S')} indexer fp8 index-K b=64 ctx=131072 on {tag:16s} {t:8.2f} us", flush=True)

    for rep in range(2):
        for d, p in cases.items():
            run(f"{d} case rep{rep}", p)
    for d, p in cases.items():
        p.idx_k = p.idx_k.clone()
        run(f"{d} case, copy", p)


if __name__ == "__main__":
    alloc_probe() if "--alloc" in sys.argv else attention_sweep()
