"""The Triton MSA kernels on tiny inputs, runnable on CPU through the Triton interpreter.

conftest.py sets ``TRITON_INTERPRET=1`` when there is no CUDA, so CI exercises the kernel
code (indexing, masking, NVFP4 decode, top-k order) without a GPU; on a GPU the same tests
run natively. The interpreter has no bf16 matmul, so these use fp32 and fp16 dots only
(fp32 q; bf16 q with FP8/NVFP4 pages, which compute in fp16).

| case                      | atol / rtol | why                                             |
| ------------------------- | ----------- | ----------------------------------------------- |
| fp32 q, fp32 pages        | 1e-5        | IEEE fp32; summation order only                 |
| bf16 q, FP8 / NVFP4 pages | 2e-2        | P rounded to fp16 for the PV dot (2^-11 rel)    |
"""

from __future__ import annotations

import pytest
import torch
from sglang_m3_kernels import kv_quant as kq
from sglang_m3_kernels.msa_index_topk import msa_topk, msa_topk_ref
from sglang_m3_kernels.msa_sparse_attn import msa_attention, msa_attention_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BS, TOPK, HKV, G, D = 16, 4, 2, 4, 32


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    pt = torch.randperm(64, generator=g)[:48].view(4, 12).int()
    # decode (req 0), verify over a block boundary (req 1), prefill slice (req 2), short (req 3)
    rr = torch.tensor([0, 1, 1, 1, 1, 2, 2, 2, 2, 2, 3])
    rp = torch.tensor([19, 94, 95, 96, 97, 0, 15, 16, 50, 96, 15])
    return g, pt.to(DEV), rr.to(DEV), rp.to(DEV)


@pytest.mark.parametrize("argmax", [False, True])
def test_topk_order_with_ties(monkeypatch, argmax):
    """Both in-register selections (bitonic tl.topk, rounds of arg-max) keep the reference order."""
    import sglang_m3_kernels.msa_index_topk as mt

    monkeypatch.setattr(mt, "_SELECT_ARGMAX_MIN_KEYS", 0 if argmax else 1 << 30)
    g, pt, rr, rp = _batch(1)
    iq = torch.randn(len(rr), HKV, D, generator=g).to(DEV)
    ik = torch.randn(64 * BS, D, generator=g)
    ik[torch.rand(64 * BS, generator=g) < 0.5] = 0  # many equal (zero) block maxima: ties
    ik = ik.to(DEV)
    got = msa_topk(iq, ik, pt, rr, rp, block_size=BS, topk=TOPK, local_blocks=2)
    ref = msa_topk_ref(iq, ik, pt, rr, rp, block_size=BS, topk=TOPK, local_blocks=2)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("fp8", [False, True])
def test_topk_long_score_programs(monkeypatch, fp8):
    """With one SM, each score program walks a whole row (up to 12 pages, ids loaded up front)."""
    import sglang_m3_kernels.msa_index_topk as mt

    monkeypatch.setattr(mt, "sm_count", lambda device: 1)
    g, pt, rr, rp = _batch(4)
    if fp8:
        rr, rp = rr[[0, 1, 5, 10]], rp[[0, 1, 5, 10]]  # one row per request: one-row tiles
    iq = torch.randn(len(rr), 1, D, generator=g).to(DEV)
    ik = torch.randn(64 * BS, D, generator=g).to(DEV)
    cache = kq.fp8_quantize_ref(ik, 0.5) if fp8 else ik
    view = kq.fp8_dequantize_ref(cache, 0.5) if fp8 else ik
    got = msa_topk(iq, cache, pt, rr, rp, block_size=BS, topk=TOPK, local_blocks=1, k_scale=0.5 if fp8 else 1.0)
    assert torch.equal(got, msa_topk_ref(iq, view, pt, rr, rp, block_size=BS, topk=TOPK, local_blocks=1))


@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("heads", [1, 2])
def test_topk_fp8_bf16_q(decode, heads):
    """FP8 index-K with bf16 q: fp16 tensor-core dots; decode = one row per request (one-row tiles)."""
    g, pt, rr, rp = _batch(5)
    if decode:
        rr, rp = rr[[0, 1, 5, 10]], rp[[0, 1, 5, 10]]
    iq = torch.randn(len(rr), heads, D, generator=g).to(torch.bfloat16).to(DEV)
    cache = kq.fp8_quantize_ref(torch.randn(64 * BS, D, generator=g).to(DEV), 0.5)
    view = kq.fp8_dequantize_ref(cache, 0.5)
    got = msa_topk(iq, cache, pt, rr, rp, block_size=BS, topk=TOPK, local_blocks=1, k_scale=0.5)
    assert torch.equal(got, msa_topk_ref(iq.float(), view, pt, rr, rp, block_size=BS, topk=TOPK, local_blocks=1))


