"""``sglang_m3_kernels.gemv`` against ``gemv_ref`` (CPU through Triton's interpreter, and the GPU).

Bound: max |gemv - ref| <= 2^-7 x max |ref| per output row block. Both round an fp32 sum once to
the output dtype (<= 2^-9 relative for bf16, 2^-12 for fp16); the sums' order differs (fp32, ~2^-24
per add over K <= 12,288). A wrong row, column or token moves an output by O(max |ref|).
"""

from __future__ import annotations

import pytest
import torch
from sglang_m3_kernels.gemv import DEFAULT_SETTINGS, MAX_ROWS, GemvSettings, gemv, gemv_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BOUND = 2.0**-7


def _check(x, w, settings=None):
    y = gemv(x, w, settings=settings)
    ref = gemv_ref(x, w)
    assert y.shape == ref.shape and y.dtype == x.dtype
    err = (y.float() - ref.float()).abs().max().item()
    assert err <= BOUND * ref.float().abs().max().item(), err


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", range(1, MAX_ROWS + 1))
def test_small_shapes(m, dtype):
    """N not a multiple of the row block; K even and uneven to the reduction tile; x rows strided."""
    g = torch.Generator().manual_seed(m)
    s = GemvSettings(block_n=8, block_k=128, warps=4, stages=1)
    for n, k in ((37, 256), (16, 300)):
        x = torch.randn(m, k + 8, generator=g).to(dtype)[:, :k]  # row stride k + 8
        w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
        _check(x.to(DEV), w.to(DEV), s)


@pytest.mark.parametrize("m", sorted(DEFAULT_SETTINGS))
def test_default_settings_uneven_k(m):
    """The tiles the head runs on (4 rows x 512 / 1024), K past a whole tile and not a multiple of it."""
    g = torch.Generator().manual_seed(10 + m)
    x = torch.randn(m, 1100, generator=g).to(torch.bfloat16)
    w = (torch.randn(21, 1100, generator=g) * 0.05).to(torch.bfloat16)
    _check(x.to(DEV), w.to(DEV))


def test_rows_are_independent():
    """Each token's output is its own: changing token 1 leaves token 0's row bit for bit."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 256, generator=g).to(torch.bfloat16).to(DEV)
    w = (torch.randn(24, 256, generator=g) * 0.05).to(torch.bfloat16).to(DEV)
    s = GemvSettings(block_n=8, block_k=128)
    y = gemv(x, w, settings=s)
    x2 = x.clone()
    x2[1] = -x2[1]
    assert torch.equal(gemv(x2, w, settings=s)[0], y[0])


def test_bad_shapes_are_refused():
    w = torch.zeros(8, 64, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="M=5"):
        gemv(torch.zeros(5, 64, dtype=torch.bfloat16, device=DEV), w)
    with pytest.raises(ValueError, match="x @ w.T"):
        gemv(torch.zeros(1, 32, dtype=torch.bfloat16, device=DEV), w)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(200064, 6144), (9856, 6144), (6144, 3072)])
def test_real_width_default_settings(n, k):
    """M3's LM head (200,064 x 6144) and two linear shapes at 1-4 tokens on the default settings."""
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = torch.randn(n, k, device="cuda", generator=g).to(torch.bfloat16) * 0.02
    for m in range(1, MAX_ROWS + 1):
        _check(torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16), w)
