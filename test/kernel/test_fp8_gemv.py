"""The weight-only FP8 GEMV (``sglang_m3_kernels.fp8_gemv``) against its reference, on fresh random inputs.

Each product ``x * float(w)`` is exact in fp32 (a bf16 / fp16 value times an e4m3 one has at most 12
significant bits) and both sides accumulate in fp32, so they differ by the summation order (~K x 2^-24 of
the sum of magnitudes) and the output's one rounding to the activation's dtype: 2^-8 relative for bf16,
2^-11 for fp16 (the CPU interpreter truncates where the GPU rounds, so twice that). Bounds below:
``rtol`` one such rounding (bf16: 2^-7 to cover the interpreter), ``atol`` 1e-3 of the output's scale for
the order. The CPU interpreter has no bf16 dot: it runs fp16 activations, the GPU both.

Also: a token's output does not depend on the other tokens in the call (bit for bit: each output is one
program's sum in a fixed order), ragged ``N`` / ``K`` are masked, and bad inputs are refused naming them.
"""

from __future__ import annotations

import pytest
import torch
from sglang_m3_kernels.fp8_gemv import MAX_TOKENS, fp8_gemv, fp8_gemv_ref

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DTYPES = [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]
RTOL = {torch.float16: 2**-10, torch.bfloat16: 2**-7}


def random_linear(n: int, k: int, gen: torch.Generator):
    """An e4m3 weight ``[n, k]`` with one fp32 scale per row, as SGLang's FP8 linear quantises a BF16 one."""
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen).add(0.1)
    scale = w.abs().amax(dim=1) / 448.0
    return (w / scale[:, None]).to(torch.float8_e4m3fn).to(DEV), scale.to(DEV)


def close(got, want):
    want = want.float()
    torch.testing.assert_close(got.float(), want, rtol=RTOL[got.dtype], atol=1e-3 * want.abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,block_k", [(1, 48, 1024, 256), (3, 37, 1000, 256), (MAX_TOKENS, 64, 512, 512)])
def test_matches_reference(dtype, m, n, k, block_k):
    gen = torch.Generator().manual_seed(m * 1000 + n)
    w, scale = random_linear(n, k, gen)
    x = torch.randn(m, k, generator=gen).to(DEV, dtype)
    y = fp8_gemv(x, w, scale, block_k=block_k)
    assert y.shape == (m, n) and y.dtype == dtype
    close(y, fp8_gemv_ref(x, w, scale))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_token_does_not_depend_on_the_others(dtype):
    gen = torch.Generator().manual_seed(7)
    w, scale = random_linear(40, 768, gen)
    x = torch.randn(MAX_TOKENS, 768, generator=gen).to(DEV, dtype)
    batched = fp8_gemv(x, w, scale, block_k=256)
    for row in (0, 5, MAX_TOKENS - 1):
        assert torch.equal(fp8_gemv(x[row : row + 1], w, scale, block_k=256), batched[row : row + 1])


def test_a_wrong_scale_or_weight_row_fails_the_bound():
    """The bound is tight enough to see one row's scale or weight off by a little."""
    gen = torch.Generator().manual_seed(8)
    w, scale = random_linear(32, 512, gen)
    x = torch.randn(2, 512, generator=gen).to(DEV, torch.float16)
    want = fp8_gemv_ref(x, w, scale)
    wrong_scale = scale.clone()
    wrong_scale[9] *= 1.01
    with pytest.raises(AssertionError):
        close(fp8_gemv(x, w, wrong_scale, block_k=256), want)
    wrong_w = w.float()
    wrong_w[20, 100] = -wrong_w[20, 100] if wrong_w[20, 100] != 0 else 448.0
    with pytest.raises(AssertionError):
        close(fp8_gemv(x, wrong_w.to(w.dtype), scale, block_k=256), want)


def test_bad_inputs_are_refused_naming_them():
    gen = torch.Generator().manual_seed(9)
    w, scale = random_linear(16, 256, gen)
    x = torch.randn(MAX_TOKENS + 1, 256, generator=gen).to(DEV, torch.float16)
    with pytest.raises(ValueError, match=r"x.shape\[0\]=17"):
        fp8_gemv(x, w, scale)
    with pytest.raises(ValueError, match="x.dtype=torch.float32"):
        fp8_gemv(x[:1].float(), w, scale)
    with pytest.raises(ValueError, match="w: shape"):
        fp8_gemv(x[:1], w.t().contiguous().t(), scale)  # K not unit stride
    with pytest.raises(ValueError, match="scale: 15 values"):
        fp8_gemv(x[:1], w, scale[:15])
