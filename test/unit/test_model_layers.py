"""The CUDA fast paths of the model's small layers against the torch path (their reference).

On CUDA in bf16 the MoE router multiplies the fp32 weight's three bf16 parts in one bf16 product into
fp32 (``Router``), checked against an fp64 product: within 2^-19 of the largest logit up to 16 tokens
(SGLang's router GEMV, fp32 sums) and 2^-15 beyond (tensor cores accumulate fp32 with truncated
alignment), far inside what casting the weight to bf16 (SGLang's M3) costs. The attention layer norms
and rotates q / k with SGLang's fused kernel over our cos/sin table, and the MLPs take SGLang's compiled
SwiGLU-OAI; fp32 and CPU take the torch path (``GemmaNorm`` + ``PartialNeoxRope``, ``swiglu_oai``),
which the token-exact tests pin to transformers. Fresh random inputs; bf16 tolerance: the reference
computes in fp32 from the same bf16 inputs, so the fast path may differ by its bf16 roundings (atol
3e-2, rtol 1e-2).
"""

from __future__ import annotations

import pytest
import torch
from sglang_m3.model.layers import (
    FUSED_HEAD_DIM,
    FUSED_ROTARY_DIM,
    PartialNeoxRope,
    Router,
    fused_qk_norm_rope,
    split_bf16,
    swiglu,
    swiglu_oai,
)

THETA, EPS = 5_000_000.0, 1e-6
BF16 = dict(atol=3e-2, rtol=1e-2)


def norm_rope_reference(x, groups, rope, positions, eps):
    """What the torch path does per head group: Gemma RMS norm in fp32, then the partial NeoX rotation."""
    T, D = x.shape[0], FUSED_HEAD_DIM
    heads = x.float().view(T, -1, D).clone()
    cos, sin = rope.cos_sin(positions)
    for weight, first, count in groups:
        h = heads[:, first : first + count]
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())
        heads[:, first : first + count] = rope(h, cos, sin)
    return heads.view(T, -1)


def test_cos_sin_table_rows_are_the_rope_angles():
    rope = PartialNeoxRope(FUSED_ROTARY_DIM, THETA)
    table = rope.cos_sin_table(4096)
    positions = torch.tensor([0, 1, 77, 4095])
    cos, sin = rope.cos_sin(positions)
    assert table.shape == (4096, FUSED_ROTARY_DIM) and table.dtype == torch.float32
    torch.testing.assert_close(table[positions], torch.cat((cos[:, 0], sin[:, 0]), dim=-1), atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("q_heads, kv_heads", [(16, 1), (64, 4), (1, 1)])
@pytest.mark.parametrize("with_index", [False, True])
def test_fused_norm_rope_matches_torch_path(q_heads, kv_heads, with_index):
    """Main-attention layout ``[q | k | v]`` (v untouched), and with the indexer's heads after it,
    ``[q | k | v | index q | index k]`` in one launch (what a sparse layer's one qkv + index GEMM gives:
    ``M3Attention.fuse_qkv_index``)."""
    torch.manual_seed(q_heads)
    device = "cuda"
    rope = PartialNeoxRope(FUSED_ROTARY_DIM, THETA).to(device)
    table = rope.cos_sin_table(1 << 20)
    T = 37
    positions = torch.randint(0, 1 << 20, (T,), device=device)
    index_heads = kv_heads + 1 if with_index else 0  # one index q head per KV group, one shared index k
    x = torch.randn(T, (q_heads + 2 * kv_heads + index_heads) * FUSED_HEAD_DIM, device=device).to(torch.bfloat16)
    wq, wk, wiq, wik = ((0.5 * torch.randn(FUSED_HEAD_DIM, device=device)).to(torch.bfloat16) for _ in range(4))
    groups = [(wq, 0, q_heads), (wk, q_heads, kv_heads)]
    if with_index:
        first = q_heads + 2 * kv_heads
        groups += [(wiq, first, kv_heads), (wik, first + kv_heads, 1)]
    want = norm_rope_reference(x, groups, rope, positions, EPS)
    got = x.clone()
    fused_qk_norm_rope(got, groups, table, positions, EPS)
    torch.testing.assert_close(got.float(), want, **BF16)
    v = slice((q_heads + kv_heads) * FUSED_HEAD_DIM, (q_heads + 2 * kv_heads) * FUSED_HEAD_DIM)
    assert torch.equal(got[:, v], x[:, v])  # v heads untouched


@pytest.mark.gpu
def test_compiled_swiglu_matches_torch_path():
    torch.manual_seed(0)
    gate_up = (4 * torch.randn(33, 2 * 512, device="cuda")).to(torch.bfloat16)  # beyond the limit too
    want = swiglu_oai(gate_up.float(), 1.702, 7.0)
    torch.testing.assert_close(swiglu(gate_up, 1.702, 7.0).float(), want, **BF16)


@pytest.mark.parametrize("scale", [1e-20, 0.02, 3.0, 1e30])
def test_split_bf16_parts_sum_to_the_fp32_weight_exactly(scale):
    torch.manual_seed(1)
    weight = torch.randn(128, 257) * scale
    parts = split_bf16(weight)
    assert parts.dtype == torch.bfloat16 and parts.shape == (3 * 128, 257)
    hi, mid, lo = parts.float().view(3, 128, 257)
    assert torch.equal((hi + mid) + lo, weight)
    assert not torch.equal(hi, weight)  # one part alone is not enough: the split did something


def test_router_loads_and_checks_the_released_shape():
    torch.manual_seed(2)
    router = Router(64, 8, split=False)
    weight = torch.randn(8, 64)
    router.weight.weight_loader(router.weight, weight)
    x = torch.randn(5, 64).to(torch.bfloat16)
    torch.testing.assert_close(router(x), x.float() @ weight.t(), atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"router weight shape=\(64, 8\): expected \(8, 64\)"):
        router.weight.weight_loader(router.weight, weight.t())


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 4, 16, 17, 64, 300])
def test_split_router_is_the_fp32_product(tokens):
    torch.manual_seed(tokens)
    hidden, experts = 6144, 128  # the released router
    weight = torch.randn(experts, hidden, device="cuda") * 0.02
    x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
    with torch.device("cuda"):
        router = Router(hidden, experts, split=True)
    router.weight.weight_loader(router.weight, weight.cpu())
    logits = router(x)
    want = x.double() @ weight.double().t()
    err = (logits.double() - want).abs().max().item()
    bf16_cast = (x.double() @ weight.to(torch.bfloat16).double().t() - want).abs().max().item()
    assert logits.dtype == torch.float32
    assert router.gemv == (torch.cuda.get_device_capability()[0] >= 9)  # SGLang's router GEMV: sm_90+
    if router.gemv and tokens <= Router.GEMV_TOKENS:
        # the GEMV's fp32 sums on CUDA cores: a few fp32 roundings of the largest logit
        assert err < want.abs().max().item() * 2**-19, (err, want.abs().max().item())
        # and a token's logits are its own, whatever else is in the batch
        assert torch.equal(router(x[-1:]), logits[-1:])
    # Hopper's tensor cores add fp32 products with truncated alignment, not IEEE: ~2^-17 of the largest
    # logit (cuBLAS's fp32 GEMV: ~2^-21), where the bf16 weight is off by ~2^-8
    assert err < want.abs().max().item() * 2**-15 and err < bf16_cast / 200, (err, bf16_cast)
