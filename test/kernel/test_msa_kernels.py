"""GPU parity of the Triton MSA kernels against the PyTorch references.

Fresh random inputs per test; page tables are a random permutation of physical pages;
decode, verify (1 + 3 rows straddling a block boundary) and prefill rows in one batch.

Attention: every query is peaked on one attended key (conftest ``peaked_q``: that key takes
~95 % of the softmax), so the output depends on which pages and scales are read; a near-flat
softmax over thousands of random keys would hide a wrong page under any loose tolerance. The
bound is on the largest relative RMS error over (row, head) (conftest ``rel_err``), against
``msa_attention_ref`` in fp32 on the *dequantised* cache:

| q / KV dtype     | bound | why                                                                |
| ---------------- | ----- | ------------------------------------------------------------------ |
| fp32 / fp32      | 1e-5  | IEEE fp32 dots; only summation order and exp2 rounding differ      |
| bf16 / bf16      | 1e-2  | bf16 output (<= 2^-9 relative per element) and P rounded to bf16   |
|                  |       | for the PV dot (<= 2^-9 per weight; the row max's weight is 1)     |
| bf16 / fp8 e4m3  | 1e-2  | bf16 output (2^-9); pages widen exactly to fp16; P in fp16 (2^-12) |
| bf16 / nvfp4     | 1e-2  | bf16 output (2^-9); e2m1 x e4m3 exact in fp16; P in fp16 (2^-12)   |

``test_wrong_page_or_scale_block_fails_the_bound`` shows one wrong page-table entry or one
wrong scale byte exceeding these bounds by far.

Selection (``msa_topk``): index q and keys are small integers, so every dot (fp32 IEEE, bf16 or
fp16 tensor cores with fp32 accumulation) is exact in any summation order and the kernel's
block scores equal the reference's bit for bit: the ids must equal the reference's slot for
slot, (score desc, block asc) order and ties included.
"""

from __future__ import annotations

import pytest
import torch
from sglang_m3_kernels import kv_quant as kq
from sglang_m3_kernels.msa_index_topk import TopkSettings, msa_topk, msa_topk_ref
from sglang_m3_kernels.msa_sparse_attn import AttentionSettings, msa_attention, msa_attention_ref

pytestmark = pytest.mark.gpu
REL_ERR = {"fp32": 1e-5, "bf16": 1e-2, "fp8": 1e-2, "nvfp4": 1e-2}  # see the table above
DEV = "cuda"


