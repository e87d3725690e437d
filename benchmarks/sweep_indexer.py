"""Indexer paths and NVFP4 attention decode variants (tuning notes, not a test).

Run on the GPU host: ``python3 benchmarks/sweep_indexer.py --paths`` (``msa_topk`` and the
select kernel alone; run 3 also timed the FMA row score kernel, removed after run 13) or
``--attention`` (NVFP4 decode variants beside FP8 / BF16). Prints one line per configuration.
The score kernel's launch-grid sweep of runs 2-3 (``--grid``) drove the kernel directly and
went with its old signature; the grid is now swept through ``msa_topk`` by ``sweep_grid.py``.
"""

from __future__ import annotations

import pathlib
import sys

import torch
import triton

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "scripts"))
from bench_kernels import _kernels, time_graph  # noqa: E402

_kernels()
from sglang_m3_kernels import msa_index_topk as mt  # noqa: E402

BS, D = 128, 128


def sweep_indexer_paths():
    """msa_topk end to end; the select kernel alone."""
    flush = torch.empty(64 << 20, dtype=torch.float32, device="cuda")
    for batch, ctx, kdt in [
        (1, 131072, "bf16"),
        (8, 32768, "bf16"),
        (8, 131072, "bf16"),
        (64, 32768, "bf16"),
        (64, 131072, "fp8"),
    ]:
        pages = ctx // BS
        pt = torch.randperm(batch * pages + 1, device="cuda")[: batch * pages].view(batch, pages).int()
        ik = torch.randn((batch * pages + 1) * BS, D, device="cuda", dtype=torch.bfloat16)
        ik = ik.to(torch.float8_e4m3fn) if kdt == "fp8" else ik
        req = torch.arange(batch, device="cuda")
        pos = torch.full((batch,), ctx - 1, device="cuda")
        iq = torch.randn(batch, 1, D, device="cuda", dtype=torch.bfloat16)
        floor = batch * ctx * ik.element_size() * D / 4.3e12 * 1e6
        t = time_graph(lambda: mt.msa_topk(iq, ik, pt, req, pos, block_size=BS, topk=16, local_blocks=1), 10, flush)
        print(f"msa_topk b={batch} ctx={ctx} {kdt}: {t:7.1f} us (floor {floor:.1f})", flush=True)
        scores = torch.randn(batch, 1, pages, device="cuda")
        out = torch.empty(batch, 1, 16, dtype=torch.int32, device="cuda")
        chunk = min(triton.next_power_of_2(pages), 4096)
        t = time_graph(
            lambda: mt._topk_select_kernel[(batch, 1)](
                scores,
                pos,
                out,
                scores.stride(0),
                scores.stride(1),
                out.stride(0),
                out.stride(1),
                BS=BS,
                TOPK=16,
                LOCAL=1,
                CHUNK=chunk,
                NUM_CHUNKS=1,
                K2=16,
                num_warps=max(1, min(8, chunk // 512)),
            ),
            10,
            flush,
        )
        print(f"select b={batch} ctx={ctx}: {t:7.1f} us", flush=True)
        del ik


if __name__ == "__main__" and "--paths" in sys.argv:
    sweep_indexer_paths()


def sweep_nvfp4_attention():
    """NVFP4 decode variants (even/odd split dots vs per-element gather) beside FP8 and BF16."""
    from bench_kernels import Problem
    from bench_kernels import _kernels as kernels_

    kvq, _, msa_attention = kernels_()
    from sglang_m3_kernels import msa_sparse_attn as ma

    flush = torch.empty(64 << 20, dtype=torch.float32, device="cuda")
    for batch in (8, 64):
        for dtype in ("bf16", "fp8", "nvfp4"):
            p = Problem(kvq, dtype, batch, 32768)
            req, pos, _, q = p.rows["decode"]
            ids = torch.randint(0, 256, (batch, 1, 16), device="cuda", dtype=torch.int32)
            ids[:, :, 0] = 255
            for eo in (True, False) if dtype == "nvfp4" else (True,):
                ma._NVFP4_EVEN_ODD = eo
                t = time_graph(
                    lambda: msa_attention(
                        q,
                        p.kv["k"][0],
                        p.kv["v"][0],
                        p.page_table,
                        req,
                        pos,
                        ids,
                        block_size=BS,
                        scale=0.088,
                        k_scales=p.kv["k"][1],
                        v_scales=p.kv["v"][1],
                    ),
                    10,
                    flush,
                )
                print(f"attention {dtype} b={batch} even_odd={eo}: {t:.1f} us", flush=True)
            ma._NVFP4_EVEN_ODD = True
            del p


if __name__ == "__main__" and "--attention" in sys.argv:
    sweep_nvfp4_attention()
