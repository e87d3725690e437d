"""MSA lightning-indexer block selection (MiniMax-M3 sparse attention, step 1).

For every query row at absolute position ``p`` and every index head ``h``
(index head == KV head == GQA group; see DESIGN section 5):

1. ``s[h, j] = index_q[h] . index_k[j]`` in fp32 (no scale, no ReLU); keys
   ``j > p`` score ``-inf``.
2. ``B[h, b] = max_{j in block b} s[h, j]`` over ``block_size`` keys.
3. The ``local_blocks`` blocks ending at the row's own block ``p // block_size``
   are forced to ``+inf`` so they win slots inside the top-k.
4. Keep ``min(topk, #blocks)`` blocks per head, ordered by (score desc, block
   id asc) so eager and graph runs agree; slots that fall on future blocks are
   ``-1`` and every row's output is right-padded with ``-1`` to ``topk``.

Per-head (per KV group) selection is what MiniMax's MSA paper, SGLang, vLLM and
TensorRT-LLM implement; transformers 5.12.1 shares one selection across heads
(see ``msa_topk_shared_ref`` used by the parity tests).

Cache layout: see ``paged.py``. ``index_k_cache`` is ``[slots, index_dim]``
(one shared index-K head); quantised pools pass their dequantised view here.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .paged import request_slots, rows_by_request


def msa_block_scores_ref(
    index_q: torch.Tensor,
    index_k_cache: torch.Tensor,
    page_table: torch.Tensor,
    row_req: torch.Tensor,
    row_pos: torch.Tensor,
    *,
    block_size: int,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per request: ``(row_ids [r], block_scores [r, H, num_blocks] fp32)``.

    ``num_blocks`` covers keys ``0..max(row_pos)`` of the request.
    """
    out = []
    for req, rows in rows_by_request(row_req):
        pos = row_pos[rows].long()  # [r]
        length = int(pos.max()) + 1
        keys = index_k_cache[request_slots(page_table[req], length, block_size)].float()  # [L, D]
        scores = torch.einsum("rhd,ld->rhl", index_q[rows].float(), keys)  # [r, H, L]
        key_pos = torch.arange(length, device=scores.device)
        scores = scores.masked_fill(key_pos[None, None, :] > pos[:, None, None], float("-inf"))
        num_blocks = -(-length // block_size)
        scores = F.pad(scores, (0, num_blocks * block_size - length), value=float("-inf"))
        out.append((rows, scores.view(len(rows), scores.shape[1], num_blocks, block_size).amax(-1)))
    return out


def _select(block_scores: torch.Tensor, pos: torch.Tensor, *, block_size: int, topk: int, local_blocks: int):
    """Force local blocks, then top-k by (score desc, block asc); ``[r, H, topk]`` int32."""
    r, heads, num_blocks = block_scores.shape
    block_scores = block_scores.clone()
    q_block = pos // block_size  # [r]
    for i in range(local_blocks):
        local = (q_block - i).clamp(min=0).view(r, 1, 1).expand(r, heads, 1)
        block_scores.scatter_(-1, local, float("inf"))
    # A stable descending sort keeps equal scores in ascending block order.
    scores, order = torch.sort(block_scores, dim=-1, descending=True, stable=True)
    k = min(topk, num_blocks)
    chosen = order[..., :k].masked_fill(scores[..., :k] == float("-inf"), -1)
    out = torch.full((r, heads, topk), -1, dtype=torch.int32, device=block_scores.device)
    out[..., :k] = chosen.to(torch.int32)
    return out


def msa_topk_ref(
    index_q: torch.Tensor,
    index_k_cache: torch.Tensor,
    page_table: torch.Tensor,
    row_req: torch.Tensor,
    row_pos: torch.Tensor,
    *,
    block_size: int,
    topk: int,
    local_blocks: int,
) -> torch.Tensor:
    """Per-group block selection.

    Parameters
    ----------
    index_q : ``[R, H, D]`` float, one index head per KV group.
    index_k_cache : ``[slots, D]`` float (dequantised view).
    page_table : ``[num_reqs, max_pages]`` int.
    row_req, row_pos : ``[R]`` int.

    Returns
    -------
    ``[R, H, topk]`` int32 logical block ids, ``-1`` padded.
    """
    out = torch.full((index_q.shape[0], index_q.shape[1], topk), -1, dtype=torch.int32, device=index_q.device)
    for rows, block_scores in msa_block_scores_ref(
        index_q, index_k_cache, page_table, row_req, row_pos, block_size=block_size
    ):
        out[rows] = _select(
            block_scores, row_pos[rows].long(), block_size=block_size, topk=topk, local_blocks=local_blocks
        )
    return out


def msa_topk_shared_ref(
    index_q: torch.Tensor,
    index_k_cache: torch.Tensor,
    page_table: torch.Tensor,
    row_req: torch.Tensor,
    row_pos: torch.Tensor,
    *,
    block_size: int,
    topk: int,
    local_blocks: int,
) -> torch.Tensor:
    """transformers 5.12.1 semantics: one selection (max over index heads) for all heads.

    Kept only so tests can show where it differs from the per-group rule.
    Returns ``[R, H, topk]`` with the same selection repeated for every head.
    """
    heads = index_q.shape[1]
    out = torch.full((index_q.shape[0], heads, topk), -1, dtype=torch.int32, device=index_q.device)
    for rows, block_scores in msa_block_scores_ref(
        index_q, index_k_cache, page_table, row_req, row_pos, block_size=block_size
    ):
        shared = block_scores.amax(dim=1, keepdim=True)  # [r, 1, num_blocks]
        sel = _select(shared, row_pos[rows].long(), block_size=block_size, topk=topk, local_blocks=local_blocks)
        out[rows] = sel.expand(-1, heads, -1)
    return out


# ============================================================================ Triton kernels
# One launch for decode, two for verify / prefill; CUDA-graph safe (grids from tensor
# shapes only, no host sync):
#
# 1. ``_block_score_kernel``: grid (row tiles, page chunks). A tile is BLOCK_R consecutive
#    query rows; the rows of one request inside a tile form a *segment* that reads each
#    index-K page of that request ONCE and scores it for all its rows and heads with one
#    ``tl.dot`` ([BLOCK_R * H, D] x [D, block]); a tile spanning several requests loops over
#    its segments. Verify (1 + K rows per request) and prefill thus scan the history once
#    per tile instead of once per row. Output: causal block max ``[R, H, max_pages]`` fp32;
#    columns past a row's own block are never written and never read.
# 2. Selection: force the local blocks to +inf and extract the top-k under the total order
#    (score desc, block asc), so the result equals ``msa_topk_ref`` slot for slot;
#    exhausted slots (-inf) are -1. Rows of up to 4096 blocks (512K tokens at block 128)
#    take one in-register top-k on packed (score, block) int64 keys (bitonic, or rounds of
#    arg-max for the longest rows).
#    * fused (<= 64 rows and <= 1024 (row, head, block) keys per tile: decode up to 128K,
#      verify tiles of 4 rows up to 32K): every score program takes a ticket on
#      its tile's counter after writing its block maxima; the program that draws the last
#      ticket selects for all rows x heads of the tile (one 2-D top-k) and resets the
#      counter to 0 for the next launch. Saves the second launch.
#    * else ``_topk_select_kernel``: grid (R, H); rows longer than 4096 blocks stream in
#      chunks with one arg-max sweep per slot.
# Programmatic dependent launch as in ``msa_sparse_attn`` (``_PDL``).

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from .msa_sparse_attn import _gdc_launch_dependents, _gdc_wait, _use_pdl  # noqa: E402
from .paged import counters, sm_count  # noqa: E402

# Score-kernel grid: each request's pages are cut into chunks of `pages` pages, one program
# per (row tile, chunk). `pages` (at most _SCORE_MOST_PAGES) minimises waves x (pages + 1), a
# wave being SM count x _SCORE_SLOTS resident programs (+1: a program's start-up costs about
# one page), so the programs come in whole waves; 4 programs fit an SM (90-114 registers,
# 37 KB of shared memory, compiled for sm_90). H200, run 10 (benchmarks/NOTES.md): against
# the earlier rule (power-of-two pages <= 8 once the grid had >= 512 programs) the bf16
# batch 8 x 128K indexer went 84 -> 81 us. A program loads its chunk's page ids once, before
# its loop, so the loads of its index-K pages depend on no other load and Triton's pipeliner
# can keep num_stages - 1 of them in flight. Stages (bf16/fp32, FP8 index-K): one page in
# flight per program (2) was best for bf16 (its 32 KB pages fill the SM's memory pipe with 4
# programs; 3-5 stages lost 0.5-6 us); FP8's 16 KB pages take two in flight (3): batch 64 x
# 128K 294 -> 263 us, batch 8 x 128K 54 -> 52 (run 13), which also beat the FMA row kernel
# used for FP8 decode rows until then (267-299 us there, 61 at batch 8; slower only at batch
# 1 x 128K, 17.4 vs 15.9). Pages read in 2 or 4 row slices (fewer registers, so 5-6 programs
# per SM), 2-4 stages: never more than noise ahead, up to 30 % behind (runs 26-27).
_SCORE_SLOTS = 4
_SCORE_MOST_PAGES = 32
_SCORE_STAGES = {False: 2, True: 3}  # keyed by "index-K cache is FP8"; sweep knob
_SCORE_WARPS = 4  # warps per score program (sweep knob)
# Fuse the top-k selection into the score kernel when there are at most this many query
# rows and a tile's keys ((row, head) pairs x blocks) fit _FUSE_SELECT_MAX_KEYS, one
# in-register sort; 0 turns fusion off. On the H200 (run6) fusion paid for one row per tile
# (decode: ~1.5 us at 32K, ~3.5 us at 128K = 1024 keys, about even at 8K; batch 64 FP8 304
# vs 338 us) and lost for verify tiles of 4 rows x 1024 blocks (+30 us at 128K: 4096 int64
# keys spill from 4 warps' registers). Sweep knobs.
_FUSE_SELECT_MAX_ROWS = 64
_FUSE_SELECT_MAX_KEYS = 1024
# In-register top-k of rows of at least this many keys as TOPK rounds of (row max, knock it
# out) instead of Triton's bitonic tl.topk, whose merge passes exchange every key across
# threads. H200, run 23 (benchmarks/NOTES.md): at 4096 keys (512K tokens, the select launch)
# the rounds took 1.5-3 us off the indexer (bf16 batch 1: 57.1 -> 54.5 us); at 64-1024 keys they
# lost up to 3 us (each round is a block-wide reduction, ~0.2 us). Sweep knob.
_SELECT_ARGMAX_MIN_KEYS = 2048


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
    BS: tl.constexpr,
    TOPK: tl.constexpr,
    LOCAL: tl.constexpr,
    CHUNK: tl.constexpr,
    K2: tl.constexpr,
    ARGMAX: tl.constexpr,
):
    """Top-k of ``M`` (row, head) score rows at once (``row``/``head``/``pos``/``ok``: ``[M]``).

    key = (order-preserving score bits << 31) | (2^31 - 1 - block): descending keys are
    (score desc, block asc), exactly the reference order, and distinct. Absent blocks get -1.
    ARGMAX: TOPK rounds of (row max, knock it out) instead of the bitonic ``tl.topk``.
    """
    b = tl.arange(0, CHUNK)[None, :]
    q_blk = (pos // BS)[:, None]
    nb = q_blk + 1  # blocks 0..q_blk exist for this row
    r64 = row.to(tl.int64)[:, None]
    # .cg: the block maxima were written by other programs (other SMs): read them from L2
    s = tl.load(
        score_ptr + r64 * stride_sr + head[:, None] * stride_sh + b,
        mask=ok[:, None] & (b < nb),
        other=float("-inf"),
        cache_modifier=".cg",
    )
    s = tl.where((b <= q_blk) & (b > q_blk - LOCAL), float("inf"), s)  # force local blocks
    bits = s.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    # float -> uint32 monotone: flip all bits of negatives, the sign bit of the rest
    ukey = tl.where(bits >= 0x80000000, bits ^ 0xFFFFFFFF, bits ^ 0x80000000)
    key = tl.where(b < nb, (ukey << 31) | (2147483647 - b), -1)
    t = tl.arange(0, K2)[None, :]
    if ARGMAX:
        best = tl.max(key, axis=1)[:, None]
        top = tl.where(t == 0, best, -1)
        for i in tl.static_range(1, TOPK):
            key = tl.where(key == best, -1, key)  # keys are distinct: knocks out exactly one
            best = tl.max(key, axis=1)[:, None]
            top = tl.where(t == i, best, top)
    else:
        top = tl.topk(key, K2)  # [M, K2], descending
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
    ARGMAX: tl.constexpr,
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
            BS,
            TOPK,
            LOCAL,
            CHUNK,
            K2,
            ARGMAX,
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
    pages,
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
    MOST: tl.constexpr,
    Q_FP32: tl.constexpr,
    K_FP8: tl.constexpr,
    FUSE: tl.constexpr,
    SEL_M: tl.constexpr,
    TOPK: tl.constexpr,
    LOCAL: tl.constexpr,
    CHUNK: tl.constexpr,
    K2: tl.constexpr,
    PDL: tl.constexpr,
    ARGMAX: tl.constexpr,
):
    tile = tl.program_id(0)
    first_page = tl.program_id(1) * pages
    # -- rows of this tile: m -> (row = tile * BLOCK_R + m // H, head = m % H) ----------
    m = tl.arange(0, BLOCK_M)
    row = tile * BLOCK_R + m // H
    head = m % H
    row_ok = (m < BLOCK_R * H) & (row < R)
    d = tl.arange(0, D)
    j = tl.arange(0, BS)
    pp = tl.arange(0, MOST)
    _gdc_wait(PDL)  # everything below may read what the previous kernel wrote
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
        # pages of this chunk up to the segment's last block; their ids, loaded up front
        n = tl.minimum(pages, last_blk + 1 - first_page).to(tl.int32)
        pids = tl.load(pt_ptr + leader * stride_ptr + first_page + pp, mask=pp < n, other=0)
        for i in range(0, n):
            b = first_page + i
            page = tl.sum(tl.where(pp == i, pids, 0)).to(tl.int64)
            # -- one index-K page [BS, D]; fp8 widens exactly to fp16 / fp32 --------------
            kt = tl.load(k_ptr + (page * BS + j)[:, None] * stride_kt + d[None, :]).to(CDT)
            if Q_FP32:
                s = tl.dot(q, tl.trans(kt), input_precision="ieee")  # [BLOCK_M, BS]
            else:
                s = tl.dot(q, tl.trans(kt))
            # -- token-causal mask, then block max-pool ----------------------------------
            s = tl.where((b * BS + j)[None, :] <= pos[:, None], s, float("-inf"))
            bmax = tl.max(s, axis=1) * k_scale  # k_scale > 0 commutes with max
            tl.store(score_ptr + row.to(tl.int64) * stride_sr + head * stride_sh + b, bmax, mask=seg)
        done = done | seg
    _gdc_launch_dependents(PDL)
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
            ARGMAX,
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
    NUM_CHUNKS: tl.constexpr,
    K2: tl.constexpr,
    PDL: tl.constexpr = False,
    ARGMAX: tl.constexpr = False,
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    _gdc_wait(PDL)
    pos = tl.load(row_pos_ptr + r).to(tl.int64)
    q_blk = pos // BS
    nb = q_blk + 1  # blocks 0..q_blk exist for this row
    s_row = score_ptr + r.to(tl.int64) * stride_sr + h * stride_sh
    o_row = out_ptr + r.to(tl.int64) * stride_or + h * stride_oh
    BIG: tl.constexpr = 2147483647
    prev_s = float("inf")
    prev_b = -1
    if NUM_CHUNKS == 1:
        # -- whole row in registers: one top-k (see _select_rows) -------------------------
        one = tl.full([1], 0, tl.int32)
        _select_rows(
            score_ptr,
            out_ptr,
            one + r,
            one + h,
            one.to(tl.int64) + pos,
            one == 0,
            stride_sr,
            stride_sh,
            stride_or,
            stride_oh,
            BS,
            TOPK,
            LOCAL,
            CHUNK,
            K2,
            ARGMAX,
        )
    else:
        # -- long rows: the same sweeps, streaming the row chunk by chunk (L2 resident) --
        for t in range(TOPK):
            best_s = float("-inf")
            best_b = BIG
            for c in range(NUM_CHUNKS):
                b = c * CHUNK + tl.arange(0, CHUNK)
                s = tl.load(s_row + b, mask=b < nb, other=float("-inf"))
                s = tl.where((b <= q_blk) & (b > q_blk - LOCAL), float("inf"), s)
                cand = ((s < prev_s) | ((s == prev_s) & (b > prev_b))) & (b < nb)
                cs = tl.max(tl.where(cand, s, float("-inf")))
                cb = tl.min(tl.where(cand & (s == cs), b, BIG))
                better = (cs > best_s) | ((cs == best_s) & (cb < best_b))
                best_s = tl.where(better, cs, best_s)
                best_b = tl.where(better, cb, best_b)
            tl.store(o_row + t, tl.where((best_s == float("-inf")) | (best_b == BIG), -1, best_b).to(tl.int32))
            prev_s = best_s
            prev_b = best_b


