"""The Triton MSA kernels on tiny inputs, runnable on CPU through the Triton interpreter.

conftest.py sets ``TRITON_INTERPRET=1`` when there is no CUDA, so CI exercises the kernel
code (indexing, masking, NVFP4 decode, top-k order) without a GPU; on a GPU the same tests
run natively. The interpreter has no bf16 matmul, so these use fp32 and fp16 dots only
(fp32 q; bf16 q with FP8/NVFP4 pages, which compute in fp16).

Top-k: exact slot order (``torch.equal``), ties included. Attention: queries peaked on one
attended key (conftest ``peaked_q``), so a wrong page or scale block moves a row by O(1);
bound on the largest relative RMS error over (row, head) (conftest ``rel_err``), against the
reference in fp32 on the dequantised cache:

| case                      | bound | why                                                          |
| ------------------------- | ----- | ------------------------------------------------------------ |
| fp32 q, fp32 pages        | 1e-5  | IEEE fp32 dots and exp2; summation order only                |
| bf16 q, FP8 / NVFP4 pages | 1e-2  | output stored in bf16: one rounding, <= 2^-8 relative per    |
|                           |       | element (the interpreter truncates; the GPU rounds, 2^-9);   |
|                           |       | P rounded to fp16 for the PV dot adds <= 2^-11               |

``test_wrong_page_or_scale_block_fails_the_bound`` shows that one wrong page-table entry or
one wrong e4m3 scale byte gives an error far above these bounds.
"""

from __future__ import annotations

import pytest
import torch
from sglang_m3_kernels import kv_quant as kq
from sglang_m3_kernels.msa_index_topk import TopkSettings, msa_topk, msa_topk_ref
from sglang_m3_kernels.msa_sparse_attn import AttentionSettings, msa_attention, msa_attention_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BS, TOPK, HKV, G, D = 16, 4, 2, 4, 32
REL_ERR = {"fp32": 1e-5, "fp8": 1e-2, "nvfp4": 1e-2}  # see the table above


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    pt = torch.randperm(64, generator=g)[:48].view(4, 12).int()
    # decode (req 0), verify over a block boundary (req 1), prefill slice (req 2), short (req 3)
    rr = torch.tensor([0, 1, 1, 1, 1, 2, 2, 2, 2, 2, 3])
    rp = torch.tensor([19, 94, 95, 96, 97, 0, 15, 16, 50, 96, 15])
    return g, pt.to(DEV), rr.to(DEV), rp.to(DEV)


def _ints(shape, gen, lim=8):
    """Small integers as fp32: every dot of them is exact in fp32 / fp16-in-fp32 in any order."""
    return torch.randint(-lim, lim + 1, shape, generator=gen).float()


@pytest.mark.parametrize("chunk", [16, 512])
def test_topk_order_with_ties(chunk):
    """The streaming selection keeps the reference order, ties included, in one chunk per row (512)
    and in chunks merged into the running top-k (16 blocks: rows of up to 6 chunks)."""
    settings = TopkSettings(select_chunk=chunk, fuse_select_max_rows=0)
    g, pt, rr, rp = _batch(1)
    iq = torch.randn(len(rr), HKV, D, generator=g).to(DEV)
    ik = torch.randn(64 * BS, D, generator=g)
    ik[torch.rand(64 * BS, generator=g) < 0.5] = 0  # many equal (zero) block maxima: ties
    ik = ik.to(DEV)
    got = msa_topk(iq, ik, pt, rr, rp, block_size=BS, topk=TOPK, local_blocks=2, settings=settings)
    ref = msa_topk_ref(iq, ik, pt, rr, rp, block_size=BS, topk=TOPK, local_blocks=2)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("fuse", [False, True])
