"""Launch-config sweep of the MSA indexer's block-score kernel (tuning notes, not a test).

Times ``_block_score_kernel`` alone for PAGES x num_warps x num_stages, and the select kernel
alone, at a few TP4 decode/verify shapes, each as a CUDA-graph replay with the L2 flushed.
Run on the GPU host: ``python3 benchmarks/sweep_indexer.py --grid`` (score-kernel launch grid),
``--paths`` (tensor-core vs FMA score kernel, select alone), ``--attention`` (NVFP4 decode
variants beside FP8 / BF16). Prints one line per configuration.
"""

from __future__ import annotations

import itertools
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
    """msa_topk end to end: tensor-core tile kernel vs the single-row FMA kernel; select alone."""
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
        for fma in (False, True):
            mt._SCORE_ROW_FMA = fma
            t = time_graph(lambda: mt.msa_topk(iq, ik, pt, req, pos, block_size=BS, topk=16, local_blocks=1), 10, flush)
            print(f"msa_topk b={batch} ctx={ctx} {kdt} row_fma={fma}: {t:7.1f} us (floor {floor:.1f})", flush=True)
        mt._SCORE_ROW_FMA = False
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


def main():
    flush = torch.empty(64 << 20, dtype=torch.float32, device="cuda")
    for batch, ctx, rows, kdt in [
        (8, 32768, 1, "bf16"),
        (64, 131072, 1, "fp8"),
        (1, 131072, 1, "bf16"),
        (8, 32768, 4, "bf16"),
        (64, 32768, 1, "bf16"),
    ]:
        pages = ctx // BS
        pt = torch.randperm(batch * pages + 1, device="cuda")[: batch * pages].view(batch, pages).int()
        ik = torch.randn((batch * pages + 1) * BS, D, device="cuda", dtype=torch.bfloat16)
        if kdt == "fp8":
            ik = ik.to(torch.float8_e4m3fn)
        req = torch.arange(batch, device="cuda").repeat_interleave(rows)
        pos = (ctx - rows + torch.arange(rows, device="cuda")).repeat(batch)
        R = batch * rows
        iq = torch.randn(R, 1, D, device="cuda", dtype=torch.bfloat16)
        scores = torch.empty(R, 1, pages, device="cuda")
        floor = batch * ctx * ik.element_size() * D / 4.3e12 * 1e6
        best = None
        for ppp, warps, stages in itertools.product((1, 2, 4, 8), (4, 8), (1, 2, 3)):
            block_r = rows
            n_tiles = R // block_r

            def run():
                mt._block_score_kernel[(n_tiles, triton.cdiv(pages, ppp))](
                    iq,
                    ik,
                    pt,
                    req,
                    pos,
                    scores,
                    1.0,
                    R,
                    iq.stride(0),
                    iq.stride(1),
                    ik.stride(0),
                    pt.stride(0),
                    scores.stride(0),
                    scores.stride(1),
                    H=1,
                    D=D,
                    BS=BS,
                    BLOCK_R=block_r,
                    BLOCK_M=16,
                    PAGES=ppp,
                    Q_FP32=False,
                    K_FP8=kdt == "fp8",
                    num_warps=warps,
                    num_stages=stages,
                )

            t = time_graph(run, 10, flush)
            best = min(best or (1e9,), (t, ppp, warps, stages))
            print(
                f"score b={batch} ctx={ctx} rows={rows} {kdt} pages={ppp} warps={warps} stages={stages}: "
                f"{t:7.1f} us (floor {floor:.1f})",
                flush=True,
            )
        out = torch.empty(R, 1, 16, dtype=torch.int32, device="cuda")
        chunk = min(triton.next_power_of_2(pages), 4096)
        for warps in (1, 2, 4, 8):
            t = time_graph(
                lambda: mt._topk_select_kernel[(R, 1)](
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
                    NUM_CHUNKS=triton.cdiv(pages, chunk),
                    K2=16,
                    num_warps=warps,
                ),
                10,
                flush,
            )
            print(f"select b={batch} ctx={ctx} rows={rows} warps={warps}: {t:7.1f} us", flush=True)
        print(f"BEST score b={batch} ctx={ctx} rows={rows} {kdt}: {best}", flush=True)


if __name__ == "__main__" and "--grid" in sys.argv:
    main()
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
