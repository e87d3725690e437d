"""SGLang's Triton block-FP8 kernels with the tiny block-FP8 copy's 32 x 32 blocks.

The tiny copy's linears run ``w8a8_block_fp8_matmul_triton`` (``sglang_m3.quant.keep_block_fp8_on_triton``)
and its MoE the Triton fused MoE kernel: fp8 activations with one scale per 32 of a token's values, fp8
weights with one per 32 x 32 block. Against the product of the dequantised operands in fp32 at every tiny
linear's and expert GEMM's shape; Triton's interpreter on CPU, compiled on CUDA.
"""

from __future__ import annotations

import pytest
import torch
import triton.language as tl

# Imported at collection, while test/conftest.py has Triton's interpreter on (no CUDA): Triton fixes
# interpreted vs compiled when a kernel is decorated, and test/e2e's engines run with it off.
from sglang.kernels.ops.moe.fused_moe_triton_kernels import invoke_fused_moe_kernel
from sglang.kernels.ops.quantization import fp8_kernel
from sglang_m3.tiny.fp8 import TINY_BLOCK, dequantize_block, quantize_block

# (out, in) of the tiny M3's quantised linears: qkv / dense gate_up, o_proj, dense down, shared gate_up, shared down
SHAPES = [(192, 64), (64, 128), (64, 96), (64, 64), (64, 32)]


@pytest.mark.parametrize("n, k", SHAPES)
def test_triton_block_fp8_gemm_takes_32x32_blocks(n, k, monkeypatch):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":  # the tuned-config lookup reads the GPU's name
        monkeypatch.setattr(fp8_kernel, "get_w8a8_block_fp8_configs", lambda *args: None)
    gen = torch.Generator().manual_seed(n * 1000 + k)
    x, w = torch.randn(7, k, generator=gen), torch.randn(n, k, generator=gen) / k**0.5
    qx, sx = quantize_block(x, (1, TINY_BLOCK[1]))  # per-token-group activations, as SGLang quantises them
    qw, sw = quantize_block(w, TINY_BLOCK)
    want = dequantize_block(qx, sx, (1, TINY_BLOCK[1])) @ dequantize_block(qw, sw, TINY_BLOCK).T
    got = fp8_kernel.w8a8_block_fp8_matmul_triton(
        *(t.to(device) for t in (qx, qw, sx, sw)), list(TINY_BLOCK), output_dtype=torch.float32
    )
    torch.testing.assert_close(got.cpu(), want, atol=1e-4 * want.abs().max().item(), rtol=1e-4)


def _align(topk_ids: torch.Tensor, experts: int, block_m: int):
    """What SGLang's ``moe_align_block_size`` gives the kernel: each expert's (token, slot) rows padded to
    ``block_m`` with the sentinel ``topk_ids.numel()``, the expert of each ``block_m`` rows, their count."""
    flat = topk_ids.flatten()
    rows, owners = [], []
    for e in range(experts):
        hit = (flat == e).nonzero().flatten()
        if len(hit):
            padded = torch.full((-(-len(hit) // block_m) * block_m,), flat.numel())
            padded[: len(hit)] = hit
            rows.append(padded)
            owners += [e] * (len(padded) // block_m)
    sorted_ids = torch.cat(rows).int()
    return sorted_ids, torch.tensor(owners, dtype=torch.int32), torch.tensor([len(sorted_ids)], dtype=torch.int32)


@pytest.mark.parametrize("n, k", [(64, 64), (64, 32)])  # the tiny MoE's w13 [E, 2I, H] and w2 [E, H, I]
def test_triton_fused_moe_kernel_takes_32x32_blocks(n, k):
    """The fused MoE GEMM (both of the tiny MoE's shapes) with 32 x 32 weight blocks, fed pre-quantised
    per-token-group activations, against each routed (token, slot)'s dequantised product."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    experts, tokens, top_k = 8, 9, 2
    gen = torch.Generator().manual_seed(n + k)
    x, w = torch.randn(tokens, k, generator=gen), torch.randn(experts, n, k, generator=gen) / k**0.5
    qx, sx = quantize_block(x, (1, TINY_BLOCK[1]))
    qw, sw = zip(*(quantize_block(w[e], TINY_BLOCK) for e in range(experts)))
    qw, sw = torch.stack(qw), torch.stack(sw)  # [E, n, k] fp8, [E, n / 32, k / 32]
    topk_ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).int()
    config = {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": TINY_BLOCK[0], "BLOCK_SIZE_K": TINY_BLOCK[1], "GROUP_SIZE_M": 32}
    sorted_ids, expert_ids, padded = _align(topk_ids, experts, config["BLOCK_SIZE_M"])
    out = torch.zeros(tokens * top_k, n, device=device)
    invoke_fused_moe_kernel(
        *(t.to(device) for t in (qx, qw)),
        None,
        out,
        sx.to(device),
        sw.to(device),
        None,
        torch.ones(tokens, top_k, device=device),
        topk_ids.to(device),
        *(t.to(device) for t in (sorted_ids, expert_ids, padded)),
        mul_routed_weight=False,
        top_k=top_k,
        config=config,
        compute_type=tl.float32,
        use_fp8_w8a8=True,
        use_int8_w8a8=False,
        use_int8_w8a16=False,
        use_int4_w4a16=False,
        per_channel_quant=False,
        block_shape=list(TINY_BLOCK),
    )
    xd = dequantize_block(qx, sx, (1, TINY_BLOCK[1]))
    want = torch.stack(
        [xd[t // top_k] @ dequantize_block(qw[e], sw[e], TINY_BLOCK).T for t, e in enumerate(topk_ids.flatten())]
    )
    torch.testing.assert_close(out.cpu(), want, atol=1e-4 * want.abs().max().item(), rtol=1e-4)
