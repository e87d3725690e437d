"""SGLang's Triton block-FP8 GEMM with the tiny block-FP8 copy's 32 x 32 blocks.

The tiny copy's linears run ``w8a8_block_fp8_matmul_triton`` (``sglang_m3.quant.keep_block_fp8_on_triton``):
fp8 activations with one scale per 32 of a token's values, fp8 weights with one per 32 x 32 block. Against
the product of the dequantised operands in fp32 at every tiny linear's shape; Triton's interpreter on CPU,
compiled on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from sglang_m3.tiny.fp8 import TINY_BLOCK, dequantize_block, quantize_block

# (out, in) of the tiny M3's quantised linears: qkv / dense gate_up, o_proj, dense down, shared gate_up, shared down
SHAPES = [(192, 64), (64, 128), (64, 96), (64, 64), (64, 32)]


@pytest.mark.parametrize("n, k", SHAPES)
def test_triton_block_fp8_gemm_takes_32x32_blocks(n, k, monkeypatch):
    from sglang.kernels.ops.quantization import fp8_kernel

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
