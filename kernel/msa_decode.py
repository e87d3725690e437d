"""MSA decode in one launch: indexer scores, top-k selection and sparse attention together.

Same result as ``msa_topk`` followed by ``msa_attention`` (reference: :func:`msa_decode_ref`).
Meant for small decode batches, where the two-step path is bound by launch gaps and by the
dependent DRAM round trips at the start of every kernel, not by bandwidth (H200: 15-27 us at
batch 1 for 0.7-8 us of bytes; ``benchmarks/kernels.md``).

One persistent grid of ``R * chunks`` score programs and ``R * Hkv * NS`` attention programs.
Each program draws a ticket from a global counter at start, and the ticket, not its program
id, says what it does: tickets below ``R * chunks`` score a chunk of pages of one row (as
``msa_topk``'s score kernel); the last score program of a row selects its top-k blocks
(as ``msa_topk``'s fused select) and then raises the row's flag. Higher tickets are
attention splits (as ``msa_attention``): they load the row's q, spin on the flag, then attend
over the selected pages; the last split of a (row, group) merges the partials.

Why it cannot deadlock: a spinning program holds a ticket above every score ticket, so every
score program has already started (it drew its ticket first) and none of them ever waits.
Counters: every counter and flag is back at 0 when the launch ends (the program that draws
the last ticket of each counter resets it), so one cached buffer serves every launch and
every CUDA-graph replay (``paged.counters``). Ordering: stores before a release are fenced by
a CTA barrier, then an ``acq_rel``/``release`` atomic at GPU scope; readers acquire and read
the other programs' data through L2 (``.cg``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .msa_index_topk import _check_rows, _score_row_pages, _select_rows, msa_topk_ref
from .msa_sparse_attn import (
    _attn_split,
    _gdc_launch_dependents,
    _gdc_wait,
    _last_split_merges,
    _plan_attention,
    _use_pdl,
    msa_attention_ref,
)
from .paged import counters

# Knobs for the sweep script (benchmarks/sweep_decode.py); see msa_decode's docstring.
_WARPS = 4
_SPLIT_CTAS = 264  # attention splits: grow NS while R * Hkv * NS is below this
_MAX_SCORE_PROGRAMS = 512  # pages per score program double while the score grid exceeds this
_MAX_SPLITS = 16  # attention splits per (row, group) at most
_SPIN = 2  # attention programs wait on their row's flag: 1 acquire RMWs, 2 volatile loads + one acquire
# Use the one launch up to this many decode rows (measured on the H200, benchmarks/kernels.md);
# past it the two-step path is as fast and its kernels each keep their own launch shape.
ONE_LAUNCH_MAX_ROWS = 64


def one_launch_decode(num_rows: int, max_pages: int) -> bool:
    """Whether :func:`msa_decode` serves a decode batch of this shape (else msa_topk + msa_attention)."""
    return 0 < num_rows <= ONE_LAUNCH_MAX_ROWS and max_pages <= 4096


def msa_decode_ref(
    index_q, index_k_cache, q, k_cache, v_cache, page_table, row_req, row_pos, *, block_size, topk, local_blocks, scale
):
    """``(out [R, Hq, Dv], block_ids [R, Hkv, topk])``: msa_topk_ref, then msa_attention_ref (fp32, dequantised)."""
    ids = msa_topk_ref(
        index_q,
        index_k_cache,
        page_table,
        row_req,
        row_pos,
        block_size=block_size,
        topk=topk,
        local_blocks=local_blocks,
    )
    out = msa_attention_ref(q, k_cache, v_cache, page_table, row_req, row_pos, ids, block_size=block_size, scale=scale)
    return out, ids


@triton.jit
def _msa_decode_kernel(
    # -- indexer ---------------------------------------------------------------------
    iq_ptr,
    ik_ptr,
    score_ptr,
    ik_scale,
    stride_iqr,
    stride_iqh,
    stride_ikt,
    stride_sr,
    stride_sh,
    # -- attention (msa_sparse_attn._AttnPlan order) ------------------------------------
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
    R,
    CHUNKS,
    # -- constexprs ----------------------------------------------------------------------
    IDX_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    PAGES: tl.constexpr,
    FMA: tl.constexpr,
    IQ_FP32: tl.constexpr,
    IK_FP8: tl.constexpr,
    SEL_M: tl.constexpr,
    LOCAL: tl.constexpr,
    CHUNK: tl.constexpr,
    K2: tl.constexpr,
    HKV: tl.constexpr,
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
    PDL: tl.constexpr,
    SPIN: tl.constexpr,
):
    # counters, each kind in its own 128-byte lines (RP = R rounded up to 32): [0] tickets |
    # [32, +R) select | [32 + RP, +R) row flags | [32 + 2 RP, +R) rows done | [32 + 3 RP, +R*HKV)
    # merges per (row, group)
    RP = (R + 31) // 32 * 32
    sel_cnt = cnt_ptr + 32
    flags = cnt_ptr + 32 + RP
    row_done = cnt_ptr + 32 + 2 * RP
    merge_cnt = cnt_ptr + 32 + 3 * RP
    n_score = R * CHUNKS
    total = n_score + R * HKV * NS
    _gdc_wait(PDL)  # everything below may read what the previous kernel wrote
    t = tl.atomic_add(cnt_ptr, 1, sem="relaxed", scope="gpu")
    if t == total - 1:
        tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")  # every ticket is drawn: zero for the next launch
    if t < n_score:
        # ---------------------------------------------------------------- score a chunk
        r = t // CHUNKS
        req = tl.load(row_req_ptr + r).to(tl.int64)
        pos = tl.load(row_pos_ptr + r).to(tl.int64)
        _score_row_pages(
            iq_ptr,
            ik_ptr,
            pt_ptr,
            score_ptr,
            r,
            req,
            pos,
            (t % CHUNKS) * PAGES,
            ik_scale,
            stride_iqr,
            stride_iqh,
            stride_ikt,
            stride_ptr,
            stride_sr,
            stride_sh,
            HKV,
            IDX_D,
            BS,
            BLOCK_M,
            PAGES,
            IQ_FP32,
            IK_FP8,
            FMA,
        )
        _gdc_launch_dependents(PDL)
        tl.debug_barrier()  # every thread's score stores precede the release below
        if tl.atomic_add(sel_cnt + r, 1, sem="acq_rel", scope="gpu") == CHUNKS - 1:
            # ------------------------------------------- last chunk of the row: select
            ms = tl.arange(0, SEL_M)
            ok = ms < HKV
            _select_rows(
                score_ptr,
                bid_ptr,
                tl.zeros_like(ms) + r,
                ms,
                tl.zeros_like(ms).to(tl.int64) + pos,
                ok,
                stride_sr,
                stride_sh,
                stride_br,
                stride_bh,
                BS,
                TOPK,
                LOCAL,
                CHUNK,
                K2,
            )
            tl.atomic_xchg(sel_cnt + r, 0, sem="relaxed", scope="gpu")
            tl.debug_barrier()  # the block ids precede the flag
            tl.atomic_xchg(flags + r, 1, sem="release", scope="gpu")
    else:
        # ---------------------------------------------------------------- attention split
        a = t - n_score
        r = a // (HKV * NS)
        g = (a // NS) % HKV
        _attn_split(
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
            flags + r,
            r,
            g,
            a % NS,
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
            G,
            BLOCK_G,
            D,
            DV,
            BS,
            MODE,
            SPARSE,
            TOPK,
            NS,
            F32,
            EO,
            ASM,
            PDL,
            SPIN,
        )
        group_done = True
        if NS > 1:
            group_done = _last_split_merges(
                merge_cnt + r * HKV + g,
                o_ptr,
                lse_ptr,
                out_ptr,
                r,
                g,
                v_scale,
                stride_os,
                stride_or,
                stride_oh,
                stride_ls,
                stride_lr,
                stride_out_r,
                stride_out_h,
                G,
                BLOCK_G,
                NS,
                DV,
            )
        if group_done:
            # every split of this group is past its wait; the last group lowers the row's flag
            if tl.atomic_add(row_done + r, 1, sem="relaxed", scope="gpu") == HKV - 1:
                tl.atomic_xchg(row_done + r, 0, sem="relaxed", scope="gpu")
                tl.atomic_xchg(flags + r, 0, sem="relaxed", scope="gpu")


def msa_decode(
    index_q: torch.Tensor,
    index_k_cache: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    row_req: torch.Tensor,
    row_pos: torch.Tensor,
    *,
    block_size: int,
    topk: int,
    local_blocks: int,
    scale: float,
    index_k_scale: float = 1.0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    block_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Indexer + top-k + sparse attention in one launch; ``(out, block_ids)`` as :func:`msa_decode_ref`.

    Arguments as ``msa_topk`` (``index_q``, ``index_k_cache``, ``index_k_scale``) and
    ``msa_attention`` (the rest). Index heads must equal KV heads (one selection per KV
    group), and a row's blocks must fit one in-register sort (``max_pages <= 4096``).
    Each row is scored on its own: meant for decode (one row per request), where rows do
    not share an index-K history.
    """
    R, H, IDX_D = index_q.shape
    _check_rows("msa_decode", page_table, row_req, row_pos, R)
    hkv = k_cache.shape[1] if k_cache.dim() == 3 else -1
    if H != hkv:
        raise ValueError(f"msa_decode: index heads ({H}) must equal KV heads ({hkv})")
    if index_k_cache.dim() != 2 or index_k_cache.shape[1] != IDX_D or index_k_cache.stride(1) != 1:
        raise ValueError(f"index_k_cache must be [slots, {IDX_D}] contiguous, got {tuple(index_k_cache.shape)}")
    if IDX_D < 16 or IDX_D & (IDX_D - 1) or index_q.stride(2) != 1:
        raise ValueError(f"index head dim must be a power of two >= 16 and contiguous, got {IDX_D}")
    if not index_k_scale > 0:
        raise ValueError(f"index_k_scale must be > 0, got {index_k_scale}")
    max_pages = page_table.shape[1]
    if max_pages > 4096:
        raise ValueError(f"msa_decode: rows of up to 4096 blocks (one sort), page_table has {max_pages}")
    if block_ids is None:
        block_ids = torch.empty((R, H, topk), dtype=torch.int32, device=q.device)
    elif block_ids.shape != (R, H, topk) or block_ids.dtype != torch.int32 or block_ids.stride(2) != 1:
        raise ValueError(f"block_ids must be [{R}, {H}, {topk}] int32, got {tuple(block_ids.shape)} {block_ids.dtype}")
    plan = _plan_attention(
        q, k_cache, v_cache, page_table, row_req, row_pos, block_ids, block_size, scale, k_scale, v_scale,
        k_scales, v_scales, out, max_ctas=_SPLIT_CTAS,
        max_splits=min(_MAX_SPLITS, triton.next_power_of_2(topk)),
    )  # fmt: skip
    if R == 0:
        return plan.out, block_ids
    scores = torch.empty((R, H, max_pages), dtype=torch.float32, device=q.device)
    pages = 1
    while pages < 8 and R * -(-max_pages // pages) > _MAX_SCORE_PROGRAMS:
        pages *= 2
    chunks = -(-max_pages // pages)
    ns = plan.consts["NS"]
    cnt = counters(q.device, "msa_decode", 32 + 3 * (-(-R // 32) * 32) + R * H)
    k2 = triton.next_power_of_2(topk)
    pdl = _use_pdl(q.device)
    ik_fp8 = index_k_cache.dtype == torch.float8_e4m3fn
    _msa_decode_kernel[(R * chunks + R * H * ns,)](
        index_q,
        index_k_cache,
        scores,
        float(index_k_scale),
        index_q.stride(0),
        index_q.stride(1),
        index_k_cache.stride(0),
        scores.stride(0),
        scores.stride(1),
        *plan.tensors,
        plan.out,
        cnt,
        *plan.scalars,
        *plan.strides,
        *plan.out_strides,
        R,
        chunks,
        IDX_D=IDX_D,
        BLOCK_M=max(16, triton.next_power_of_2(H)),
        PAGES=pages,
        FMA=H == 1 and ik_fp8,  # as msa_topk: CUDA-core FMAs for one FP8 index head
        IQ_FP32=index_q.dtype == torch.float32,
        IK_FP8=ik_fp8,
        SEL_M=triton.next_power_of_2(H),
        LOCAL=local_blocks,
        CHUNK=max(triton.next_power_of_2(max_pages), k2),
        K2=k2,
        HKV=H,
        **plan.consts,
        PDL=pdl,
        SPIN=_SPIN,
        num_warps=8 if plan.consts["F32"] else _WARPS,
        **(dict(launch_pdl=True) if pdl else {}),
    )
    return plan.out, block_ids
