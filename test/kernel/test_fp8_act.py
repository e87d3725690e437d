"""``fp8_act``: the norm and SwiGLU kernels that quantise their output per token, against their references.

On fresh random rows (one all zero, one 10^4 larger, one 10^-6 smaller, widths that are and are not
powers of two). Tolerances: the new residual equal on a GPU (the same fp32 sum rounded once); the
normed / SwiGLU value within one bf16 step (2^-7 relative: the kernel sums squares in another order,
and Triton's CPU interpreter truncates where the GPU rounds); each row's scale within the same; the
dequantised codes within one e4m3 step of the reference value (2^-3 relative, or one subnormal step of
the row's scale), which a wrong scale or a row quantised on another row's scale exceeds by far. A zero
row gives codes 0 on the smallest scale, never NaN.
"""

from __future__ import annotations

import pytest
import torch
from sglang_m3_kernels import fp8_act as fa

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BF16_STEP = 2.0**-7
E4M3_STEP = 2.0**-3


def _rows(rows: int, width: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g) * 3
    x[0] = 0
    x[1] *= 1e4
    x[2] *= 1e-6
    return x.to(torch.bfloat16).to(DEV)


def _check_rows(q, scale, value, want_value):
    """``q * scale`` is ``want_value`` within one e4m3 step; ``scale`` is the reference's."""
    want_q, want_scale = fa.quantise_rows_ref(want_value)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (q.shape[0], 1)
    torch.testing.assert_close(scale, want_scale, rtol=BF16_STEP, atol=0)
    dequant, want = q.float() * scale, want_value.float()
    assert (dequant - want).abs().le(E4M3_STEP * want.abs() + 2.0**-8 * scale).all()
    assert not q[0].float().any() and scale[0].item() == torch.tensor(fa.FP8_TINY).item()  # the zero row
    if value is not None:
        torch.testing.assert_close(value.float(), want, rtol=BF16_STEP, atol=BF16_STEP * want.abs().amax())


@pytest.mark.parametrize("width", [300, 6144])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("keep", [True, False])
def test_add_rmsnorm_fp8(width, with_residual, keep):
    x = _rows(5, width, width)
    residual = _rows(5, width, width + 1) if with_residual else None
    weight = (torch.randn(width, generator=torch.Generator().manual_seed(7)) * 0.2).to(DEV, torch.bfloat16)
    want, want_residual = fa.add_rmsnorm_ref(x, residual, weight, 1e-6, 1.0)
    updated = None if residual is None else residual.clone()
    q, scale, value = fa.add_rmsnorm_fp8(x, updated, weight, 1e-6, 1.0, keep)
    assert (value is not None) == keep
    if with_residual:
        if DEV == "cuda":
            assert torch.equal(updated, want_residual)
        else:
            torch.testing.assert_close(updated.float(), want_residual.float(), rtol=BF16_STEP, atol=0)
    want[0] = 0  # a zero sum normalises to 0 (the reference divides 0 by sqrt(eps))
    _check_rows(q, scale, value, want)


def test_add_rmsnorm_fp8_offset_zero_is_plain_rmsnorm():
    x = _rows(4, 256, 3)
    weight = (torch.rand(256, generator=torch.Generator().manual_seed(8)) + 0.5).to(DEV, torch.bfloat16)
    q, scale, value = fa.add_rmsnorm_fp8(x, None, weight, 1e-6, 0.0, True)
    want = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()).bfloat16()
    _check_rows(q, scale, value, want)


@pytest.mark.parametrize("width", [96, 3072])
def test_swiglu_fp8(width):
    gate_up = _rows(5, 2 * width, width) * 4  # beyond the limit: both clamps act
    q, scale = fa.swiglu_fp8(gate_up, 1.702, 7.0)
    want = fa.swiglu_oai_ref(gate_up, 1.702, 7.0)
    assert q.shape == (5, width)
    _check_rows(q, scale, None, want)


def test_empty_batch():
    x = torch.empty(0, 64, dtype=torch.bfloat16, device=DEV)
    q, scale, value = fa.add_rmsnorm_fp8(x, None, torch.zeros(64, dtype=torch.bfloat16, device=DEV), 1e-6, 1.0, True)
    assert q.shape == (0, 64) and scale.shape == (0, 1) and value.shape == (0, 64)
    assert fa.swiglu_fp8(torch.empty(0, 128, dtype=torch.bfloat16, device=DEV), 1.0, 7.0)[0].shape == (0, 64)
