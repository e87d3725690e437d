"""Triton bodies of ``msa_sparse_attn`` (launcher, reference and settings live there).

Split-K ("flash-decoding") attention, one program per (row, KV group, split):

* The group's G query heads form the M side of every ``tl.dot`` (G = 16 at TP4), so a key
  page is loaded once per (row, group) and used by all its heads.
* Sparse: split ``s`` walks slots ``s, s + NS, ...`` of ``block_ids[row, group]``; dense
  (``block_ids=None``): blocks ``s, s + NS, ...`` up to the row's own block. Empty (-1) or
  future slots load nothing.
* Pages are dequantised in registers right after the load, into fp16 (the dots then run in
  fp16): FP8 widens exactly (per-tensor scales folded into the softmax scale and the output);
  NVFP4 turns each nibble into an fp16 bit pattern (e2m1 x 2^-14) and multiplies by its e4m3
  block scale (e2m1 x e4m3 has <= 6 significant bits: exact in fp16). NVFP4 splits every dot
  into even and odd head-dim halves (low / high nibbles), so the packed bytes load as one
  vectorised tile and never need interleaving. With D = 128 the decode is one inline-PTX block
  per 4 packed bytes (prmt / shift / and / or, the 8 block scales of a row read as one int64 and
  picked per byte with prmt, one f16x2 multiply per pair): ~3 integer ops per element instead
  of ~10 plus a per-element scale gather. fp32 q (token-exact runs) keeps fp32 pages and IEEE
  dots throughout.
* Exact token-causal masking on key positions, online softmax in base 2.
* With NS > 1 splits, each program writes its (output, log-sum-exp) partial and
  ``_merge_kernel`` combines them. With few splits the attention kernel merges them itself
  (``FUSE_MERGE``): each program takes a ticket on a per-(row, group) counter and the program
  that draws the last ticket merges the NS partials, then resets the counter to 0 (so the
  counters stay zero between launches and the kernel stays CUDA-graph safe).
* Programmatic dependent launch (``pdl.py``): wait before the first read of what the previous
  kernel wrote, signal dependents after the main loop.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .pdl import gdc_launch_dependents, gdc_wait

# One call decodes 4 packed NVFP4 bytes: $4 holds bytes b0..b3 (element k in byte k), $5..$8
# the 8 e4m3 block scales of each element's row as one int64, $9..$12 which of those 8 bytes
# is each element's scale. Outputs (fp16 pairs): $0 = lo(b0, b1), $1 = lo(b2, b3),
# $2 = hi(b0, b1), $3 = hi(b2, b3); lo/hi = low/high nibble decoded as e2m1 * 2^-14 * scale.
# Nibble s.ab.c -> fp16 bits: magnitude (abc) << 9 lands in exponent/mantissa so that
# fp16(m << 9) = e2m1(m) * 2^-14 (m = 1 is the subnormal 2^-15); sign bit 3 -> bit 15.
_NVFP4_PAIR = """
prmt.b32 x, $4, 0, {sel};
shl.b32 a, x, 9;  and.b32 a, a, 0x0E000E00;
shl.b32 b, x, 12; and.b32 b, b, 0x80008000;
or.b32 lo, a, b;
shl.b32 a, x, 5;  and.b32 a, a, 0x0E000E00;
shl.b32 b, x, 8;  and.b32 b, b, 0x80008000;
or.b32 hi, a, b;
mov.b64 {{sl, sh}}, ${s0}; prmt.b32 t0, sl, sh, ${g0};
mov.b64 {{sl, sh}}, ${s1}; prmt.b32 t1, sl, sh, ${g1};
prmt.b32 s, t0, t1, 0x0040;
mov.b32 {{s16, s16h}}, s;
cvt.rn.f16x2.e4m3x2 sc, s16;
mul.f16x2 ${olo}, lo, sc;
mul.f16x2 ${ohi}, hi, sc;
"""
_NVFP4_DECODE_ASM = tl.constexpr(
    "{\n.reg .b32 x, a, b, lo, hi, t0, t1, s, sl, sh, sc;\n.reg .b16 s16, s16h;\n"
    + _NVFP4_PAIR.format(sel="0x4140", s0=5, s1=6, g0=9, g1=10, olo=0, ohi=2)
    + _NVFP4_PAIR.format(sel="0x4342", s0=7, s1=8, g0=11, g1=12, olo=1, ohi=3)
    + "}"
)


@triton.jit
def _load_page(
    ptr,
    sc_ptr,
    slots,
    head,
    stride_t,
    stride_h,
    stride_st,
    stride_sh,
    live,
    DIM: tl.constexpr,
    MODE: tl.constexpr,
    CDT: tl.constexpr,
):
    """Load ``[BS, DIM]`` keys/values of one page and dequantise to the compute dtype ``CDT``.

    NVFP4 pages come back scaled by 2^-14 (the caller folds 2^14 into its scales): see below.
    """
    base = slots[:, None].to(tl.int64) * stride_t + head * stride_h
    e = tl.arange(0, DIM)[None, :]
    if MODE == 2:
        # -- NVFP4: element e sits in byte e // 2, low nibble if e is even ----------------
        # (each byte is loaded by two lanes; the duplicate read is served by L1)
        packed = tl.load(ptr + base + e // 2, mask=live, other=0).to(tl.int32)
        code = packed >> ((e & 1) * 4)
        # E2M1 magnitude m = 2a + b placed at fp16 bit 9 gives exponent field a, mantissa b:
        # fp16(m << 9) = e2m1(m) * 2^-14 for every m (m = 1 lands on the subnormal 2^-15),
        # so one shift and an OR with the sign (bit 3 -> bit 15) decode a nibble.
        bits = ((code & 7) << 9) | ((code & 8) << 12)
        val = bits.to(tl.int16).to(tl.float16, bitcast=True)
        # e4m3 block scale (exact in fp16); the product has <= 6 significant bits and lies
        # in [2^-24, 0.17]: exact in fp16 (subnormals included)
        sc = tl.load(
            sc_ptr + slots[:, None].to(tl.int64) * stride_st + head * stride_sh + e // 16, mask=live, other=0.0
        ).to(tl.float16)
        return (val * sc).to(CDT)
    else:
        return tl.load(ptr + base + e, mask=live, other=0.0).to(CDT)


@triton.jit
def _load_nvfp4_halves(
    ptr, sc_ptr, slots, head, stride_t, stride_h, stride_st, stride_sh, live, DIM: tl.constexpr, ASM: tl.constexpr
):
    """NVFP4 page as (even elements, odd elements), each ``[BS, DIM // 2]`` fp16 x 2^-14.

    Byte i holds elements 2i (low nibble) and 2i+1 (high nibble): splitting the dot into
    even and odd halves needs no nibble interleaving, so the packed bytes load as one
    contiguous 16-byte-vectorised tile. Element pair i shares the scale of block i // 8.
    ASM: ``sc_ptr`` is the scale tensor viewed as int64 (one per row of 8 block scales,
    strides in int64 units) and the decode is ``_NVFP4_DECODE_ASM``.
    """
    i = tl.arange(0, DIM // 2)[None, :]
    packed = tl.load(ptr + slots[:, None].to(tl.int64) * stride_t + head * stride_h + i, mask=live, other=0)
    if ASM:
        sc_row = tl.load(sc_ptr + slots[:, None].to(tl.int64) * stride_st + head * stride_sh, mask=live, other=0)
        sel = (i // 8).to(tl.int32)  # byte i's block scale is byte i // 8 of the row's int64
        lo, hi = tl.inline_asm_elementwise(
            _NVFP4_DECODE_ASM,
            "=r,=r,=r,=r,r,l,l,l,l,r,r,r,r",
            [packed, sc_row, sel],
            dtype=(tl.float16, tl.float16),
            is_pure=True,
            pack=4,
        )
        return lo, hi
    packed = packed.to(tl.int16)
    sc = tl.load(sc_ptr + slots[:, None].to(tl.int64) * stride_st + head * stride_sh + i // 8, mask=live, other=0.0).to(
        tl.float16
    )
    # fp16(m << 9) = e2m1(m) * 2^-14 (see _load_page); sign bit 3 -> bit 15
    lo = (((packed & 7) << 9) | ((packed & 8) << 12)).to(tl.float16, bitcast=True)
    hi = (((packed & 0x70) << 5) | ((packed & 0x80) << 8)).to(tl.float16, bitcast=True)
    return lo * sc, hi * sc


@triton.jit
def _merge_partials(
    o_part_ptr,
    lse_ptr,
    out_ptr,
    r,
    heads,
    h_ok,
    v_scale,
    stride_os,
    stride_or,
    stride_oh,
    stride_ls,
    stride_lr,
    stride_r,
    stride_h,
    NS: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    """out[r, heads] = sum_s w_s o_s / sum_s w_s with w_s = 2^(lse_s - max lse): the NS split partials."""
    r64 = r.to(tl.int64)
    sp = tl.arange(0, NS)
    # .cg: the partials were written by other programs (other SMs); read them from L2
    lse = tl.load(
        lse_ptr + sp[:, None] * stride_ls + r64 * stride_lr + heads[None, :],
        mask=h_ok[None, :],
        other=float("-inf"),
        cache_modifier=".cg",
    )  # [NS, BLOCK_G], base 2
    mx = tl.max(lse, axis=0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    wsum = tl.sum(tl.where(lse == float("-inf"), 0.0, tl.math.exp2(lse - mx[None, :])), axis=0)
    dv = tl.arange(0, DV)[None, :]
    acc = tl.zeros((BLOCK_G, DV), tl.float32)
    for s in tl.static_range(NS):  # unrolled: the NS loads are independent and go out together
        ls = tl.load(
            lse_ptr + s * stride_ls + r64 * stride_lr + heads, mask=h_ok, other=float("-inf"), cache_modifier=".cg"
        )
        w = tl.where(ls == float("-inf"), 0.0, tl.math.exp2(ls - mx))
        o = tl.load(
            o_part_ptr + s * stride_os + r64 * stride_or + heads[:, None] * stride_oh + dv,
            mask=h_ok[:, None],
            other=0.0,
            cache_modifier=".cg",
        )
        acc += o * w[:, None]
    o = acc / tl.maximum(wsum, 1e-30)[:, None] * v_scale
    tl.store(
        out_ptr + r64 * stride_r + heads[:, None] * stride_h + dv, o.to(out_ptr.dtype.element_ty), mask=h_ok[:, None]
    )


@triton.jit
def _msa_attn_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    pt_ptr,
    row_req_ptr,
    row_pos_ptr,
    bid_ptr,
    o_ptr,
    lse_ptr,
    out_ptr,
    cnt_ptr,
    qk_scale,
    v_scale,
    stride_qr,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kst,
    stride_ksh,
    stride_vst,
    stride_vsh,
    stride_ptr,
    stride_br,
    stride_bh,
    stride_os,
    stride_or,
    stride_oh,
    stride_ls,
    stride_lr,
    stride_out_r,
    stride_out_h,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BS: tl.constexpr,
    MODE: tl.constexpr,
    SPARSE: tl.constexpr,
    TOPK: tl.constexpr,
    NS: tl.constexpr,
    F32: tl.constexpr,
    EO: tl.constexpr,
    ASM: tl.constexpr,
    FUSE_MERGE: tl.constexpr,
    PDL: tl.constexpr,
):
    r = tl.program_id(0)
    g = tl.program_id(1)
    split = tl.program_id(2)
    # compute dtype of the dots: fp32 (IEEE) for fp32 q; fp16 for FP8 and NVFP4 pages (sm_90
    # converts e4m3x2 -> f16x2 in one instruction but has no direct e4m3 -> bf16, and NVFP4
    # decodes natively to fp16; bf16 q converts to fp16 exactly for |q| in [2^-14, 65504],
    # which normed q always is); bf16 otherwise
    CDT: tl.constexpr = tl.float32 if F32 else (tl.float16 if MODE != 0 else tl.bfloat16)
    hg = tl.arange(0, BLOCK_G)
    heads = g * G + hg
    h_ok = hg < G
    j = tl.arange(0, BS)
    req = tl.load(row_req_ptr + r).to(tl.int64)
    pos = tl.load(row_pos_ptr + r).to(tl.int64)
    q_blk = pos // BS
    # -- the group's query heads: [BLOCK_G, D] ------------------------------------------
    q_row = q_ptr + r.to(tl.int64) * stride_qr + heads[:, None] * stride_qh
    if EO:  # NVFP4 even/odd split: q's even and odd columns, [BLOCK_G, D // 2] each
        q_e = tl.load(q_row + 2 * tl.arange(0, D // 2)[None, :], mask=h_ok[:, None], other=0.0).to(CDT)
        q_o = tl.load(q_row + 2 * tl.arange(0, D // 2)[None, :] + 1, mask=h_ok[:, None], other=0.0).to(CDT)
        acc_e = tl.zeros((BLOCK_G, DV // 2), tl.float32)
        acc_o = tl.zeros((BLOCK_G, DV // 2), tl.float32)
    else:
        q = tl.load(q_row + tl.arange(0, D)[None, :], mask=h_ok[:, None], other=0.0).to(CDT)
        acc = tl.zeros((BLOCK_G, DV), tl.float32)
    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    # q, row_req and row_pos were read above, before the programmatic-launch wait: they
    # must not be written by the kernel launched just before this one (msa_topk never does)
    gdc_wait(PDL)  # block ids (and the pages) may come from the previous kernel
    if SPARSE:
        n_iter = tl.cdiv(TOPK - split, NS)
    else:
        n_iter = tl.cdiv(q_blk + 1 - split, NS)
    for it in range(n_iter):
        i = split + it * NS
        if SPARSE:
            blk = tl.load(bid_ptr + r.to(tl.int64) * stride_br + g * stride_bh + i).to(tl.int64)
        else:
            blk = i.to(tl.int64)
        live = (blk >= 0) & (blk <= q_blk)
        page = tl.load(pt_ptr + req * stride_ptr + blk, mask=live, other=0).to(tl.int64)
        slots = page * BS + j
        # -- load + dequantise K and V together (one DRAM round trip, not two), scores in base 2
        if EO:
            k_lo, k_hi = _load_nvfp4_halves(
                k_ptr, ks_ptr, slots, g, stride_kt, stride_kh, stride_kst, stride_ksh, live, D, ASM
            )
            v_lo, v_hi = _load_nvfp4_halves(
                v_ptr, vs_ptr, slots, g, stride_vt, stride_vh, stride_vst, stride_vsh, live, DV, ASM
            )
            s = (tl.dot(q_e, tl.trans(k_lo)) + tl.dot(q_o, tl.trans(k_hi))) * qk_scale
        else:
            k = _load_page(k_ptr, ks_ptr, slots, g, stride_kt, stride_kh, stride_kst, stride_ksh, live, D, MODE, CDT)
            v = _load_page(v_ptr, vs_ptr, slots, g, stride_vt, stride_vh, stride_vst, stride_vsh, live, DV, MODE, CDT)
            if F32:
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
            else:
                s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(((blk * BS + j) <= pos)[None, :] & live, s, float("-inf"))  # token-causal
        # -- online softmax update ----------------------------------------------------------
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if EO:
            acc_e = acc_e * alpha[:, None] + tl.dot(p.to(CDT), v_lo)
            acc_o = acc_o * alpha[:, None] + tl.dot(p.to(CDT), v_hi)
        elif F32:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(CDT), v)
        m_i = m_new
    gdc_launch_dependents(PDL)
    # -- normalise; NS == 1 writes the final output, else (o, lse) partials --------------
    inv_l = 1.0 / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_base = o_ptr + split * stride_os + r.to(tl.int64) * stride_or + heads[:, None] * stride_oh
    out_scale = v_scale if NS == 1 else 1.0
    if EO:
        dv2 = 2 * tl.arange(0, DV // 2)[None, :]
        tl.store(o_base + dv2, (acc_e * inv_l * out_scale).to(o_ptr.dtype.element_ty), mask=h_ok[:, None])
        tl.store(o_base + dv2 + 1, (acc_o * inv_l * out_scale).to(o_ptr.dtype.element_ty), mask=h_ok[:, None])
    else:
        o_off = tl.arange(0, DV)[None, :]
        tl.store(o_base + o_off, (acc * inv_l * out_scale).to(o_ptr.dtype.element_ty), mask=h_ok[:, None])
    if NS > 1:
        lse = tl.where(l_i > 0, m_i + tl.math.log2(l_i), float("-inf"))
        tl.store(lse_ptr + split * stride_ls + r.to(tl.int64) * stride_lr + heads, lse, mask=h_ok)
        if FUSE_MERGE:
            # -- the last of the NS splits of (r, g) to finish merges them ----------------
            tl.debug_barrier()  # every thread's partial stores precede the release below
            cnt = cnt_ptr + r * tl.num_programs(1) + g
            ticket = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
            if ticket == NS - 1:
                _merge_partials(
                    o_ptr,
                    lse_ptr,
                    out_ptr,
                    r,
                    heads,
                    h_ok,
                    v_scale,
                    stride_os,
                    stride_or,
                    stride_oh,
                    stride_ls,
                    stride_lr,
                    stride_out_r,
                    stride_out_h,
                    NS,
                    DV,
                    BLOCK_G,
                )
                tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")  # zero for the next launch


@triton.jit
def _merge_kernel(
    o_part_ptr,
    lse_ptr,
    out_ptr,
    v_scale,
    stride_os,
    stride_or,
    stride_oh,
    stride_ls,
    stride_lr,
    stride_r,
    stride_h,
    NS: tl.constexpr,
    DV: tl.constexpr,
    CH: tl.constexpr,
    PDL: tl.constexpr,
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    lse_row = lse_ptr + r.to(tl.int64) * stride_lr + h
    o_row = o_part_ptr + r.to(tl.int64) * stride_or + h * stride_oh
    gdc_wait(PDL)
    lse = tl.load(lse_row + tl.arange(0, NS) * stride_ls)  # [NS], base 2
    mx = tl.max(lse)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    wsum = tl.sum(tl.where(lse == float("-inf"), 0.0, tl.math.exp2(lse - mx)))
    o = tl.zeros((DV,), tl.float32)
    for c in tl.static_range(NS // CH):  # CH partials at a time: a [NS, DV] tile would spill
        sp = c * CH + tl.arange(0, CH)
        ls = tl.load(lse_row + sp * stride_ls)
        w = tl.where(ls == float("-inf"), 0.0, tl.math.exp2(ls - mx))
        part = tl.load(o_row + sp[:, None] * stride_os + tl.arange(0, DV)[None, :])
        o += tl.sum(part * w[:, None], axis=0)
    o = o / tl.maximum(wsum, 1e-30)
    tl.store(
        out_ptr + r.to(tl.int64) * stride_r + h * stride_h + tl.arange(0, DV),
        (o * v_scale).to(out_ptr.dtype.element_ty),
    )
