"""Triton ``kv_store`` writes the same bytes as the references (layout equivalence, exact).

Runs natively on a GPU and under the Triton CPU interpreter elsewhere (conftest sets
``TRITON_INTERPRET=1`` without CUDA), so the packing is checked in CI too.
"""

from __future__ import annotations

import pytest
import torch
from sglang_m3_kernels import kv_quant as kq

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(heads: int, dim: int, slots: int = 48):
    g = torch.Generator().manual_seed(heads * 1000 + dim)
    x = torch.randn(9, heads, dim, generator=g) * 3
    x[0] = 0
    x[1] *= 1e4
    x[2] *= 1e-6
    loc = torch.randperm(slots, generator=g)[:9]
    loc[4] = -1  # padded token: must not be written
    return x.to(torch.bfloat16).to(DEV), loc.to(DEV)


@pytest.mark.parametrize("heads,dim", [(1, 128), (4, 128), (2, 64)])
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_kv_store_matches_reference(fmt, heads, dim):
    x, loc = _inputs(heads, dim)
    keep = loc >= 0
    slots = 48
    if fmt == "bf16":
        cache = torch.zeros(slots, heads, dim, dtype=torch.bfloat16, device=DEV)
        kq.kv_store(x, loc, cache)
        assert torch.equal(cache[loc[keep]], x[keep])
    elif fmt == "fp8":
        cache = torch.zeros(slots, heads, dim, dtype=torch.float8_e4m3fn, device=DEV)
        kq.kv_store(x, loc, cache, scale=0.37)
        want = kq.fp8_quantize_ref(x[keep], 0.37)
        assert torch.equal(cache[loc[keep]].view(torch.uint8), want.view(torch.uint8))
    else:
        cache = torch.zeros(slots, heads, dim // 2, dtype=torch.uint8, device=DEV)
        scales = torch.zeros(slots, heads, dim // 16, dtype=torch.float8_e4m3fn, device=DEV)
        kq.kv_store(x, loc, cache, scale=0.5, scales=scales)
        data, sc = kq.nvfp4_quantize_ref(x[keep], 0.5)
        assert torch.equal(cache[loc[keep]], data)
        assert torch.equal(scales[loc[keep]].view(torch.uint8), sc.view(torch.uint8))
    # untouched slots stay zero (nothing written at -1 or elsewhere)
    untouched = torch.ones(slots, dtype=torch.bool, device=DEV)
    untouched[loc[keep]] = False
    assert not cache[untouched].view(torch.uint8).any()


def test_kv_store_index_k_2d():
    x, loc = _inputs(1, 128)
    x, keep = x[:, 0], loc >= 0
    cache = torch.zeros(48, 128, dtype=torch.float8_e4m3fn, device=DEV)
    kq.kv_store(x, loc, cache, scale=2.0)
    assert torch.equal(cache[loc[keep]].view(torch.uint8), kq.fp8_quantize_ref(x[keep], 2.0).view(torch.uint8))


def test_kv_store_rejects_bad_layout():
    x, loc = _inputs(2, 128)
    with pytest.raises(ValueError, match="64"):
        kq.kv_store(
            x,
            loc,
            torch.zeros(48, 2, 128, dtype=torch.uint8, device=DEV),
            scales=torch.zeros(48, 2, 8, dtype=torch.float8_e4m3fn, device=DEV),
        )
    with pytest.raises(ValueError, match="scales"):
        kq.kv_store(x, loc, torch.zeros(48, 2, 64, dtype=torch.uint8, device=DEV))


def _cache(fmt: str, heads: int, dim: int, slots: int = 48):
    """(cache, scales) of one store format, zeroed."""
    if fmt == "nvfp4":
        return (
            torch.zeros(slots, heads, dim // 2, dtype=torch.uint8, device=DEV),
            torch.zeros(slots, heads, dim // 16, dtype=torch.float8_e4m3fn, device=DEV),
        )
    dtype = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp32": torch.float32}[fmt]
    return torch.zeros(slots, heads, dim, dtype=dtype, device=DEV), None


@pytest.mark.parametrize(
    "kv_fmt,index_fmt,heads,dim",
    [("bf16", "bf16", 4, 128), ("fp8", "fp8", 2, 128), ("nvfp4", "fp8", 2, 64), ("fp32", "fp32", 1, 32)],
)
@pytest.mark.parametrize("with_index", [True, False])
def test_kv_store_many_writes_what_separate_stores_write(kv_fmt, index_fmt, heads, dim, with_index):
    """A layer's K, V and index-K (one head, its own format) in one launch: the same bytes as three
    ``kv_store`` calls, padded tokens skipped. K and V are strided views of one projection output,
    as the attention layer hands them over."""
    qkv, loc = _inputs(3 * heads, dim)
    if kv_fmt == "fp32":
        qkv = qkv.float()
    k, v, index = qkv[:, :heads], qkv[:, heads : 2 * heads], qkv[:, 2 * heads]  # index: [T, D]
    specs = [(k, kv_fmt, heads, 0.37), (v, kv_fmt, heads, 0.5)] + ([(index, index_fmt, 1, 2.0)] if with_index else [])
    fused, separate = [], []
    for x, fmt, h, scale in specs:
        for out in (fused, separate):
            cache, scales = _cache(fmt, h, dim)
            out.append((x, cache if x.dim() == 3 else cache[:, 0], scale, scales))
    kq.kv_store_many(loc, fused)
    for x, cache, scale, scales in separate:
        kq.kv_store(x, loc, cache, scale=scale, scales=scales)
    for (_, got, _, got_scales), (_, want, _, want_scales) in zip(fused, separate):
        assert want.view(torch.uint8).any()  # something was written
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        if want_scales is not None:
            assert torch.equal(got_scales.view(torch.uint8), want_scales.view(torch.uint8))


def test_kv_store_many_rejects_bad_input():
    x, loc = _inputs(2, 128)
    cache = torch.zeros(48, 2, 128, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="1 to 3 stores"):
        kq.kv_store_many(loc, [(x, cache, 1.0, None)] * 4)
    with pytest.raises(ValueError, match="loc must be"):
        kq.kv_store_many(loc, [(x, cache, 1.0, None), (x[:5], cache, 1.0, None)])
