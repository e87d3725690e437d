"""KV-cache quantisation: FP8 e4m3 and NVFP4 references plus a fused Triton quantise-and-store.

Layouts (fixed; the KV pool allocates them, every attention kernel reads them):

* **bf16 / fp16** ``[slots, H, D]``: plain copy.
* **FP8** ``[slots, H, D]`` ``torch.float8_e4m3fn`` with one per-tensor fp32 ``scale``:
  ``value = float(fp8) * scale``. Quantise = ``x / scale`` saturated to +-448 (the largest
  finite e4m3 value; torch's cast would turn overflow into NaN), rounded to nearest even.
* **NVFP4** data ``[slots, H, D // 2]`` uint8 + scales ``[slots, H, D // 16]`` e4m3 +
  optional per-tensor fp32 ``gscale`` (default 1.0). Byte ``i`` of a row holds element ``2i``
  in its LOW nibble and ``2i + 1`` in its HIGH nibble. A nibble is an E2M1 code: bit 3 is the
  sign, bits 0-2 index the magnitudes ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``.
  ``value = e2m1 * float(scale) * gscale``. Quantise per 16-element block:
  ``scale = e4m3(min(amax / 6 / gscale, 448))`` (round to nearest even), then each element is
  ``x / (float(scale) * gscale)`` rounded to nearest even on the E2M1 grid, saturating at 6.
  A block whose scale is 0 (all zeros, or amax too small for e4m3) stores codes 0: no NaN.
* **Index-K** ``[slots, D]`` bf16 or FP8 (per-tensor scale): the one-head case of the above.

All divisions are IEEE round-to-nearest (``tl.math.div_rn`` in Triton), so the Triton store
writes bit-identical bytes to the references, which the layout-equivalence tests check.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0  # largest finite float8_e4m3fn (S.1111.110 = 1.75 * 2^8)
E2M1_MAX = 6.0  # largest E2M1 magnitude (S.11.1 = 1.5 * 2^2)
NVFP4_BLOCK = 16  # head-dim elements that share one e4m3 scale
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude index 0..7


# ----------------------------------------------------------------------------- references
def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn, round to nearest even, saturating at +-448."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def e4m3_decode(x: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn -> fp32 (exact)."""
    return x.float()


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """fp32 (already divided by its scale) -> E2M1 code 0..15 as uint8, RNE, saturating.

    The seven thresholds are the midpoints of the grid; a tie rounds to the even magnitude
    index, so midpoints that lie below an even index use ``>=`` and the others ``>``.
    """
    a = x.float().abs()
    mag = (
        (a > 0.25).to(torch.uint8)  # 0 | 0.5   tie -> 0 (index 0, even)
        + (a >= 0.75)  # 0.5 | 1       tie -> 1 (index 2)
        + (a > 1.25)  # 1 | 1.5       tie -> 1 (index 2)
        + (a >= 1.75)  # 1.5 | 2       tie -> 2 (index 4)
        + (a > 2.5)  # 2 | 3         tie -> 2 (index 4)
        + (a >= 3.5)  # 3 | 4         tie -> 4 (index 6)
        + (a > 5.0)  # 4 | 6         tie -> 4 (index 6); anything above saturates to 6
    ).to(torch.uint8)
    return mag | ((x < 0).to(torch.uint8) << 3)


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    """E2M1 code (uint8 0..15) -> fp32."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=code.device)
    mag = table[(code & 7).long()]
    return torch.where((code & 8) != 0, -mag, mag)


def fp8_quantize_ref(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``x[..., D]`` -> float8_e4m3fn with ``value = fp8 * scale`` (saturating)."""
    return e4m3_encode(x.float() / scale)


