"""MSA block-sparse GQA attention over paged K/V (MiniMax-M3 sparse attention, step 2).

Query row ``r`` at absolute position ``p`` with query head ``h`` in KV group
``g = h // (Hq / Hkv)`` attends, with an exact softmax scaled by ``scale``, to
every key ``j`` with ``j <= p`` (token-causal, also inside the local block) and
``j // block_size`` in ``block_ids[r, g]``. ``block_ids=None`` means dense
causal attention (the dense layers, and MSA itself when a request has at most
``topk`` blocks).

Cache layout: see ``paged.py``. ``k_cache`` / ``v_cache`` are
``[slots, Hkv, D]``; quantised pools pass their dequantised view to the
reference and their raw pages to the kernels.

The Triton bodies are in ``msa_sparse_attn_triton.py`` (algorithm notes there); this module
holds the reference, the launcher with its input checks, and its tuning knobs
(:class:`AttentionSettings`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from .msa_sparse_attn_triton import _merge_kernel, _msa_attn_kernel
from .paged import counters, request_slots, rows_by_request, sm_count
from .pdl import INTERPRET, use_pdl

_LOG2E = 1.4426950408889634  # exp(x) = exp2(x * log2(e))
_NVFP4_UNIT = 2.0**14  # NVFP4 pages are decoded as e2m1 * 2^-14 (see _load_page): scales carry 2^14


@dataclass(frozen=True)
class AttentionSettings:
    """Launch choices of :func:`msa_attention`. Any value gives the same result up to summation order.

    The defaults are the fastest found on an H200 for the TP4 per-GPU shape (16 q heads per KV
    head, head dim 128, block 128, top-16); ``docs/perf-notes.md`` says what else was tried.
    Tuples are indexed by KV mode: 0 plain (bf16 / fp16 / fp32 pages), 1 FP8, 2 NVFP4.
    """

    # warps per attention program (fp32 q always takes 8): 8 was as fast as 4 or faster for
    # every KV mode and batch; 16 cost occupancy
    warps: tuple[int, int, int] = (8, 8, 8)
    # software-pipeline stages of the page loop: bf16 and FP8 keep one page in flight while
    # one is used; NVFP4's decoded tiles already take ~69 KB of shared memory, so a second
    # buffer would cost programs per SM
    stages: tuple[int, int, int] = (2, 2, 1)
    # register cap per thread (None: the compiler's choice); a cap that fits more programs
    # per SM gained nothing
    maxnreg: tuple[int | None, int | None, int | None] = (None, None, None)
    # split-K: double the splits (up to the selected pages) until the grid holds this many
    # programs per SM; more splits add merge work, fewer leave SMs idle
    split_programs_per_sm: float = 1
    # merge the split partials in the attention kernel (the last split merges) when there are
    # at most this many splits, else in a second launch (0: always the launch). The in-kernel
    # merge reads the partials one L2 round trip after another: it pays at 4 splits (batch 64
    # decode) and loses at 8-16 (batch 1-8)
    fuse_merge_max_splits: int = 4
    # the merge launch combines this many partials at a time: dense rows over a long page
    # table take up to next_pow2(pages) splits, and one [splits, Dv] fp32 tile would spill
    merge_chunk: int = 32
    # NVFP4: dots split into even / odd head-dim halves (False: decode per element with a scale
    # gather, slower)
    nvfp4_even_odd: bool = True
    # NVFP4 decode through inline PTX (only used where D = Dv = 128 with 8-byte-aligned scale rows)
    nvfp4_asm: bool = True

    def __post_init__(self):
        for name in ("warps", "stages", "maxnreg"):
            if len(getattr(self, name)) != 3:
                raise ValueError(f"AttentionSettings.{name} needs one value per KV mode (3), got {getattr(self, name)}")
        if any(w < 1 or w & (w - 1) for w in self.warps):
            raise ValueError(f"AttentionSettings.warps must be powers of two, got {self.warps}")
        if any(s < 1 for s in self.stages):
            raise ValueError(f"AttentionSettings.stages must be >= 1, got {self.stages}")
        if not self.split_programs_per_sm > 0:
            raise ValueError(f"AttentionSettings.split_programs_per_sm must be > 0, got {self.split_programs_per_sm}")
        if self.fuse_merge_max_splits < 0:
            raise ValueError(f"AttentionSettings.fuse_merge_max_splits must be >= 0, got {self.fuse_merge_max_splits}")
        if self.merge_chunk < 1 or self.merge_chunk & (self.merge_chunk - 1):
            raise ValueError(f"AttentionSettings.merge_chunk must be a power of two, got {self.merge_chunk}")


DEFAULT_SETTINGS = AttentionSettings()


def msa_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    row_req: torch.Tensor,
    row_pos: torch.Tensor,
    block_ids: torch.Tensor | None,
    *,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """Reference attention in fp32.

    Parameters
    ----------
    q : ``[R, Hq, D]``.
    k_cache, v_cache : ``[slots, Hkv, D]`` / ``[slots, Hkv, Dv]``.
    page_table : ``[num_reqs, max_pages]`` int.
    row_req, row_pos : ``[R]`` int.
    block_ids : ``[R, Hkv, topk]`` int (``-1`` = empty) or ``None`` for dense causal.

    Returns
    -------
    ``[R, Hq, Dv]`` in ``q.dtype``.
    """
    num_rows, q_heads, _ = q.shape
    kv_heads = k_cache.shape[1]
    group = q_heads // kv_heads
    out = q.new_empty((num_rows, q_heads, v_cache.shape[-1]))
    for req, rows in rows_by_request(row_req):
        pos = row_pos[rows].long()  # [r]
        length = int(pos.max()) + 1
        slots = request_slots(page_table[req], length, block_size)
        k = k_cache[slots].float()  # [L, Hkv, D]
        v = v_cache[slots].float()  # [L, Hkv, Dv]
        key_pos = torch.arange(length, device=q.device)
        allowed = (key_pos[None, :] <= pos[:, None])[:, None, :].expand(-1, kv_heads, -1)  # [r, Hkv, L]
        if block_ids is not None:
            sel = block_ids[rows].long()  # [r, Hkv, topk]; -1 never equals a block id
            key_block = key_pos // block_size
            in_sel = (key_block[None, None, None, :] == sel[..., None]).any(dim=-2)  # [r, Hkv, L]
            allowed = allowed & in_sel
        qg = q[rows].float().view(len(rows), kv_heads, group, -1)  # [r, Hkv, G, D]
        scores = torch.einsum("rhgd,lhd->rhgl", qg, k) * scale
        scores = scores.masked_fill(~allowed[:, :, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.einsum("rhgl,lhd->rhgd", probs, v)  # [r, Hkv, G, Dv]
        out[rows] = o.reshape(len(rows), q_heads, -1).to(out.dtype)
    return out


def _kv_mode(k_cache, v_cache, k_scales, v_scales, q):
    """0 plain, 1 FP8, 2 NVFP4 (with block-scale checks); ValueError on a mixed pair."""
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache and v_cache must share a dtype, got {k_cache.dtype} and {v_cache.dtype}")
    if k_cache.dtype == torch.uint8:
        d = q.shape[2]
        if k_cache.shape[2] * 2 != d:
            raise ValueError(f"NVFP4 k_cache last dim must be {d // 2}, got {k_cache.shape[2]}")
        for name, sc, data in (("k_scales", k_scales, k_cache), ("v_scales", v_scales, v_cache)):
            want = (data.shape[0], data.shape[1], data.shape[2] * 2 // 16)
            if sc is None or sc.dtype != torch.float8_e4m3fn or tuple(sc.shape) != want or sc.stride(2) != 1:
                raise ValueError(
                    f"NVFP4 needs {name} {list(want)} float8_e4m3fn, got "
                    f"{None if sc is None else (tuple(sc.shape), sc.dtype)}"
                )
        return 2
    if k_cache.shape[2] != q.shape[2]:
        raise ValueError(f"k_cache head dim must be {q.shape[2]}, got {k_cache.shape[2]}")
    return 1 if k_cache.dtype == torch.float8_e4m3fn else 0


def msa_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    row_req: torch.Tensor,
    row_pos: torch.Tensor,
    block_ids: torch.Tensor | None,
    *,
    block_size: int,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    settings: AttentionSettings = DEFAULT_SETTINGS,
) -> torch.Tensor:
    """Block-sparse (or dense causal) paged GQA attention on the GPU; matches :func:`msa_attention_ref`.

    The KV layout follows ``k_cache.dtype`` (see ``kv_quant.py``): bf16/fp16/fp32 pages;
    float8_e4m3fn pages with per-tensor ``k_scale``/``v_scale``; uint8 NVFP4 pages with
    e4m3 block scales ``k_scales``/``v_scales`` and global scales ``k_scale``/``v_scale``.

    On sm_90 the launch overlaps the previous kernel's tail (programmatic dependent launch):
    ``q``, ``row_req`` and ``row_pos`` are read before waiting on it, so they must not be
    written by the kernel launched immediately before (``msa_topk`` never does).

    Parameters
    ----------
    q : ``[R, Hq, D]`` bf16 (tensor cores) or fp32 (IEEE dot, for token-exact runs).
    k_cache, v_cache : ``[slots, Hkv, D]`` (``[slots, Hkv, D // 2]`` uint8 for NVFP4).
    page_table : ``[num_reqs, max_pages]`` int; ``max_pages`` bounds dense scans.
    row_req, row_pos : ``[R]`` int.
    block_ids : ``[R, Hkv, topk]`` int32 (``-1`` empty) or ``None`` for dense causal.
    k_scales, v_scales : ``[slots, Hkv, D // 16]`` float8_e4m3fn, NVFP4 only.
    out : optional ``[R, Hq, Dv]`` output in ``q.dtype``.
    settings : launch choices (:class:`AttentionSettings`); the tuned defaults when omitted.

    Returns
    -------
    ``[R, Hq, Dv]`` in ``q.dtype``.
    """
    if not isinstance(settings, AttentionSettings):
        raise TypeError(f"settings must be an AttentionSettings, got {type(settings).__name__}")
    R, Hq, D = q.shape
    _check_page_args(page_table, row_req, row_pos, R)
    if k_cache.dim() != 3 or v_cache.dim() != 3 or k_cache.shape[:2] != v_cache.shape[:2]:
        raise ValueError(f"k_cache/v_cache must be [slots, Hkv, *], got {tuple(k_cache.shape)} {tuple(v_cache.shape)}")
    mode = _kv_mode(k_cache, v_cache, k_scales, v_scales, q)
    hkv = k_cache.shape[1]
    if Hq % hkv:
        raise ValueError(f"q heads ({Hq}) must be a multiple of KV heads ({hkv})")
    dv = v_cache.shape[2] * (2 if mode == 2 else 1)
    for name, n in (("head dim", D), ("value dim", dv), ("block_size", block_size)):
        if n < 16 or n & (n - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {n}")
    if q.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride(2) != 1:
        raise ValueError("q, k_cache and v_cache must be contiguous in the last dim")
    if block_ids is not None and (block_ids.dim() != 3 or block_ids.shape[:2] != (R, hkv)):
        raise ValueError(f"block_ids must be [{R}, {hkv}, topk], got {tuple(block_ids.shape)}")
    if out is None:
        out = torch.empty((R, Hq, dv), dtype=q.dtype, device=q.device)
    elif out.shape != (R, Hq, dv) or out.stride(2) != 1:
        raise ValueError(f"out must be [{R}, {Hq}, {dv}] contiguous in the last dim, got {tuple(out.shape)}")
    if R == 0:
        return out
    group = Hq // hkv
    topk = block_ids.shape[2] if block_ids is not None else 0
    # Splits so that R * Hkv * NS reaches split_programs_per_sm programs per SM; shapes only.
    max_splits = triton.next_power_of_2(topk) if block_ids is not None else triton.next_power_of_2(page_table.shape[1])
    ns = 1
    while ns < max_splits and R * hkv * ns < settings.split_programs_per_sm * sm_count(q.device):
        ns *= 2
    f32 = q.dtype == torch.float32
    eo = mode == 2 and settings.nvfp4_even_odd and not f32
    asm = eo and settings.nvfp4_asm and not INTERPRET and _nvfp4_asm_ok(D, dv, k_scales, v_scales)
    fuse = 1 < ns <= settings.fuse_merge_max_splits
    pdl = use_pdl(q.device)
    if ns == 1:
        o_buf, lse = out, out  # final output written directly; lse unused
        o_strides = (0, out.stride(0), out.stride(1))
        lse_strides = (0, 0)
    else:
        o_buf = torch.empty((ns, R, Hq, dv), dtype=torch.float32, device=q.device)
        lse = torch.empty((ns, R, Hq), dtype=torch.float32, device=q.device)
        o_strides = (o_buf.stride(0), o_buf.stride(1), o_buf.stride(2))
        lse_strides = (lse.stride(0), lse.stride(1))
    cnt = counters(q.device, "msa_attention", R * hkv) if fuse else lse
    if mode == 2 and asm:  # scale rows as one int64 each: strides in int64 units
        ks, vs = k_scales.view(torch.int64), v_scales.view(torch.int64)
    else:
        ks = k_scales if mode == 2 else k_cache
        vs = v_scales if mode == 2 else v_cache
    bid = block_ids if block_ids is not None else row_req
    k_mult = k_scale * (_NVFP4_UNIT if mode == 2 else 1.0) if mode else 1.0
    v_mult = v_scale * (_NVFP4_UNIT if mode == 2 else 1.0) if mode else 1.0
    launch = dict(launch_pdl=True) if pdl else {}
    maxnreg = settings.maxnreg[mode]
    regs = {} if f32 or maxnreg is None else dict(maxnreg=maxnreg)
    _msa_attn_kernel[(R, hkv, ns)](
        q,
        k_cache,
        v_cache,
        ks,
        vs,
        page_table,
        row_req,
        row_pos,
        bid,
        o_buf,
        lse,
        out,
        cnt,
        float(scale * k_mult * _LOG2E),
        float(v_mult),
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        ks.stride(0) if mode == 2 else 0,
        ks.stride(1) if mode == 2 else 0,
        vs.stride(0) if mode == 2 else 0,
        vs.stride(1) if mode == 2 else 0,
        page_table.stride(0),
        bid.stride(0) if block_ids is not None else 0,
        bid.stride(1) if block_ids is not None else 0,
        *o_strides,
        *lse_strides,
        out.stride(0),
        out.stride(1),
        G=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        D=D,
        DV=dv,
        BS=block_size,
        MODE=mode,
        SPARSE=block_ids is not None,
        TOPK=topk,
        NS=ns,
        F32=f32,
        EO=eo,
        ASM=asm,
        FUSE_MERGE=fuse,
        PDL=pdl,
        num_warps=8 if f32 else settings.warps[mode],
        num_stages=settings.stages[mode],
        **regs,
        **launch,
    )
    if ns > 1 and not fuse:
        _merge_kernel[(R, Hq)](
            o_buf,
            lse,
            out,
            float(v_mult),
            *o_strides,
            *lse_strides,
            out.stride(0),
            out.stride(1),
            NS=ns,
            DV=dv,
            CH=min(ns, settings.merge_chunk),
            PDL=pdl,
            num_warps=4,
            **launch,
        )
    return out


def _nvfp4_asm_ok(d, dv, k_scales, v_scales) -> bool:
    """The inline-PTX decode reads each head row's 8 block scales as one aligned int64."""
    if d != 128 or dv != 128:
        return False
    for sc in (k_scales, v_scales):
        if sc.stride(2) != 1 or sc.stride(0) % 8 or sc.stride(1) % 8 or sc.data_ptr() % 8:
            return False
    return True


def _check_page_args(page_table, row_req, row_pos, num_rows):
    if page_table.dim() != 2:
        raise ValueError(f"page_table must be [num_reqs, max_pages], got {tuple(page_table.shape)}")
    if row_req.shape != (num_rows,) or row_pos.shape != (num_rows,):
        raise ValueError(
            f"row_req and row_pos must be [{num_rows}], got {tuple(row_req.shape)} and {tuple(row_pos.shape)}"
        )
