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

The Triton bodies are in ``msa_index_topk_triton.py`` (algorithm notes there); this module
holds the references, the launcher with its input checks, and its tuning knobs
(:class:`TopkSettings`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton

from .msa_index_topk_triton import _block_score_kernel, _topk_select_kernel
from .paged import counters, request_slots, rows_by_request, sm_count
from .pdl import use_pdl


@dataclass(frozen=True)
class TopkSettings:
    """Launch choices of :func:`msa_topk`. Any value gives the same block ids.

    The defaults are the fastest found on an H200 for the TP4 per-GPU shape (1 index head, head
    dim 128, block 128, top-16); ``docs/perf-notes.md`` says what else was tried.
    """

    # Score grid: one wave. SM count x score_slots programs fit the GPU at once (4 fit an SM:
    # 90-114 registers, 37 KB of shared memory on sm_90; assuming 2, 3 or 6 was slower or even);
    # each row tile gets an equal share of them (at least one), and program c of a tile's G
    # takes its pages c, c + G, ... up to the tile's own last block. The grid cannot follow the
    # batch's lengths (graph safe), and the page table is as wide as the model's longest context
    # (8,192 pages for M3's 1M), so a grid sized from the table's width ran mostly empty programs:
    # 16 waves of them at batch 32 x 8K, where one wave of 16 programs a tile, 4 pages each, does.
    score_slots: int = 4
    # page ids a score program loads at once, before the loop over those pages
    score_page_ids: int = 32
    # pipeline stages of the score loop (num_stages - 1 index-K pages in flight per program):
    # a bf16 / fp16 / fp32 index-K page (32 KB) fills the SM's memory pipe with one in flight;
    # FP8 pages (16 KB) take two
    score_stages: int = 2
    score_stages_fp8: int = 3
    score_warps: int = 4  # warps per score program; 8 was up to 2x slower at batch 64 (occupancy)
    # Fuse the top-k selection into the score kernel when there are at most this many query
    # rows and a tile's (row, head) pairs (padded to a power of two) times a chunk of at least
    # fuse_select_min_chunk blocks fit fuse_select_max_keys, one in-register sort per chunk;
    # 0 rows turns fusion off. Fusion pays for decode (one-row tiles) and loses once one
    # program sorts several thousand keys (they spill from 4 warps' registers). 512 keys, not
    # 1024: with several index heads a tile (TP1-2 decode, verify's 4-row tiles) sorted 1024-key
    # chunks in one program; at 512 faster or within 2 % everywhere measured (one H100, TP1 decode
    # batch 1 x 8K 11.2 -> 7.7 us, verify 4 rows x 64K 50.1 -> 13.4 us; docs/perf-notes.md), and
    # one-head decode tiles (TP4) are unchanged
    fuse_select_max_rows: int = 64
    fuse_select_max_keys: int = 512
    fuse_select_min_chunk: int = 64
    # blocks per chunk of the selection's streaming top-k (rows longer than this take several
    # chunks, each merged into the running top-k): the unfused kernel's sort width
    select_chunk: int = 512

    def __post_init__(self):
        for name in (
            "score_slots",
            "score_page_ids",
            "score_stages",
            "score_stages_fp8",
            "score_warps",
            "fuse_select_min_chunk",
            "select_chunk",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"TopkSettings.{name} must be >= 1, got {getattr(self, name)}")
        if self.score_warps & (self.score_warps - 1):
            raise ValueError(f"TopkSettings.score_warps must be a power of two, got {self.score_warps}")
        for name in ("fuse_select_min_chunk", "select_chunk"):
            if getattr(self, name) & (getattr(self, name) - 1):
                raise ValueError(f"TopkSettings.{name} must be a power of two, got {getattr(self, name)}")


DEFAULT_SETTINGS = TopkSettings()


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


def score_programs(n_tiles: int, max_pages: int, slots: int) -> int:
    """Score programs per row tile: the tiles share one wave of ``slots`` resident programs (at least
    one program a tile, at most one a page); shapes only, so graph safe."""
    return max(1, min(max_pages, slots // n_tiles))


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
    settings: TopkSettings = DEFAULT_SETTINGS,
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
    settings : launch choices (:class:`TopkSettings`); the tuned defaults when omitted.

    Returns
    -------
    ``[R, H, topk]`` int32 logical block ids, (score desc, block asc), ``-1`` padded.
    """
    if not isinstance(settings, TopkSettings):
        raise TypeError(f"settings must be a TopkSettings, got {type(settings).__name__}")
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
    programs = score_programs(n_tiles, max_pages, sm_count(index_q.device) * settings.score_slots)
    k2 = triton.next_power_of_2(topk)
    # the selection streams each row's blocks CHUNK at a time up to the row's own block, so
    # the page table's width (the longest context) costs a short row nothing
    chunk = max(min(triton.next_power_of_2(max_pages), settings.select_chunk), k2)
    sel_m = triton.next_power_of_2(block_r * H)
    fused_chunk = min(chunk, settings.fuse_select_max_keys // sel_m)
    fuse = R <= settings.fuse_select_max_rows and fused_chunk >= max(k2, min(chunk, settings.fuse_select_min_chunk))
    if fuse:
        chunk = fused_chunk
    cnt = counters(index_q.device, "msa_topk", n_tiles) if fuse else out
    pdl = use_pdl(index_q.device)
    launch = dict(launch_pdl=True) if pdl else {}
    sel = dict(BS=block_size, TOPK=topk, LOCAL=local_blocks, CHUNK=chunk, K2=k2, PDL=pdl)
    _block_score_kernel[(n_tiles, programs)](
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
        IDS=triton.next_power_of_2(settings.score_page_ids),
        Q_FP32=index_q.dtype == torch.float32,
        K_FP8=k_fp8,
        SEL_M=sel_m,
        FUSE=fuse,
        **sel,
        num_warps=settings.score_warps,
        num_stages=settings.score_stages_fp8 if k_fp8 else settings.score_stages,
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
        **sel,
        num_warps=max(1, min(8, chunk // 256)),
        **launch,
    )
    return out
