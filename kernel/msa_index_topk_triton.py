"""Triton bodies of ``msa_index_topk`` (launcher, reference and settings live there).

One launch for decode, two for verify / prefill; CUDA-graph safe (grids from tensor shapes
only, no host sync):

1. ``_block_score_kernel``: grid (row tiles, page chunks). A tile is BLOCK_R consecutive query
   rows; the rows of one request inside a tile form a *segment* that reads each index-K page of
   that request ONCE and scores it for all its rows and heads with one ``tl.dot``
   ([BLOCK_R * H, D] x [D, block]); a tile spanning several requests loops over its segments.
   Verify (1 + K rows per request) and prefill thus scan the history once per tile instead of
   once per row. The grid is one wave of programs shared among the tiles (``score_programs``),
   and a tile's ``G`` programs take its pages strided (program ``c``: pages ``c, c + G, ...``)
   up to the tile's own last block, so however wide the page table is (it is sized for the
   longest context, 1M tokens for M3), the pages a row actually has spread over all its
   programs and no program waits for a page past them. A program loads its page ids a chunk
   at a time, before the loop over that chunk, so the loads of its index-K pages depend on no
   other load and Triton's pipeliner can keep ``num_stages - 1`` of them in flight.
   Output: causal block max ``[R, H, max_pages]`` fp32;
   columns past a row's own block are never written and never read.
2. Selection: force the local blocks to +inf and extract the top-k under the total order
   (score desc, block asc), so the result equals ``msa_topk_ref`` slot for slot; exhausted
   slots (-inf) are -1. The row's blocks stream through registers CHUNK at a time, only up to
   the row's own block (a loop bound read from ``row_pos``, so a page table sized for a 1M
   context costs a short row nothing): each chunk's top-k of packed (score, block) int64 keys
   (bitonic ``tl.topk``) is merged with the running top-k by one more ``tl.topk`` over both.

   * fused (``FUSE``, small tiles): every score program takes a ticket on its tile's counter
     after writing its block maxima; the program that draws the last ticket selects for all
     rows x heads of the tile (one 2-D top-k per chunk) and resets the counter to 0 for the
     next launch. Saves the second launch.
   * else ``_topk_select_kernel``: grid (R, H), one (row, head) per program.

Programmatic dependent launch as in ``msa_sparse_attn`` (``pdl.py``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .pdl import gdc_launch_dependents, gdc_wait


@triton.jit
def _select_rows(
    score_ptr,
    out_ptr,
    row,
    head,
    pos,
    ok,
    stride_sr,
    stride_sh,
    stride_or,
    stride_oh,
    M: tl.constexpr,
    BS: tl.constexpr,
    TOPK: tl.constexpr,
    LOCAL: tl.constexpr,
    CHUNK: tl.constexpr,
    K2: tl.constexpr,
):
    """Top-k of ``M`` (row, head) score rows at once (``row``/``head``/``pos``/``ok``: ``[M]``).

    key = (order-preserving score bits << 31) | (2^31 - 1 - block): descending keys are
    (score desc, block asc), exactly the reference order, and distinct. Absent blocks get -1.
    The rows' blocks go through in chunks of CHUNK, up to the longest row's own block.
    """
    q_blk = (pos // BS)[:, None]
    nb = q_blk + 1  # blocks 0..q_blk exist for this row
    r64 = row.to(tl.int64)[:, None]
    s_base = score_ptr + r64 * stride_sr + head[:, None] * stride_sh
    t = tl.arange(0, K2)[None, :]
    top = tl.zeros([M, K2], dtype=tl.int64) - 1
    n_chunks = tl.cdiv(tl.max(tl.where(ok, pos // BS + 1, 0)), CHUNK)
    for c in range(0, n_chunks):
        b = c * CHUNK + tl.arange(0, CHUNK)[None, :]
        # .cg: the block maxima were written by other programs (other SMs): read them from L2
        s = tl.load(s_base + b, mask=ok[:, None] & (b < nb), other=float("-inf"), cache_modifier=".cg")
        s = tl.where((b <= q_blk) & (b > q_blk - LOCAL), float("inf"), s)  # force local blocks
        bits = s.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
        # float -> uint32 monotone: flip all bits of negatives, the sign bit of the rest
        ukey = tl.where(bits >= 0x80000000, bits ^ 0xFFFFFFFF, bits ^ 0x80000000)
        key = tl.where(b < nb, (ukey << 31) | (2147483647 - b), -1)
        best = tl.topk(key, K2)  # [M, K2], descending
        top = tl.topk(tl.reshape(tl.join(top, best), [M, 2 * K2]), K2)
    blk = 2147483647 - (top & 2147483647)
    # score <= -inf (ukey <= ukey(-inf) = 0x7FFFFF) or absent: the slot is empty
    blk = tl.where((top < 0) | ((top >> 31) <= 0x7FFFFF), -1, blk)
    tl.store(out_ptr + r64 * stride_or + head[:, None] * stride_oh + t, blk.to(tl.int32), mask=ok[:, None] & (t < TOPK))


@triton.jit
def _fused_select(
    cnt_ptr,
    tile,
    score_ptr,
    out_ptr,
    row_pos_ptr,
    R,
    stride_sr,
    stride_sh,
    stride_or,
    stride_oh,
    H: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SEL_M: tl.constexpr,
    TOPK: tl.constexpr,
    LOCAL: tl.constexpr,
    CHUNK: tl.constexpr,
    K2: tl.constexpr,
):
    """Called by every score program of ``tile`` once its maxima are stored; the last one selects."""
    tl.debug_barrier()  # every thread's score stores precede the release below
    ticket = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if ticket == tl.num_programs(1) - 1:
        ms = tl.arange(0, SEL_M)
        row = tile * BLOCK_R + ms // H
        ok = (ms < BLOCK_R * H) & (row < R)
        pos = tl.load(row_pos_ptr + row, mask=ok, other=0).to(tl.int64)
        _select_rows(
            score_ptr,
            out_ptr,
            row,
            ms % H,
            pos,
            ok,
            stride_sr,
            stride_sh,
            stride_or,
            stride_oh,
            SEL_M,
            BS,
            TOPK,
            LOCAL,
            CHUNK,
            K2,
        )
        tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")  # zero for the next launch


@triton.jit
def _block_score_kernel(
    q_ptr,
    k_ptr,
    pt_ptr,
    row_req_ptr,
    row_pos_ptr,
    score_ptr,
    out_ptr,
    cnt_ptr,
    k_scale,
    R,
    stride_qr,
    stride_qh,
    stride_kt,
    stride_ptr,
    stride_sr,
    stride_sh,
    stride_or,
    stride_oh,
    H: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    IDS: tl.constexpr,
    Q_FP32: tl.constexpr,
    K_FP8: tl.constexpr,
    FUSE: tl.constexpr,
    SEL_M: tl.constexpr,
    TOPK: tl.constexpr,
    LOCAL: tl.constexpr,
    CHUNK: tl.constexpr,
    K2: tl.constexpr,
    PDL: tl.constexpr,
):
    tile = tl.program_id(0)
    first_page = tl.program_id(1)  # this program's pages: first_page, first_page + stride, ...
    page_stride = tl.num_programs(1)
    # -- rows of this tile: m -> (row = tile * BLOCK_R + m // H, head = m % H) ----------
    m = tl.arange(0, BLOCK_M)
    row = tile * BLOCK_R + m // H
    head = m % H
    row_ok = (m < BLOCK_R * H) & (row < R)
    d = tl.arange(0, D)
    j = tl.arange(0, BS)
    pp = tl.arange(0, IDS)
    gdc_wait(PDL)  # everything below may read what the previous kernel wrote
    req = tl.load(row_req_ptr + row, mask=row_ok, other=0).to(tl.int64)
    pos = tl.load(row_pos_ptr + row, mask=row_ok, other=-1).to(tl.int64)
    q = tl.load(
        q_ptr + row[:, None].to(tl.int64) * stride_qr + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    # dot dtype: fp32 (IEEE) for fp32 q; fp16 for an FP8 cache (sm_90 widens e4m3x2 ->
    # f16x2 in one instruction, but has no direct e4m3 -> bf16; normed q converts to fp16
    # exactly); bf16 for a bf16 cache
    CDT: tl.constexpr = tl.float32 if Q_FP32 else (tl.float16 if K_FP8 else tl.bfloat16)
    q = q.to(CDT)
    done = ~row_ok
    # -- one segment (= one request) per trip; usually a single trip --------------------
    while tl.sum((~done).to(tl.int32)) > 0:
        leader = tl.min(tl.where(done, 9223372036854775807, req))
        seg = (req == leader) & ~done
        last_blk = tl.max(tl.where(seg, pos, -1)) // BS
        # this program's pages up to the segment's last block, IDS at a time: each chunk's ids
        # loaded before its loop, so the loop's index-K loads depend on no other load
        n = tl.maximum(tl.cdiv(last_blk + 1 - first_page, page_stride), 0).to(tl.int32)
        for base in range(0, n, IDS):
            pids = tl.load(
                pt_ptr + leader * stride_ptr + first_page + (base + pp) * page_stride, mask=base + pp < n, other=0
            )
            for i in range(0, tl.minimum(n - base, IDS)):
                b = first_page + (base + i) * page_stride
                page = tl.sum(tl.where(pp == i, pids, 0)).to(tl.int64)
                # -- one index-K page [BS, D]; fp8 widens exactly to fp16 / fp32 ----------
                kt = tl.load(k_ptr + (page * BS + j)[:, None] * stride_kt + d[None, :]).to(CDT)
                if Q_FP32:
                    s = tl.dot(q, tl.trans(kt), input_precision="ieee")  # [BLOCK_M, BS]
                else:
                    s = tl.dot(q, tl.trans(kt))
                # -- token-causal mask, then block max-pool ------------------------------
                s = tl.where((b * BS + j)[None, :] <= pos[:, None], s, float("-inf"))
                bmax = tl.max(s, axis=1) * k_scale  # k_scale > 0 commutes with max
                tl.store(score_ptr + row.to(tl.int64) * stride_sr + head * stride_sh + b, bmax, mask=seg)
        done = done | seg
    gdc_launch_dependents(PDL)
    if FUSE:
        _fused_select(
            cnt_ptr,
            tile,
            score_ptr,
            out_ptr,
            row_pos_ptr,
            R,
            stride_sr,
            stride_sh,
            stride_or,
            stride_oh,
            H,
            BS,
            BLOCK_R,
            SEL_M,
            TOPK,
            LOCAL,
            CHUNK,
            K2,
        )


@triton.jit
def _topk_select_kernel(
    score_ptr,
    row_pos_ptr,
    out_ptr,
    stride_sr,
    stride_sh,
    stride_or,
    stride_oh,
    BS: tl.constexpr,
    TOPK: tl.constexpr,
    LOCAL: tl.constexpr,
    CHUNK: tl.constexpr,
    K2: tl.constexpr,
    PDL: tl.constexpr = False,
):
    one = tl.full([1], 0, tl.int32)
    gdc_wait(PDL)
    pos = tl.load(row_pos_ptr + tl.program_id(0) + one).to(tl.int64)
    _select_rows(
        score_ptr,
        out_ptr,
        one + tl.program_id(0),
        one + tl.program_id(1),
        pos,
        one == 0,
        stride_sr,
        stride_sh,
        stride_or,
        stride_oh,
        1,
        BS,
        TOPK,
        LOCAL,
        CHUNK,
        K2,
    )