def test_score_pages_fill_whole_waves():
    from sglang_m3_kernels.msa_index_topk import _score_pages

    for tiles, pages_per_row, slots, most in [
        (1, 64, 528, 32),
        (8, 256, 528, 32),
        (8, 1024, 528, 32),
        (64, 1024, 1056, 8),
    ]:
        pages = _score_pages(tiles, pages_per_row, slots, most)
        programs = tiles * -(-pages_per_row // pages)
        assert 1 <= pages <= most
        if tiles * -(-pages_per_row // most) <= slots:  # one wave is possible: the rule takes it
            assert programs <= slots
    assert _score_pages(1, 64, 528, 32) == 1  # short rows: one page per program, the most programs
    assert _score_pages(8, 1024, 528, 32) == 16  # 512 programs, one wave (the earlier rule: 8 pages, 1.9 waves)


@pytest.mark.parametrize("kind", ["fp32", "fp8", "nvfp4"])
def test_attention_small(kind):
    g, pt, rr, rp = _batch(2)
    k = torch.randn(64 * BS, HKV, D, generator=g).to(DEV)
    v = torch.randn(64 * BS, HKV, D, generator=g).to(DEV)
    q = torch.randn(len(rr), HKV * G, D, generator=g).to(DEV)
    bids = msa_topk_ref(
        torch.randn(len(rr), HKV, D, generator=g).to(DEV), k[:, 0], pt, rr, rp, block_size=BS, topk=TOPK, local_blocks=1
    )
    bids[::2, :, 1] = -1
    kw, tol = {}, 1e-5
    if kind == "fp8":
        kc, vc = kq.fp8_quantize_ref(k, 0.5), kq.fp8_quantize_ref(v, 0.25)
        kw, tol = dict(k_scale=0.5, v_scale=0.25), 2e-2
        k, v, q = kq.fp8_dequantize_ref(kc, 0.5), kq.fp8_dequantize_ref(vc, 0.25), q.to(torch.bfloat16)
    elif kind == "nvfp4":
        (kc, ksc), (vc, vsc) = kq.nvfp4_quantize_ref(k, 0.5), kq.nvfp4_quantize_ref(v, 2.0)
        kw, tol = dict(k_scale=0.5, v_scale=2.0, k_scales=ksc, v_scales=vsc), 2e-2
        k, v, q = kq.nvfp4_dequantize_ref(kc, ksc, 0.5), kq.nvfp4_dequantize_ref(vc, vsc, 2.0), q.to(torch.bfloat16)
    else:
        kc, vc = k, v
    for block_ids in (bids, None) if kind == "fp32" else (bids,):  # dense once: the interpreter is slow
        out = msa_attention(q, kc, vc, pt, rr, rp, block_ids, block_size=BS, scale=D**-0.5, **kw)
        ref = msa_attention_ref(q.float(), k, v, pt, rr, rp, block_ids, block_size=BS, scale=D**-0.5)
        torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("kind", ["fp32", "nvfp4"])
def test_attention_merge_launch_in_chunks(monkeypatch, kind):
    """Many splits (forced by a huge SM count), merged by the merge launch 2 partials at a time:
    dense rows split over the page table's 8 blocks, sparse rows over their 4 slots."""
    import sglang_m3_kernels.msa_sparse_attn as ma

    monkeypatch.setattr(ma, "sm_count", lambda device: 1 << 20)
    monkeypatch.setattr(ma, "_FUSE_MERGE_MAX_SPLITS", 0)
    monkeypatch.setattr(ma, "_MERGE_CHUNK", 2)
    g, pt, rr, rp = _batch(9)
    pt = pt[:, :8]  # every row of _batch lies in its first 8 blocks
    k = torch.randn(64 * BS, HKV, D, generator=g).to(DEV)
    v = torch.randn(64 * BS, HKV, D, generator=g).to(DEV)
    q = torch.randn(len(rr), HKV * G, D, generator=g).to(DEV)
    iq = torch.randn(len(rr), HKV, D, generator=g).to(DEV)
    bids = msa_topk_ref(iq, k[:, 0], pt, rr, rp, block_size=BS, topk=TOPK, local_blocks=1)
    kw, tol, kc, vc = {}, 1e-5, k, v
    if kind == "nvfp4":
        (kc, ksc), (vc, vsc) = kq.nvfp4_quantize_ref(k, 0.5), kq.nvfp4_quantize_ref(v, 2.0)
        kw, tol = dict(k_scale=0.5, v_scale=2.0, k_scales=ksc, v_scales=vsc), 2e-2
        k, v, q = kq.nvfp4_dequantize_ref(kc, ksc, 0.5), kq.nvfp4_dequantize_ref(vc, vsc, 2.0), q.to(torch.bfloat16)
    for block_ids in (bids, None):
        out = msa_attention(q, kc, vc, pt, rr, rp, block_ids, block_size=BS, scale=D**-0.5, **kw)
        ref = msa_attention_ref(q.float(), k, v, pt, rr, rp, block_ids, block_size=BS, scale=D**-0.5)
        torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("num_chunks,argmax", [(1, False), (1, True), (4, False)])
def test_select_kernel_chunked_matches_reference(num_chunks, argmax):
    """The select stage alone, also in its streaming form (rows longer than one sort)."""
    import sglang_m3_kernels.msa_index_topk as mt

    g = torch.Generator().manual_seed(4)
    rows, blocks = 6, 64
    scores = torch.randn(rows, 1, blocks, generator=g).round(decimals=1)  # rounding makes ties
    pos = torch.tensor([0, 15, 100, 511, 1023, 700]) * (blocks * BS // 1024)
    out = torch.empty(rows, 1, TOPK, dtype=torch.int32)
    chunk = blocks // num_chunks
    args = (scores.to(DEV), pos.to(DEV), out.to(DEV))
    mt._topk_select_kernel[(rows, 1)](
        *args,
        scores.stride(0),
        scores.stride(1),
        out.stride(0),
        out.stride(1),
        BS=BS,
        TOPK=TOPK,
        LOCAL=1,
        CHUNK=chunk,
        NUM_CHUNKS=num_chunks,
        K2=TOPK,
        ARGMAX=argmax,
    )
    for r in range(rows):
        nb = int(pos[r]) // BS + 1
        want = mt._select(scores[r : r + 1, :, :nb], pos[r : r + 1], block_size=BS, topk=TOPK, local_blocks=1)
        assert torch.equal(args[2][r].cpu(), want[0]), r


@pytest.mark.parametrize("fuse", [False, True])
def test_select_fused_or_not_and_merge_launch(monkeypatch, fuse):
    """Both selection paths (last score program selects / separate select launch) and both merges."""
    import sglang_m3_kernels.msa_index_topk as mt
    import sglang_m3_kernels.msa_sparse_attn as ma

    monkeypatch.setattr(mt, "_FUSE_SELECT_MAX_ROWS", 1 << 20 if fuse else 0)
    monkeypatch.setattr(mt, "_FUSE_SELECT_MAX_KEYS", 1 << 30)
    monkeypatch.setattr(ma, "_FUSE_MERGE_MAX_SPLITS", 1 << 20 if fuse else 0)
    g, pt, rr, rp = _batch(5)
    iq = torch.randn(len(rr), HKV, D, generator=g).to(DEV)
    ik = torch.randn(64 * BS, D, generator=g).to(DEV)
    for _ in range(2):  # the counters must be back at zero for the second launch
        got = msa_topk(iq, ik, pt, rr, rp, block_size=BS, topk=TOPK, local_blocks=1)
        assert torch.equal(got, msa_topk_ref(iq, ik, pt, rr, rp, block_size=BS, topk=TOPK, local_blocks=1))
    k = torch.randn(64 * BS, HKV, D, generator=g).to(DEV)
    v = torch.randn(64 * BS, HKV, D, generator=g).to(DEV)
    q = torch.randn(len(rr), HKV * G, D, generator=g).to(DEV)
    out = msa_attention(q, k, v, pt, rr, rp, got, block_size=BS, scale=D**-0.5)
    ref = msa_attention_ref(q, k, v, pt, rr, rp, got, block_size=BS, scale=D**-0.5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