def fp8_dequantize_ref(x: torch.Tensor, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """float8_e4m3fn ``[..., D]`` -> ``dtype``: ``float(x) * scale``."""
    return (x.float() * scale).to(dtype)


def nvfp4_quantize_ref(x: torch.Tensor, gscale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``x[..., D]`` -> ``(data[..., D // 2] uint8, scales[..., D // 16] float8_e4m3fn)``."""
    if x.shape[-1] % NVFP4_BLOCK:
        raise ValueError(f"NVFP4 needs the last dim to be a multiple of {NVFP4_BLOCK}, got {x.shape[-1]}")
    blocks = x.float().reshape(*x.shape[:-1], -1, NVFP4_BLOCK)  # [..., D/16, 16]
    amax = blocks.abs().amax(-1)  # [..., D/16]
    scales = e4m3_encode(amax / E2M1_MAX / gscale)
    sf = scales.float() * gscale  # [..., D/16]
    safe = torch.where(sf > 0, sf, torch.ones_like(sf))
    codes = e2m1_encode(blocks / safe[..., None])
    codes = torch.where((sf > 0)[..., None], codes, torch.zeros_like(codes))
    codes = codes.reshape(*x.shape[:-1], -1, 2)  # [..., D/2, 2]: (even, odd) elements
    data = codes[..., 0] | (codes[..., 1] << 4)
    return data, scales


def nvfp4_dequantize_ref(
    data: torch.Tensor, scales: torch.Tensor, gscale: float = 1.0, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``(data[..., D // 2], scales[..., D // 16])`` -> ``[..., D]`` in ``dtype``."""
    codes = torch.stack([data & 0xF, data >> 4], dim=-1).reshape(*data.shape[:-1], -1)  # [..., D]
    vals = e2m1_decode(codes).reshape(*codes.shape[:-1], -1, NVFP4_BLOCK)
    vals = vals * (scales.float() * gscale)[..., None]
    return vals.reshape(codes.shape).to(dtype)


# ----------------------------------------------------------------------------- Triton store
@triton.jit
def _e2m1_code(a):
    """|x| / scale (fp32, >= 0) -> 3-bit magnitude index, RNE and saturating (see e2m1_encode)."""
    m = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
    m += (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
    m += (a > 5.0).to(tl.int32)
    return m


@triton.jit
def _e4m3_round(x):
    """fp32 in [-448, 448] -> the nearest e4m3 value (ties to even), still as fp32.

    The cast to fp8 that follows is then exact under any rounding mode (the Triton CPU
    interpreter does not round to nearest even; sm_90's cvt.rn does).
    """
    # quantum = 2^(e - 3) with 3 mantissa bits; e is clamped at -6, the subnormal exponent
    e = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    eq = tl.maximum(e, -6) - 3
    quantum = ((eq + 127) << 23).to(tl.float32, bitcast=True)
    y = x * ((127 - eq) << 23).to(tl.float32, bitcast=True)  # x / quantum, exact, |y| <= 16
    # adding 1.5 * 2^23 pushes the fraction bits out of the fp32 mantissa: RNE rounding
    y = (y + 12582912.0) - 12582912.0
    r = (y * quantum).to(tl.int32, bitcast=True)
    # keep the sign of values that round to zero (torch's cast gives -0 for them)
    sign = x.to(tl.int32, bitcast=True) & -2147483648
    return (r | sign).to(tl.float32, bitcast=True)


@triton.jit
def _store_row(x_row, c_row, s_row, scale, D: tl.constexpr, MODE: tl.constexpr):
    """Quantise one D-row at ``x_row`` into the cache row ``c_row`` (and NVFP4 scales at ``s_row``)."""
    if MODE == 0:
        d = tl.arange(0, D)
        x = tl.load(x_row + d)
        tl.store(c_row + d, x.to(c_row.dtype.element_ty))
    elif MODE == 1:
        d = tl.arange(0, D)
        x = tl.load(x_row + d).to(tl.float32)
        q = tl.clamp(tl.math.div_rn(x, scale), -448.0, 448.0)  # saturate like fp8_quantize_ref
        tl.store(c_row + d, _e4m3_round(q).to(tl.float8e4nv))
    else:
        # -- load the row as [D/16 blocks, 8 pairs, 2 (even, odd)] ------------------
        NB: tl.constexpr = D // 16
        blk = tl.arange(0, NB)[:, None, None]
        pair = tl.arange(0, 8)[None, :, None]
        odd = tl.arange(0, 2)[None, None, :]
        x = tl.load(x_row + blk * 16 + pair * 2 + odd).to(tl.float32)  # [NB, 8, 2]
        # -- per-block e4m3 scale: e4m3(min(amax / 6 / gscale, 448)) ------------------
        amax = tl.max(tl.max(tl.abs(x), axis=2), axis=1)  # [NB]
        s = tl.math.div_rn(tl.math.div_rn(amax, 6.0), scale)
        s8 = _e4m3_round(tl.minimum(s, 448.0)).to(tl.float8e4nv)
        sf = s8.to(tl.float32) * scale  # [NB]
        safe = tl.where(sf > 0, sf, 1.0)
        # -- E2M1 codes (RNE, saturating), zero for zero-scale blocks ----------------
        a = tl.math.div_rn(tl.abs(x), safe[:, None, None])
        code = _e2m1_code(a) | tl.where(x < 0, 8, 0)
        code = tl.where((sf > 0)[:, None, None], code, 0)
        # -- pack: even element in the low nibble, odd in the high nibble --------------
        byte = tl.sum(code << (odd * 4), axis=2).to(tl.uint8)  # [NB, 8]
        tl.store(c_row + tl.arange(0, NB)[:, None] * 8 + tl.arange(0, 8)[None, :], byte)
        tl.store(s_row + tl.arange(0, NB), s8)


@triton.jit
def _store_item(x_ptr, cache_ptr, scales_ptr, scale, H, sxt, sxh, sct, sch, sst, ssh, t, h, slot, D, MODE):
    if h < H:
        x_row = x_ptr + t.to(tl.int64) * sxt + h * sxh
        _store_row(x_row, cache_ptr + slot * sct + h * sch, scales_ptr + slot * sst + h * ssh, scale, D, MODE)


@triton.jit
def _kv_store_kernel(
    loc_ptr,
    # one store per program-axis-2 index: (x, cache, scales, scale, heads, 6 strides) each
    x0, c0, s0, scale0, H0, sx0t, sx0h, sc0t, sc0h, ss0t, ss0h,
    x1, c1, s1, scale1, H1, sx1t, sx1h, sc1t, sc1h, ss1t, ss1h,
    x2, c2, s2, scale2, H2, sx2t, sx2h, sc2t, sc2h, ss2t, ss2h,
    D0: tl.constexpr, MODE0: tl.constexpr,  # MODE: 0 plain copy, 1 fp8, 2 nvfp4
    D1: tl.constexpr, MODE1: tl.constexpr,
    D2: tl.constexpr, MODE2: tl.constexpr,
):  # fmt: skip
    """One program per (token, head, store): quantise one D-row of that store and write it at
    slot ``loc[t]``; heads past a store's own count do nothing."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    i = tl.program_id(2)
    slot = tl.load(loc_ptr + t).to(tl.int64)
    if slot < 0:  # padded tokens (CUDA-graph batches) carry -1: nothing to store
        return
    if i == 0:
        _store_item(x0, c0, s0, scale0, H0, sx0t, sx0h, sc0t, sc0h, ss0t, ss0h, t, h, slot, D0, MODE0)
    elif i == 1:
        _store_item(x1, c1, s1, scale1, H1, sx1t, sx1h, sc1t, sc1h, ss1t, ss1h, t, h, slot, D1, MODE1)
    else:
        _store_item(x2, c2, s2, scale2, H2, sx2t, sx2h, sc2t, sc2h, ss2t, ss2h, t, h, slot, D2, MODE2)


MAX_STORES = 3  # K, V and index-K of one layer


class _Store(NamedTuple):
    """One store of a launch, checked: its kernel arguments and the shapes the launch needs."""

    args: tuple  # (x, cache, scales, scale, H, 6 strides), in _kv_store_kernel's order
    rows: int  # T
    heads: int  # H
    dim: int  # D
    mode: int  # 0 plain copy, 1 fp8, 2 nvfp4


def _store_args(x: torch.Tensor, cache: torch.Tensor, scale: float, scales: torch.Tensor | None) -> _Store:
    """Checked ``[T, H, D]`` views of one store's input and cache."""
    if x.dim() == 2:
        x = x.unsqueeze(1)
        cache = cache.unsqueeze(1)
        scales = None if scales is None else scales.unsqueeze(1)
    if x.dim() != 3 or cache.dim() != 3:
        raise ValueError(f"expected x [T, H, D] and cache [slots, H, *], got {tuple(x.shape)} and {tuple(cache.shape)}")
    T, H, D = x.shape
    if cache.shape[1] != H:
        raise ValueError(f"cache must have {H} heads, got {cache.shape[1]}")
    if D & (D - 1) or D < 16:
        raise ValueError(f"head dim must be a power of two >= 16, got {D}")
    if x.stride(-1) != 1 or cache.stride(-1) != 1:
        raise ValueError("x and cache must be contiguous in the last dim")
    if cache.dtype == torch.uint8:
        mode = 2
        if cache.shape[2] != D // 2:
            raise ValueError(f"NVFP4 cache last dim must be {D // 2}, got {cache.shape[2]}")
        if scales is None or scales.dtype != torch.float8_e4m3fn or tuple(scales.shape[1:]) != (H, D // 16):
            raise ValueError(f"NVFP4 needs scales [slots, {H}, {D // 16}] float8_e4m3fn")
        s_args = (scales, scales.stride(0), scales.stride(1))
    else:
        mode = 1 if cache.dtype == torch.float8_e4m3fn else 0
        if cache.shape[2] != D:
            raise ValueError(f"cache last dim must be {D}, got {cache.shape[2]}")
        s_args = (cache, 0, 0)
    strides = (x.stride(0), x.stride(1), cache.stride(0), cache.stride(1), *s_args[1:])
    return _Store((x, cache, s_args[0], float(scale), H, *strides), T, H, D, mode)


def kv_store_many(loc: torch.Tensor, stores: list[tuple]) -> None:
    """Up to three :func:`kv_store` writes at the same slots in one launch (a layer's K, V and
    index-K): ``stores`` holds ``(x, cache, scale, scales)`` tuples, each as :func:`kv_store` takes
    them (formats, head counts and head dims may differ)."""
    if not 1 <= len(stores) <= MAX_STORES:
        raise ValueError(f"kv_store_many takes 1 to {MAX_STORES} stores, got {len(stores)}")
    checked = [_store_args(*store) for store in stores]
    rows = sorted({store.rows for store in checked})
    if len(rows) != 1 or loc.shape != (rows[0],):
        raise ValueError(f"loc must be [T] for x of T rows each, got loc {tuple(loc.shape)} and x rows {rows}")
    T = rows[0]
    if T == 0:
        return
    padded = checked + [checked[0]] * (MAX_STORES - len(checked))  # unused slots: never reached
    meta = {}
    for i, store in enumerate(padded):
        meta[f"D{i}"], meta[f"MODE{i}"] = store.dim, store.mode
    heads = max(store.heads for store in checked)
    wide = max(store.dim for store in checked) > 128
    _kv_store_kernel[(T, heads, len(checked))](
        loc, *(a for store in padded for a in store.args), **meta, num_warps=2 if wide else 1
    )


def kv_store(
    x: torch.Tensor,
    loc: torch.Tensor,
    cache: torch.Tensor,
    *,
    scale: float = 1.0,
    scales: torch.Tensor | None = None,
) -> None:
    """Quantise ``x`` and write it into ``cache`` at slots ``loc`` (in place, graph safe).

    The layout is chosen by ``cache.dtype``: bf16/fp16/fp32 copy, ``float8_e4m3fn`` FP8
    (``scale`` = per-tensor scale), ``uint8`` NVFP4 (``scales`` = e4m3 block scales,
    ``scale`` = global scale). :func:`kv_store_many` writes a layer's K, V and index-K in one launch.

    Parameters
    ----------
    x : ``[T, H, D]`` (or ``[T, D]`` for index-K) bf16/fp16/fp32.
    loc : ``[T]`` int32/int64 slot ids; negative ids are skipped.
    cache : ``[slots, H, D]`` (``[slots, H, D // 2]`` uint8 for NVFP4; ``[slots, D]`` for index-K).
    scale : per-tensor fp32 scale (FP8) or global scale (NVFP4); ignored for plain copies.
    scales : ``[slots, H, D // 16]`` float8_e4m3fn, NVFP4 only.
    """
    kv_store_many(loc, [(x, cache, scale, scales)])


def dequantize_cache(
    cache: torch.Tensor, *, scale: float = 1.0, scales: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Dequantised view of a whole cache in any layout (what the references read)."""
    if cache.dtype == torch.uint8:
        return nvfp4_dequantize_ref(cache, scales, scale, dtype)
    if cache.dtype == torch.float8_e4m3fn:
        return fp8_dequantize_ref(cache, scale, dtype)
    return cache.to(dtype)