def test_topk_wide_page_table_short_rows(fuse):
    """A page table far wider than the rows (serving sizes it for the longest context): every score
    program takes strided pages and the selection stops at each row's own block; same ids."""
    g, pt, rr, rp = _batch(7)
    wide = torch.full((pt.shape[0], 256), 63, dtype=pt.dtype, device=pt.device)  # past the rows: never read
    wide[:, : pt.shape[1]] = pt
    settings = TopkSettings(fuse_select_max_rows=1 << 20 if fuse else 0, select_chunk=32)
    iq = _ints((len(rr), HKV, D), g).to(DEV)
    ik = _ints((64 * BS, D), g).to(DEV)
    got = msa_topk(iq, ik, wide, rr, rp, block_size=BS, topk=TOPK, local_blocks=1, settings=settings)
    assert torch.equal(got, msa_topk_ref(iq, ik, pt, rr, rp, block_size=BS, topk=TOPK, local_blocks=1))


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
    """FP8 index-K with bf16 q: fp16 tensor-core dots; decode = one row per request (one-row tiles).

    Integer q and keys (keys x 2 stored, exact in e4m3; k_scale 0.5 exact): the kernel's scores equal
    the reference's bit for bit, so the slot order must match exactly, ties included.
    """
    g, pt, rr, rp = _batch(5)
    if decode:
        rr, rp = rr[[0, 1, 5, 10]], rp[[0, 1, 5, 10]]
    iq = _ints((len(rr), heads, D), g).to(torch.bfloat16).to(DEV)
    cache = kq.fp8_quantize_ref(_ints((64 * BS, D), g).to(DEV), 0.5)
    view = kq.fp8_dequantize_ref(cache, 0.5)
    got = msa_topk(iq, cache, pt, rr, rp, block_size=BS, topk=TOPK, local_blocks=1, k_scale=0.5)
    assert torch.equal(got, msa_topk_ref(iq.float(), view, pt, rr, rp, block_size=BS, topk=TOPK, local_blocks=1))


def test_score_grid_is_one_wave_whatever_the_table_width():
    """The score grid is sized from shapes alone (graph safe) but never from the page table's width:
    the tiles share one wave of resident programs (at least one a tile, at most one a page)."""
    from sglang_m3_kernels.msa_index_topk import score_programs

    slots = 132 * 4
    for tiles in (1, 8, 32, 64, 512, 4096):
        for pages in (64, 1024, 8192):  # an 8K row's table, a 128K one, M3's 1M-context table
            programs = score_programs(tiles, pages, slots)
            assert 1 <= programs <= pages
            assert tiles * programs <= max(slots, tiles)
    assert score_programs(32, 8192, slots) == 16  # batch 32: 16 programs a request (was 256, 16 waves)
    assert score_programs(1, 64, slots) == 64  # batch 1 x 8K: one page a program


@pytest.mark.parametrize("fuse", [False, True])
def test_topk_few_programs_walk_many_pages(fuse, monkeypatch):
    """One program a tile (a GPU of one SM, one slot) walking up to 7 pages of a wide page table, its
    page ids loaded two at a time: the chunked walk reads every page once; same ids as the reference."""
    from sglang_m3_kernels import msa_index_topk

    monkeypatch.setattr(msa_index_topk, "sm_count", lambda device: 1)
    g, pt, rr, rp = _batch(11)
    wide = torch.full((pt.shape[0], 256), 63, dtype=pt.dtype, device=pt.device)
    wide[:, : pt.shape[1]] = pt
    settings = TopkSettings(score_slots=1, score_page_ids=2, fuse_select_max_rows=1 << 20 if fuse else 0)
    iq = _ints((len(rr), HKV, D), g).to(DEV)
    ik = _ints((64 * BS, D), g).to(DEV)
    got = msa_topk(iq, ik, wide, rr, rp, block_size=BS, topk=TOPK, local_blocks=1, settings=settings)
    assert torch.equal(got, msa_topk_ref(iq, ik, pt, rr, rp, block_size=BS, topk=TOPK, local_blocks=1))


def _kv(kind, g):
    """(kernel K/V args, dequantised K view, dequantised V view) of one of fp32 / fp8 / nvfp4."""
    k = torch.randn(64 * BS, HKV, D, generator=g).to(DEV)
    v = torch.randn(64 * BS, HKV, D, generator=g).to(DEV)
    if kind == "fp8":
        kc, vc = kq.fp8_quantize_ref(k, 0.5), kq.fp8_quantize_ref(v, 0.25)
        args = dict(k_cache=kc, v_cache=vc, k_scale=0.5, v_scale=0.25)
        return args, kq.fp8_dequantize_ref(kc, 0.5), kq.fp8_dequantize_ref(vc, 0.25)
    if kind == "nvfp4":
        (kc, ksc), (vc, vsc) = kq.nvfp4_quantize_ref(k, 0.5), kq.nvfp4_quantize_ref(v, 2.0)
        args = dict(k_cache=kc, v_cache=vc, k_scale=0.5, v_scale=2.0, k_scales=ksc, v_scales=vsc)
        return args, kq.nvfp4_dequantize_ref(kc, ksc, 0.5), kq.nvfp4_dequantize_ref(vc, vsc, 2.0)
    return dict(k_cache=k, v_cache=v), k, v


