"""Knob sweep for the launch-fusion / PDL / NVFP4-decode work (tuning notes, not a test).

Run on the GPU host: ``python3 benchmarks/sweep_fusion.py``. Times, each as a CUDA-graph
replay with the L2 flushed (scripts/bench_kernels.py's harness):

* decode / verify (msa_topk + msa_attention), bf16, at batch 1/8/64 for three variants:
  ``base`` (score + select + attention + merge: four launches, no PDL), ``fused`` (select in
  the last score program, merge in the last split: two launches), ``fused+pdl``;
* the FP8 index-K decode at batch 64 x 128K with the select fused or not;
* attention alone, FP8 vs NVFP4 (inline-PTX or Triton nibble decode), 4 or 8 warps.
"""

from __future__ import annotations

import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "scripts"))
from bench_kernels import Problem, _kernels, attend, full_path, index_path  # noqa: E402
from bench_kernels import time_graph as _time_graph  # noqa: E402

kvq, msa_topk, msa_attention = _kernels()
from sglang_m3_kernels import msa_index_topk as mt  # noqa: E402
from sglang_m3_kernels import msa_sparse_attn as ma  # noqa: E402

ITERS = 10
T0 = time.time()


def time_graph(fn, iters, flush):
    try:
        return _time_graph(fn, iters, flush)
    except Exception as err:  # noqa: BLE001
        print(f"FAILED: {type(err).__name__}: {str(err)[:300]}", flush=True)
        torch.cuda.synchronize()
        return float("nan")


def knobs(fuse_rows=32, merge=True, pdl=True, asm=True, warps=(4, 4, 4)):
    mt._FUSE_SELECT_MAX_ROWS = fuse_rows
    ma._FUSE_MERGE_MAX_SPLITS = 1 << 20 if merge else 0
    ma._PDL = pdl
    ma._NVFP4_ASM = asm
    ma._WARPS = {0: warps[0], 1: warps[1], 2: warps[2]}


def run_path(p, mode, flush):
    return time_graph(full_path(p, (kvq, msa_topk, msa_attention), mode), ITERS, flush)


def run_attention(p, flush):
    ids = index_path(p, msa_topk, "decode")()
    return time_graph(lambda: attend(p, msa_attention, "decode", ids), ITERS, flush)


def main():
    flush = torch.empty(64 << 20, dtype=torch.float32, device="cuda")
    variants = {
        "base": dict(fuse_rows=0, merge=False, pdl=False),
        "fused": dict(pdl=False),
        "fused+pdl": dict(pdl=True),
    }
    summary = []
    for batch, ctx in ((1, 8192), (8, 8192), (1, 32768), (8, 32768), (1, 131072), (8, 131072), (64, 131072)):
        p = Problem(kvq, "bf16", batch, ctx)
        for mode in ("decode", "verify"):
            for name, kw in variants.items():
                knobs(**kw)
                t = run_path(p, mode, flush)
                floor = p.floor_us(mode, 1 if mode == "decode" else 4)
                line = f"{mode:6s} bf16 b={batch:<3d} ctx={ctx:<7d} {name:10s} {t:8.2f} us  floor {floor:7.2f}"
                print(line, f"[{time.time() - T0:.0f}s]", flush=True)
                summary.append(line)
        del p
        torch.cuda.empty_cache()
    # FP8 index-K decode at b64/128K: fused select or not (fusion normally stops at 32 rows)
    p = Problem(kvq, "fp8", 64, 131072)
    for name, kw in {"2-launch": dict(fuse_rows=32), "fused64": dict(fuse_rows=64), "base": variants["base"]}.items():
        knobs(**kw)
        t = run_path(p, "decode", flush)
        line = f"decode fp8  b=64  ctx=131072  {name:10s} {t:8.2f} us  floor {p.floor_us('decode', 1):7.2f}"
        print(line, f"[{time.time() - T0:.0f}s]", flush=True)
        summary.append(line)
    del p
    torch.cuda.empty_cache()
    # attention alone: FP8 vs NVFP4, decode variants and warps
    for batch in (1, 8, 64):
        probs = {dt: Problem(kvq, dt, batch, 32768) for dt in ("bf16", "fp8", "nvfp4")}
        for dt, asm, warps in (
            ("bf16", True, 4),
            ("bf16", True, 8),
            ("fp8", True, 4),
            ("fp8", True, 8),
            ("nvfp4", False, 4),
            ("nvfp4", True, 4),
            ("nvfp4", True, 8),
        ):
            knobs(asm=asm, warps=(warps, warps, warps))
            t = run_attention(probs[dt], flush)
            line = f"attention {dt:5s} b={batch:<3d} asm={asm!s:5s} warps={warps} {t:8.2f} us"
            print(line, f"[{time.time() - T0:.0f}s]", flush=True)
            summary.append(line)
        del probs
        torch.cuda.empty_cache()
    knobs()
    print("\n".join(["", "== summary =="] + summary))


if __name__ == "__main__":
    main()