def make_batch(lens, block, *, verify=(), prefill=(), spare_pages=7, seed=0):
    """Random paged batch. ``lens[i]`` = KV length of request i (its rows end at lens - 1).

    Request i gets one decode row, or 4 verify rows if i in ``verify`` (positions
    lens-4..lens-1), or one row per token if i in ``prefill``. Returns page_table (shuffled
    physical pages), row_req, row_pos, num_slots.
    """
    g = torch.Generator().manual_seed(seed)
    max_pages = max(-(-n // block) for n in lens) + 2
    num_pages = len(lens) * max_pages + spare_pages
    perm = torch.randperm(num_pages, generator=g)
    page_table = perm[: len(lens) * max_pages].view(len(lens), max_pages).to(torch.int32)
    rows_req, rows_pos = [], []
    for i, n in enumerate(lens):
        pos = range(n) if i in prefill else range(n - 4, n) if i in verify else [n - 1]
        rows_req += [i] * len(pos)
        rows_pos += list(pos)
    as_dev = lambda x: torch.tensor(x, device=DEV)  # noqa: E731
    return page_table.to(DEV), as_dev(rows_req), as_dev(rows_pos), num_pages * block


def make_cache(kind, slots, heads, dim, g, ints=False):
    """(kernel cache args, dequantised fp32 view) for one of bf16/fp8/nvfp4/fp32.

    ``ints``: values are integers in [-8, 8] (exact in every dtype here; x 2 for FP8's scale 0.5).
    """
    x = ints_like((slots, heads, dim), g) if ints else torch.randn(slots, heads, dim, device=DEV, generator=g)
    if kind in ("bf16", "fp32"):
        c = x.to(torch.bfloat16 if kind == "bf16" else torch.float32)
        return (c, 1.0, None), c.float()
    if kind == "fp8":
        c = kq.fp8_quantize_ref(x, 0.5)
        return (c, 0.5, None), kq.fp8_dequantize_ref(c, 0.5)
    data, scales = kq.nvfp4_quantize_ref(x, 0.25)
    return (data, 0.25, scales), kq.nvfp4_dequantize_ref(data, scales, 0.25)


def ints_like(shape, g):
    """Integers in [-8, 8] as fp32: their dots (|sum| <= 128 x 64) are exact in fp32 in any order."""
    return torch.randint(-8, 9, shape, device=DEV, generator=g).float()


def make_index_k(kind, slots, g, dim=128):
    """Integer index-K cache ``[slots, dim]`` of bf16/fp8/fp32: (cache, k_scale, dequantised fp32 view)."""
    (cache, scale, _), view = make_cache(kind, slots, 1, dim, g, ints=True)  # fp8: scale 0.5, exact
    return cache[:, 0], scale, view[:, 0]


CASES = {
    # name: (lens, block, topk, kv_heads, group, verify, prefill, head dim of attention and index)
    "tp4_decode_verify": ([300, 2100, 5000, 9000, 128 * 16 + 1], 128, 16, 1, 16, (1, 3, 4), (), 128),
    "small_prefill": ([40, 150, 97, 16, 260], 16, 4, 2, 4, (1,), (2, 4), 128),
    "tp4_decode_only": ([300, 5000, 9000, 128 * 16 + 1], 128, 16, 1, 16, (), (), 128),  # single-row score path
    # the tiny M3's shapes (test/e2e engines on CUDA): head and index dim 32, 4 q heads per KV head
    "tiny_m3": ([40, 150, 97, 16, 260], 16, 4, 1, 4, (1,), (2, 4), 32),
    # 64 uneven decode rows: score programs of many pages whose chunks end mid-request
    "tp4_decode_64_uneven": (
        torch.randint(1, 20000, (64,), generator=torch.Generator().manual_seed(5)).tolist(),
        128,
        16,
        1,
        16,
        (),
        (),
        128,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kdtype", ["fp32", "bf16", "fp8"])
def test_topk_matches_reference(case, kdtype):
    lens, block, topk, hkv, _, verify, prefill, dim = CASES[case]
    g = torch.Generator(device=DEV).manual_seed(hash((case, kdtype)) % 2**31)
    pt, rr, rp, slots = make_batch(lens, block, verify=verify, prefill=prefill, seed=len(kdtype))
    iq = ints_like((len(rr), hkv, dim), g)
    cache, ks, view = make_index_k(kdtype, slots, g, dim)
    got = msa_topk(iq, cache, pt, rr, rp, block_size=block, topk=topk, local_blocks=1, k_scale=ks)
    ref = msa_topk_ref(iq, view, pt, rr, rp, block_size=block, topk=topk, local_blocks=1)
    assert got.shape == ref.shape and got.dtype == torch.int32
    assert torch.equal(got, ref)  # same ids in the same (score desc, block asc) order


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind", ["fp32", "bf16", "fp8", "nvfp4"])
@pytest.mark.parametrize("sparse", [True, False])
def test_attention_matches_reference(case, kind, sparse, peaked_q, rel_err):
    lens, block, topk, hkv, group, verify, prefill, dim = CASES[case]
    g = torch.Generator(device=DEV).manual_seed(hash((case, kind, sparse)) % 2**31)
    pt, rr, rp, slots = make_batch(lens, block, verify=verify, prefill=prefill, seed=3)
    num_rows = len(rr)
    (kc, ks, ksc), kview = make_cache(kind, slots, hkv, dim, g)
    (vc, vs, vsc), vview = make_cache(kind, slots, hkv, dim, g)
    block_ids = None
    if sparse:
        iq = torch.randn(num_rows, hkv, dim, device=DEV, generator=g)
        ik = torch.randn(slots, dim, device=DEV, generator=g)
        block_ids = msa_topk_ref(iq, ik, pt, rr, rp, block_size=block, topk=topk, local_blocks=1)
        block_ids[::3, :, 1] = -1  # holes in the middle of a selection
    q, _ = peaked_q(kview, pt, rr, rp, block_ids, group, block, dim**-0.5, g)
    q = q if kind == "fp32" else q.to(torch.bfloat16)
    out = torch.full((num_rows, hkv * group, dim), float("nan"), dtype=q.dtype, device=DEV)  # poison
    got = msa_attention(
        q,
        kc,
        vc,
        pt,
        rr,
        rp,
        block_ids,
        block_size=block,
        scale=dim**-0.5,
        k_scale=ks,
        v_scale=vs,
        k_scales=ksc,
        v_scales=vsc,
        out=out,
    )
    ref = msa_attention_ref(q.float(), kview, vview, pt, rr, rp, block_ids, block_size=block, scale=dim**-0.5)
    assert rel_err(got, ref) <= REL_ERR[kind]


@pytest.mark.parametrize("kind,fault", [("bf16", "page"), ("fp8", "page"), ("nvfp4", "scale block")])
def test_wrong_page_or_scale_block_fails_the_bound(kind, fault, peaked_q, rel_err):
    """The bound is discriminating: one page-table entry pointing at an unused page, or one wrong
    e4m3 V scale byte, fed to the kernel and compared with the reference on the right inputs,
    exceeds it by far (the right inputs pass in the same test)."""
    lens, block, topk, hkv, group, verify, *_ = CASES["tp4_decode_verify"]
    g = torch.Generator(device=DEV).manual_seed(17)
    pt, rr, rp, slots = make_batch(lens, block, verify=verify, seed=17)
    (kc, ks, ksc), kview = make_cache(kind, slots, hkv, 128, g)
    (vc, vs, vsc), vview = make_cache(kind, slots, hkv, 128, g)
    iq = torch.randn(len(rr), hkv, 128, device=DEV, generator=g)
    bids = msa_topk_ref(iq, kview[:, 0], pt, rr, rp, block_size=block, topk=topk, local_blocks=1)
    q, slot = peaked_q(kview, pt, rr, rp, bids, group, block, 128**-0.5, g)
    q = q.to(torch.bfloat16)
    kw = dict(block_size=block, scale=128**-0.5, k_scale=ks, v_scale=vs, k_scales=ksc)
    ref = msa_attention_ref(q.float(), kview, vview, pt, rr, rp, bids, block_size=block, scale=128**-0.5)
    assert rel_err(msa_attention(q, kc, vc, pt, rr, rp, bids, v_scales=vsc, **kw), ref) <= REL_ERR[kind]
    s = int(slot[2, 0])  # the key that dominates row 2 (a verify row), head 0
    if fault == "page":
        bad_pt = pt.clone()
        used = set(pt.flatten().tolist())
        bad_pt[bad_pt == s // block] = next(p for p in range(slots // block) if p not in used)
        out = msa_attention(q, kc, vc, bad_pt, rr, rp, bids, v_scales=vsc, **kw)
    else:
        bad_vsc = vsc.clone()
        bad_vsc[s, 0, 0] = (vsc[s, 0, 0].float() * 0.25).to(torch.float8_e4m3fn)
        out = msa_attention(q, kc, vc, pt, rr, rp, bids, v_scales=bad_vsc, **kw)
    assert rel_err(out, ref) > 5 * REL_ERR[kind]


def test_store_then_attend_nvfp4_equals_dequantised_pool():
    """kv_store into an NVFP4 pool, attend, vs the same kernel on a bf16 pool of dequantised pages."""
    lens, block, topk, hkv, group, verify, *_ = CASES["tp4_decode_verify"]
    pt, rr, rp, slots = make_batch(lens, block, verify=verify, seed=5)
    g = torch.Generator(device=DEV).manual_seed(5)
    k = torch.randn(slots, hkv, 128, device=DEV, generator=g).to(torch.bfloat16)
    v = torch.randn(slots, hkv, 128, device=DEV, generator=g).to(torch.bfloat16)
    loc = torch.randperm(slots, device=DEV)
    kc = torch.zeros(slots, hkv, 64, dtype=torch.uint8, device=DEV)
    vc = torch.zeros_like(kc)
    ksc = torch.zeros(slots, hkv, 8, dtype=torch.float8_e4m3fn, device=DEV)
    vsc = torch.zeros_like(ksc)
    kq.kv_store(k[loc], loc, kc, scale=1.0, scales=ksc)
    kq.kv_store(v[loc], loc, vc, scale=1.0, scales=vsc)
    kview = kq.nvfp4_dequantize_ref(kc, ksc, 1.0, torch.bfloat16)  # exact in bf16
    vview = kq.nvfp4_dequantize_ref(vc, vsc, 1.0, torch.bfloat16)
    q = torch.randn(len(rr), hkv * group, 128, device=DEV, generator=g).to(torch.bfloat16)
    bids = msa_topk_ref(
        torch.randn(len(rr), hkv, 128, device=DEV, generator=g),
        k[:, 0].float(),
        pt,
        rr,
        rp,
        block_size=block,
        topk=topk,
        local_blocks=1,
    )
    a = msa_attention(q, kc, vc, pt, rr, rp, bids, block_size=block, scale=0.088, k_scales=ksc, v_scales=vsc)
    b = msa_attention(q, kview, vview, pt, rr, rp, bids, block_size=block, scale=0.088)
    # same K/V values (exact in both bf16 and fp16); the NVFP4 launch runs its dots in fp16 and
    # the bf16 one in bf16, so only the rounding of P differs: allow one bf16 ulp at |x| < 1
    torch.testing.assert_close(a.float(), b.float(), atol=2.0**-8, rtol=0)


def test_cuda_graph_replay_matches_eager():
    """Capture topk + attention once, then replay on new positions / page tables / data."""
    lens, block, topk, hkv, group, verify, *_ = CASES["tp4_decode_verify"]
    pt, rr, rp, slots = make_batch(lens, block, verify=verify, seed=7)
    g = torch.Generator(device=DEV).manual_seed(7)
    iq = torch.randn(len(rr), hkv, 128, device=DEV, generator=g).to(torch.bfloat16)
    ik = torch.randn(slots, 128, device=DEV, generator=g).to(torch.bfloat16)
    q = torch.randn(len(rr), hkv * group, 128, device=DEV, generator=g).to(torch.bfloat16)
    kc = torch.randn(slots, hkv, 128, device=DEV, generator=g).to(torch.bfloat16)
    vc = torch.randn(slots, hkv, 128, device=DEV, generator=g).to(torch.bfloat16)

    def step():
        ids = msa_topk(iq, ik, pt, rr, rp, block_size=block, topk=topk, local_blocks=1)
        return ids, msa_attention(q, kc, vc, pt, rr, rp, ids, block_size=block, scale=0.088)

    step()  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids_g, out_g = step()
    for trial in range(2):
        pt.copy_(pt[:, torch.randperm(pt.shape[1], device=DEV)])
        rp.sub_(trial * 3 + 1)  # shorter contexts: the graph must not bake lengths in
        iq.normal_()
        q.normal_()
        graph.replay()
        ids_e, out_e = step()
        assert torch.equal(ids_g, ids_e)
        assert torch.equal(out_g, out_e)


def test_bad_inputs_raise_value_error():
    q = torch.randn(2, 16, 128, device=DEV, dtype=torch.bfloat16)
    kc = torch.randn(256, 1, 128, device=DEV, dtype=torch.bfloat16)
    pt = torch.zeros(2, 2, dtype=torch.int32, device=DEV)
    rows = torch.zeros(2, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="block_ids"):
        msa_attention(
            q, kc, kc, pt, rows, rows, torch.zeros(2, 2, 4, device=DEV, dtype=torch.int32), block_size=128, scale=1.0
        )
    with pytest.raises(ValueError, match="NVFP4"):
        msa_attention(
            q,
            kc.view(torch.uint8)[..., :64],
            kc.view(torch.uint8)[..., :64],
            pt,
            rows,
            rows,
            None,
            block_size=128,
            scale=1.0,
        )
    with pytest.raises(ValueError, match="slots, 128"):
        msa_topk(q[:, :1], kc[:, 0, :64], pt, rows, rows, block_size=128, topk=16, local_blocks=1)


@pytest.mark.parametrize("case", ["tp4_decode_verify", "small_prefill", "tp4_decode_64_uneven"])
@pytest.mark.parametrize("stages", [None, 2, 4])  # None: the defaults (bf16 2, FP8 3)
@pytest.mark.parametrize("kdtype", ["bf16", "fp8"])
def test_topk_bf16_q_matches_reference(case, stages, kdtype):
    """bf16 q (the served dtype: tensor-core dots) with 1-3 index-K pages in flight per score program."""
    settings = TopkSettings() if stages is None else TopkSettings(score_stages=stages, score_stages_fp8=stages)
    lens, block, topk, hkv, _, verify, prefill, _ = CASES[case]
    g = torch.Generator(device=DEV).manual_seed(hash((case, stages, kdtype)) % 2**31)
    pt, rr, rp, slots = make_batch(lens, block, verify=verify, prefill=prefill, seed=3)
    iq = ints_like((len(rr), hkv, 128), g).to(torch.bfloat16)
    cache, ks, view = make_index_k(kdtype, slots, g)
    got = msa_topk(iq, cache, pt, rr, rp, block_size=block, topk=topk, local_blocks=1, k_scale=ks, settings=settings)
    ref = msa_topk_ref(iq.float(), view, pt, rr, rp, block_size=block, topk=topk, local_blocks=1)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("verify", [(), (0, 1, 2, 3, 4)])
@pytest.mark.parametrize("kdtype", ["bf16", "fp8"])
def test_fused_select_equals_two_launch_path(verify, kdtype):
    """Last-program-selects (one launch) vs score + select kernels: identical ids, also on replay."""
    lens = [300, 2100, 5000, 9000, 128 * 16 + 1]
    pt, rr, rp, slots = make_batch(lens, 128, verify=verify, seed=11)
    g = torch.Generator(device=DEV).manual_seed(11)
    iq = torch.randn(len(rr), 1, 128, device=DEV, generator=g).to(torch.bfloat16)
    ik = torch.randn(slots, 128, device=DEV, generator=g)
    ik = kq.fp8_quantize_ref(ik, 0.5) if kdtype == "fp8" else ik.to(torch.bfloat16)
    kw = dict(block_size=128, topk=16, local_blocks=1, k_scale=0.5 if kdtype == "fp8" else 1.0)
    want = msa_topk(iq, ik, pt, rr, rp, **kw, settings=TopkSettings(fuse_select_max_rows=0))
    kw["settings"] = TopkSettings(fuse_select_max_rows=1 << 20, fuse_select_max_keys=1 << 30)
    out = torch.full_like(want, -7)
    graph = torch.cuda.CUDAGraph()
    msa_topk(iq, ik, pt, rr, rp, out=out, **kw)  # compile outside capture
    assert torch.equal(out, want)
    with torch.cuda.graph(graph):
        msa_topk(iq, ik, pt, rr, rp, out=out, **kw)
    for _ in range(3):  # counters must be back at zero after every replay
        out.fill_(-7)
        graph.replay()
        assert torch.equal(out, want)


@pytest.mark.parametrize("kind", ["bf16", "fp8", "nvfp4"])
def test_fused_merge_and_nvfp4_decode_variants_agree(kind, peaked_q, rel_err):
    """Fused split merge vs the merge launch; NVFP4 inline-PTX decode vs the Triton decode."""
    lens, block, topk, hkv, group, verify, *_ = CASES["tp4_decode_verify"]
    pt, rr, rp, slots = make_batch(lens, block, verify=verify, seed=13)
    g = torch.Generator(device=DEV).manual_seed(13)
    (kc, ks, ksc), kview = make_cache(kind, slots, hkv, 128, g)
    (vc, vs, vsc), vview = make_cache(kind, slots, hkv, 128, g)
    iq = torch.randn(len(rr), hkv, 128, device=DEV, generator=g)
    bids = msa_topk_ref(iq, kview[:, 0], pt, rr, rp, block_size=block, topk=topk, local_blocks=1)
    q = peaked_q(kview, pt, rr, rp, bids, group, block, 128**-0.5, g)[0].to(torch.bfloat16)
    kw = dict(block_size=block, scale=128**-0.5, k_scale=ks, v_scale=vs, k_scales=ksc, v_scales=vsc)
    ref = msa_attention_ref(q.float(), kview, vview, pt, rr, rp, bids, block_size=block, scale=128**-0.5)
    outs = []
    for fuse, asm, warps in ((False, False, 4), (True, False, 4), (True, True, 4), (True, True, 8)):
        settings = AttentionSettings(
            fuse_merge_max_splits=1 << 20 if fuse else 0, nvfp4_asm=asm, warps=(warps, warps, warps)
        )
        got = msa_attention(q, kc, vc, pt, rr, rp, bids, **kw, settings=settings)
        assert rel_err(got, ref) <= REL_ERR[kind]
        outs.append(got.float())
    for o in outs[1:]:  # same products, only summation orders differ: a bf16 rounding step at most
        assert rel_err(o, outs[0]) <= 2.0**-8