def _attend(q, kv, pt, rr, rp, block_ids, **kw):
    args = dict(kv)
    kc, vc = args.pop("k_cache"), args.pop("v_cache")
    return msa_attention(q, kc, vc, pt, rr, rp, block_ids, block_size=BS, scale=D**-0.5, **args, **kw)


def _peaked(kind, kview, pt, rr, rp, block_ids, g, peaked_q):
    q, slot = peaked_q(kview, pt, rr, rp, block_ids, G, BS, D**-0.5, g)
    return (q if kind == "fp32" else q.to(torch.bfloat16)), slot


@pytest.mark.parametrize("kind", ["fp32", "fp8", "nvfp4"])
def test_attention_small(kind, peaked_q, rel_err):
    g, pt, rr, rp = _batch(2)
    kv, kview, vview = _kv(kind, g)
    bids = msa_topk_ref(torch.randn(len(rr), HKV, D, generator=g).to(DEV), kview[:, 0], pt, rr, rp, block_size=BS,
                        topk=TOPK, local_blocks=1)  # fmt: skip
    bids[::2, :, 1] = -1
    for block_ids in (bids, None) if kind == "fp32" else (bids,):  # dense once: the interpreter is slow
        q, _ = _peaked(kind, kview, pt, rr, rp, block_ids, g, peaked_q)
        out = _attend(q, kv, pt, rr, rp, block_ids)
        ref = msa_attention_ref(q.float(), kview, vview, pt, rr, rp, block_ids, block_size=BS, scale=D**-0.5)
        assert rel_err(out, ref) <= REL_ERR[kind]