@functools.lru_cache(maxsize=4096)
def _score_pages(n_tiles: int, max_pages: int, slots: int, most: int) -> int:
    """Pages per score program for ``slots`` resident programs, at most ``most``; shapes only."""

    def cost(pages):
        waves = -(-n_tiles * -(-max_pages // pages) // slots)
        return waves * (pages + 1), -pages  # ties: fewer, longer programs

    return min(range(1, min(most, max_pages) + 1), key=cost)


def _check_rows(name, page_table, row_req, row_pos, num_rows):
    if page_table.dim() != 2:
        raise ValueError(f"page_table must be [num_reqs, max_pages], got {tuple(page_table.shape)}")
    if row_req.shape != (num_rows,) or row_pos.shape != (num_rows,):
        raise ValueError(
            f"{name}: row_req and row_pos must be [{num_rows}], got {tuple(row_req.shape)} and {tuple(row_pos.shape)}"
        )


def msa_topk(
    index_q: torch.Tensor,
    index_k_cache: torch.Tensor,
    page_table: torch.Tensor,
    row_req: torch.Tensor,
    row_pos: torch.Tensor,
    *,
    block_size: int,
    topk: int,
    local_blocks: int,
    k_scale: float = 1.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-group block selection on the GPU; same result as :func:`msa_topk_ref`.

    Parameters
    ----------
    index_q : ``[R, H, D]`` bf16/fp16 (tensor-core dot) or fp32 (exact IEEE dot).
    index_k_cache : ``[slots, D]`` bf16/fp16 or float8_e4m3fn; ``slots`` a multiple of ``block_size``.
    page_table : ``[num_reqs, max_pages]`` int32/int64; bounds every scan (graph safe).
    row_req, row_pos : ``[R]`` int; ``row_pos < max_pages * block_size``.
    k_scale : per-tensor scale of an FP8 index-K cache (must be > 0).
    out : optional ``[R, H, topk]`` int32 output.

    Returns
    -------
    ``[R, H, topk]`` int32 logical block ids, (score desc, block asc), ``-1`` padded.
    """
    R, H, D = index_q.shape
    _check_rows("msa_topk", page_table, row_req, row_pos, R)
    if index_k_cache.dim() != 2 or index_k_cache.shape[1] != D:
        raise ValueError(f"index_k_cache must be [slots, {D}], got {tuple(index_k_cache.shape)}")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {block_size}")
    if D < 16 or D & (D - 1) or index_k_cache.stride(1) != 1 or index_q.stride(2) != 1:
        raise ValueError(f"head dim must be a power of two >= 16 and contiguous, got {D}")
    if not k_scale > 0:
        raise ValueError(f"k_scale must be > 0, got {k_scale}")
    if out is None:
        out = torch.empty((R, H, topk), dtype=torch.int32, device=index_q.device)
    elif out.shape != (R, H, topk) or out.dtype != torch.int32:
        raise ValueError(f"out must be [{R}, {H}, {topk}] int32, got {tuple(out.shape)} {out.dtype}")
    if R == 0:
        return out
    num_reqs, max_pages = page_table.shape
    scores = torch.empty((R, H, max_pages), dtype=torch.float32, device=index_q.device)
    # Rows per tile ~ rows per request (decode 1, verify 1+K, prefill many), capped so
    # the [BLOCK_R * H, BS] score tile stays in registers. Shapes only: graph safe.
    rows_per_req = -(-R // max(num_reqs, 1))
    block_r = max(1, min(triton.next_power_of_2(rows_per_req), max(1, 64 // H)))
    n_tiles = -(-R // block_r)
    k_fp8 = index_k_cache.dtype == torch.float8_e4m3fn
    pages = _score_pages(n_tiles, max_pages, sm_count(index_q.device) * _SCORE_SLOTS, _SCORE_MOST_PAGES)
    k2 = triton.next_power_of_2(topk)
    chunk = max(min(triton.next_power_of_2(max_pages), 4096), k2)  # one register-resident sort up to 512K tokens
    num_chunks = -(-max_pages // chunk)
    sel_m = triton.next_power_of_2(block_r * H)
    fuse = num_chunks == 1 and R <= _FUSE_SELECT_MAX_ROWS and sel_m * chunk <= _FUSE_SELECT_MAX_KEYS
    cnt = counters(index_q.device, "msa_topk", n_tiles) if fuse else out
    pdl = _use_pdl(index_q.device)
    launch = dict(launch_pdl=True) if pdl else {}
    argmax = chunk >= _SELECT_ARGMAX_MIN_KEYS
    sel = dict(BS=block_size, TOPK=topk, LOCAL=local_blocks, CHUNK=chunk, K2=k2, PDL=pdl, ARGMAX=argmax)
    _block_score_kernel[(n_tiles, -(-max_pages // pages))](
        index_q,
        index_k_cache,
        page_table,
        row_req,
        row_pos,
        scores,
        out,
        cnt,
        float(k_scale),
        R,
        pages,
        index_q.stride(0),
        index_q.stride(1),
        index_k_cache.stride(0),
        page_table.stride(0),
        scores.stride(0),
        scores.stride(1),
        out.stride(0),
        out.stride(1),
        H=H,
        D=D,
        BLOCK_R=block_r,
        BLOCK_M=max(16, triton.next_power_of_2(block_r * H)),
        MOST=triton.next_power_of_2(_SCORE_MOST_PAGES),
        Q_FP32=index_q.dtype == torch.float32,
        K_FP8=k_fp8,
        SEL_M=sel_m,
        FUSE=fuse,
        **sel,
        num_warps=_SCORE_WARPS,
        num_stages=_SCORE_STAGES[k_fp8],
        **launch,
    )
    if fuse:
        return out
    _topk_select_kernel[(R, H)](
        scores,
        row_pos,
        out,
        scores.stride(0),
        scores.stride(1),
        out.stride(0),
        out.stride(1),
        NUM_CHUNKS=num_chunks,
        **sel,
        num_warps=max(1, min(8, chunk // 512)),
        **launch,
    )
    return out
