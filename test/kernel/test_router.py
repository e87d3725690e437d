"""``router_logits``: fp32 router logits from a half-precision hidden state in one launch, against the
fp64 product of the same numbers (Triton's interpreter on CPU, natively on a GPU).

Bound: fp32 accumulation in any order is within ``1e-5 x sum_k |x_k w_k|`` of the exact sum for these
lengths (K <= 6144: the worst case is ~K * 2^-24 = 4e-4 relative, random-sign terms stay ~100x under
it). A wrong weight row, token row or chunk offset moves a logit by O(sqrt(K)), thousands of times
the bound.
"""

from __future__ import annotations

import pytest
import torch
from sglang_m3_kernels.router import ROUTER_KERNEL_MAX_TOKENS, router_logits, router_logits_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _check(tokens, hidden, experts, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w = torch.randn(experts, hidden, generator=g) * 0.02
    got = router_logits(x.to(DEV), w.to(DEV)).cpu()
    exact = x.double() @ w.double().T
    bound = 1e-5 * (x.double().abs() @ w.double().abs().T)
    assert got.dtype == torch.float32 and got.shape == (tokens, experts)
    assert ((got.double() - exact).abs() <= bound).all()
    assert torch.allclose(got, router_logits_ref(x, w), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("tokens", [1, 3, 8, 16, 37])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_router_logits_small_shapes(tokens, dtype):
    """Every tile shape the launcher picks (1 to 16 tokens a program, 1 to 4 experts), ragged token
    and expert counts, a hidden size that is no multiple of the chunk."""
    _check(tokens, 200, 22, dtype, seed=tokens)


def test_router_logits_m3_width():
    """M3's router: hidden 6144, 128 experts, a decode token."""
    _check(1, 6144, 128, torch.bfloat16, seed=7)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 32, 64, ROUTER_KERNEL_MAX_TOKENS])
def test_router_logits_m3_width_on_gpu(tokens):
    """M3's router at the decode batches the benchmarks run, natively."""
    _check(tokens, 6144, 128, torch.bfloat16, seed=tokens)


def test_router_logits_rejects_bad_input():
    x, w = torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(8, 64)
    with pytest.raises(ValueError, match="weight must be fp32"):
        router_logits(x, w.half())
    with pytest.raises(ValueError, match=r"x must be \[T, H\]"):
        router_logits(x, torch.zeros(8, 32))
    with pytest.raises(ValueError, match="out must be"):
        router_logits(x, w, out=torch.empty(2, 8, dtype=torch.bfloat16))