@pytest.mark.parametrize("kind,fault", [("fp32", "page"), ("nvfp4", "scale block")])
def test_wrong_page_or_scale_block_fails_the_bound(kind, fault, peaked_q, rel_err):
    """The attention bound is discriminating: the kernel on one wrong page-table entry (pointing at
    an unused page) or one wrong V scale byte, against the reference on the right inputs, exceeds it."""
    g, pt, rr, rp = _batch(6)
    kv, kview, vview = _kv(kind, g)
    bids = msa_topk_ref(torch.randn(len(rr), HKV, D, generator=g).to(DEV), kview[:, 0], pt, rr, rp, block_size=BS,
                        topk=TOPK, local_blocks=1)  # fmt: skip
    q, slot = _peaked(kind, kview, pt, rr, rp, bids, g, peaked_q)
    ref = msa_attention_ref(q.float(), kview, vview, pt, rr, rp, bids, block_size=BS, scale=D**-0.5)
    assert rel_err(_attend(q, kv, pt, rr, rp, bids), ref) <= REL_ERR[kind]
    s = int(slot[1, 0])  # the key that dominates row 1 (a verify row), head 0
    if fault == "page":
        bad_pt = pt.clone()
        unused = sorted(set(range(64)) - set(pt.flatten().tolist()))[0]
        bad_pt[bad_pt == s // BS] = unused
        out = _attend(q, kv, bad_pt, rr, rp, bids)
    else:
        bad = dict(kv)
        bad["v_scales"] = kv["v_scales"].clone()
        bad["v_scales"][s, 0, 0] = (kv["v_scales"][s, 0, 0].float() * 0.25).to(torch.float8_e4m3fn)
        out = _attend(q, bad, pt, rr, rp, bids)
    assert rel_err(out, ref) > 10 * REL_ERR[kind]


@pytest.mark.parametrize("kind", ["fp32", "nvfp4"])
def test_attention_merge_launch_in_chunks(kind, peaked_q, rel_err):
    """Many splits (forced by a huge programs-per-SM target), merged by the merge launch 2 partials
    at a time: dense rows split over the page table's 8 blocks, sparse rows over their 4 slots."""
    settings = AttentionSettings(split_programs_per_sm=1 << 20, fuse_merge_max_splits=0, merge_chunk=2)
    g, pt, rr, rp = _batch(9)
    pt = pt[:, :8]  # every row of _batch lies in its first 8 blocks
    kv, kview, vview = _kv(kind, g)
    iq = torch.randn(len(rr), HKV, D, generator=g).to(DEV)
    bids = msa_topk_ref(iq, kview[:, 0], pt, rr, rp, block_size=BS, topk=TOPK, local_blocks=1)
    for block_ids in (bids, None):
        q, _ = _peaked(kind, kview, pt, rr, rp, block_ids, g, peaked_q)
        out = _attend(q, kv, pt, rr, rp, block_ids, settings=settings)
        ref = msa_attention_ref(q.float(), kview, vview, pt, rr, rp, block_ids, block_size=BS, scale=D**-0.5)
        assert rel_err(out, ref) <= REL_ERR[kind]


@pytest.mark.parametrize("chunk", [64, 16, 4])
def test_select_kernel_chunked_matches_reference(chunk):
    """The select stage alone: one chunk per row, and rows streamed in chunks of 16 or 4 blocks
    (each chunk's top-k merged into the running one; 4: a chunk as narrow as the top-k itself)."""
    from sglang_m3_kernels.msa_index_topk import _select
    from sglang_m3_kernels.msa_index_topk_triton import _topk_select_kernel

    g = torch.Generator().manual_seed(4)
    rows, blocks = 6, 64
    scores = torch.randn(rows, 1, blocks, generator=g).round(decimals=1)  # rounding makes ties
    pos = torch.tensor([0, 15, 100, 511, 1023, 700]) * (blocks * BS // 1024)
    out = torch.empty(rows, 1, TOPK, dtype=torch.int32)
    args = (scores.to(DEV), pos.to(DEV), out.to(DEV))
    _topk_select_kernel[(rows, 1)](
        *args,
        scores.stride(0),
        scores.stride(1),
        out.stride(0),
        out.stride(1),
        BS=BS,
        TOPK=TOPK,
        LOCAL=1,
        CHUNK=max(chunk, TOPK),
        K2=TOPK,
    )
    for r in range(rows):
        nb = int(pos[r]) // BS + 1
        want = _select(scores[r : r + 1, :, :nb], pos[r : r + 1], block_size=BS, topk=TOPK, local_blocks=1)
        assert torch.equal(args[2][r].cpu(), want[0]), r


@pytest.mark.parametrize("fuse", [False, True])
def test_select_fused_or_not_and_merge_launch(fuse, peaked_q, rel_err):
    """Both selection paths (last score program selects / separate select launch) and both merges."""
    topk_settings = TopkSettings(fuse_select_max_rows=1 << 20 if fuse else 0, fuse_select_max_keys=1 << 30)
    attn_settings = AttentionSettings(fuse_merge_max_splits=1 << 20 if fuse else 0)
    g, pt, rr, rp = _batch(5)
    iq = _ints((len(rr), HKV, D), g).to(DEV)  # exact scores: slot order must match exactly
    ik = _ints((64 * BS, D), g).to(DEV)
    for _ in range(2):  # the counters must be back at zero for the second launch
        got = msa_topk(iq, ik, pt, rr, rp, block_size=BS, topk=TOPK, local_blocks=1, settings=topk_settings)
        assert torch.equal(got, msa_topk_ref(iq, ik, pt, rr, rp, block_size=BS, topk=TOPK, local_blocks=1))
    kv, kview, vview = _kv("fp32", g)
    q, _ = _peaked("fp32", kview, pt, rr, rp, got, g, peaked_q)
    out = _attend(q, kv, pt, rr, rp, got, settings=attn_settings)
    ref = msa_attention_ref(q, kview, vview, pt, rr, rp, got, block_size=BS, scale=D**-0.5)
    assert rel_err(out, ref) <= REL_ERR["fp32"]


def test_settings_reject_bad_values():
    with pytest.raises(ValueError, match="merge_chunk"):
        AttentionSettings(merge_chunk=3)
    with pytest.raises(ValueError, match="warps"):
        AttentionSettings(warps=(8, 8))
    with pytest.raises(ValueError, match="score_warps"):
        TopkSettings(score_warps=3)
    with pytest.raises(ValueError, match="select_chunk"):
        TopkSettings(select_chunk=48)
    with pytest.raises(TypeError, match="TopkSettings"):
        msa_topk(*[torch.zeros(1)] * 5, block_size=16, topk=4, local_blocks=1, settings=AttentionSettings())
