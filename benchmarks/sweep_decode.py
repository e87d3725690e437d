"""One-launch decode (``msa_decode``) vs the two-step path (``msa_topk`` + ``msa_attention``).

Run on the GPU host: ``python3 benchmarks/sweep_decode.py [--out DIR]`` (tuning notes, not a
test). Times every variant as a CUDA-graph replay with the L2 flushed (scripts/bench_kernels.py's
harness) at the issue-4 shape, batch 1/8/64 x context 8K/32K/128K, bf16/fp8/nvfp4 layouts, and a
one-kernel graph (the harness's own overhead). Writes ``sweep_decode.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "scripts"))
from bench_kernels import BLOCK, LOCAL, SCALE, TOPK, Problem, _kernels, time_graph  # noqa: E402

kvq, msa_topk, msa_attention = _kernels()
from sglang_m3_kernels import msa_decode as md  # noqa: E402

ITERS = 10
VARIANTS = {  # name: msa_decode knobs
    "atomic-spin": dict(_SPIN=1),
    "volatile-spin": dict(_SPIN=2),
    "volatile,ns4": dict(_SPIN=2, _MAX_SPLITS=4),
    # diagnostic only, racy: attention does not wait for the select (in a replay loop it reads the
    # previous replay's ids, which are the same); bounds what the flag hand-off costs
    "no-wait(racy)": dict(_SPIN=0),
}
DEFAULTS = {k: getattr(md, k) for kw in VARIANTS.values() for k in kw}


def run_case(dtype, batch, ctx, flush):
    p = Problem(kvq, dtype, batch, ctx)
    req, pos, iq, q = p.rows["decode"]
    kv = dict(k_scales=p.kv["k"][1], v_scales=p.kv["v"][1])
    sel = dict(block_size=BLOCK, topk=TOPK, local_blocks=LOCAL)
    k, v = p.kv["k"][0], p.kv["v"][0]

    def two_step():
        ids = msa_topk(iq, p.idx_k, p.page_table, req, pos, **sel)
        return msa_attention(q, k, v, p.page_table, req, pos, ids, block_size=BLOCK, scale=SCALE, **kv)

    def fused():
        return md.msa_decode(iq, p.idx_k, q, k, v, p.page_table, req, pos, scale=SCALE, **sel, **kv)

    err = (two_step().float() - fused()[0].float()).abs().max().item()
    rec = dict(dtype=dtype, batch=batch, context=ctx, floor_us=round(p.floor_us("decode", 1), 2), max_abs_diff=err)
    rec["two_step_us"] = round(time_graph(two_step, ITERS, flush), 2)
    for name, kw in VARIANTS.items():
        for k, val in {**DEFAULTS, **kw}.items():
            setattr(md, k, val)
        try:
            rec[name] = round(time_graph(fused, ITERS, flush), 2)
        except Exception as e:  # noqa: BLE001
            rec[name] = f"failed: {type(e).__name__}: {str(e)[:200]}"
    for k, val in DEFAULTS.items():
        setattr(md, k, val)
    return rec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--contexts", default="8192,32768,131072")
    ap.add_argument("--dtypes", default="bf16,fp8")
    args = ap.parse_args()
    t0 = time.time()
    flush = torch.empty(64 << 20, dtype=torch.float32, device="cuda")
    tiny = torch.zeros(1, device="cuda")
    recs = [dict(case="one-kernel graph (harness overhead)", us=time_graph(lambda: tiny.add_(1), ITERS, flush))]
    print(recs[0], flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for ctx in map(int, args.contexts.split(",")):
        for dtype in args.dtypes.split(","):
            for batch in map(int, args.batches.split(",")):
                recs.append(run_case(dtype, batch, ctx, flush))
                print(recs[-1], f"[{time.time() - t0:.0f}s]", flush=True)
                torch.cuda.empty_cache()
                (out / "sweep_decode.json").write_text(json.dumps(recs, indent=1))


if __name__ == "__main__":
    main()
