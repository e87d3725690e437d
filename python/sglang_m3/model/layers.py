"""Small M3 building blocks that SGLang's own layers get wrong for M3 or cannot run on CPU.

* ``PartialNeoxRope``: SGLang's ``get_rope`` dispatches to CUDA-only kernels even
  when the model runs on CPU (seen with 0.5.17); M3 rotates only the first
  ``rotary_dim`` of each head (NeoX pairing) and passes the rest through. On CUDA in
  bf16 the attention layer uses SGLang's fused norm + RoPE kernel instead
  (``fused_qk_norm_rope``), over the table ``cos_sin_table`` builds.
* ``swiglu_oai``: the clamped SwiGLU of MiniMax-M3 / GPT-OSS with gate and up
  *not* interleaved; SGLang's native ``silu`` MoE path ignores alpha/limit. On CUDA in
  half precision ``swiglu`` hands it to SGLang's compiled one (what its M3 MLP uses).
* ``Router``: the MoE router's fp32 logits. SGLang's M3 casts the released fp32 weight to
  bf16 (``SGLANG_OPT_USE_BF16_ROUTER_GEMM``), which moves near-tied routing decisions; an
  fp32 linear layer converts the hidden state every layer and runs cuBLAS's slow fp32 GEMV.
* ``GemmaNorm`` / ``RMSNorm``: SGLang's norms on CUDA call sgl-kernel, which
  dispatches half types only; fp32 runs (the token-exact checks) take their own
  native path instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from sglang.srt.layers import layernorm
from torch import nn


class _Fp32Native:
    def forward_cuda(self, x, residual=None, post_residual_addition=None):
        if x.dtype == torch.float32:
            return self.forward_native(x, residual, post_residual_addition)
        return super().forward_cuda(x, residual, post_residual_addition)


class GemmaNorm(_Fp32Native, layernorm.GemmaRMSNorm):
    """``x / rms(x) * (1 + w)`` (M3)."""


class RMSNorm(_Fp32Native, layernorm.RMSNorm):
    """``x / rms(x) * w`` (the Llama-style EAGLE3 draft)."""


SPLIT_PARTS = 3  # bf16 keeps 8 of fp32's 24 significand bits: three parts hold all of them


def split_bf16(weight: torch.Tensor) -> torch.Tensor:
    """fp32 ``[N, K]`` -> bf16 ``[3 N, K]``: three ``[N, K]`` parts whose sum is ``weight`` exactly, each
    the bf16 rounding of what the parts before it left (a rounding's remainder is exact in fp32; exact
    while no part falls below fp32's normal range, ~1e-38, i.e. for weights above ~1e-30)."""
    parts, rest = [], weight.float()
    for _ in range(SPLIT_PARTS):
        parts.append(rest.to(torch.bfloat16))
        rest = rest - parts[-1].float()
    return torch.cat(parts)


class Router(nn.Module):
    """``x W^T`` in fp32 for the released fp32 router weight ``W [E, H]`` (DESIGN section 4), replicated.

    fp32 and CPU models hold ``W`` and multiply in fp32. CUDA bf16 models hold it as ``split_bf16``'s
    three parts (the checkpoint's tensor is split as it loads) and take the logits from one bf16 product
    with fp32 output over them plus a sum of the three: no conversion of ``x`` and no fp32 GEMV.
    bf16 x bf16 products are exact in fp32. Up to ``GEMV_TOKENS`` tokens (decode, verify) the product is
    SGLang's router GEMV (``dsv3_router_gemm``, sm_90+, for 256 / 384 rows and a hidden size a multiple
    of 1024: the released 128 experts' three parts are 384 rows): one launch where cuBLAS runs a split-K
    GEMM and its reduction, fp32 sums on CUDA cores (~2^-21 of the largest logit), and a token's logits
    do not depend on the others in its batch. Longer batches (prefill) take cuBLAS's tensor cores, which
    add with truncated alignment (~2^-17; a bf16 cast of the weight, as SGLang's M3 runs, ~2^-8)."""

    GEMV_TOKENS = 16  # dsv3_router_gemm's largest token count

    def __init__(self, hidden_size: int, num_experts: int, split: bool):
        super().__init__()
        self.split, self.num_experts = split, num_experts
        self.shape = (num_experts, hidden_size)
        if split:
            shape, dtype = (SPLIT_PARTS * num_experts, hidden_size), torch.bfloat16
        else:
            shape, dtype = self.shape, torch.float32
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.load_weight
        self.gemv = split and router_gemv_fits(shape)

    def load_weight(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if tuple(loaded.shape) != self.shape:
            raise ValueError(f"router weight shape={tuple(loaded.shape)}: expected {self.shape} (experts, hidden)")
        param.data.copy_(split_bf16(loaded.to(param.device)) if self.split else loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, H]`` -> fp32 logits ``[T, E]``."""
        if self.split:
            if self.gemv and 0 < x.shape[0] <= self.GEMV_TOKENS:
                from sglang.kernels.ops.gemm.dsv3_router_gemm import dsv3_router_gemm

                parts = dsv3_router_gemm(x.contiguous(), self.weight, out_dtype=torch.float32)
            else:
                parts = torch.mm(x, self.weight.t(), out_dtype=torch.float32)  # [T, 3E]
            return parts.view(x.shape[0], SPLIT_PARTS, self.num_experts).sum(1)
        return F.linear(x.float(), self.weight)


def router_gemv_fits(shape: tuple[int, int]) -> bool:
    """Whether SGLang's router GEMV takes a split weight of ``shape`` on this process's GPU."""
    rows, hidden = shape
    return rows in (256, 384) and hidden % 1024 == 0 and torch.cuda.get_device_capability()[0] >= 9


def split_router(dtype: torch.dtype) -> bool:
    """Whether ``Router`` holds the split weight: CUDA models in bf16 (decided at start-up, under the
    model's default device; ``torch.mm``'s ``out_dtype`` is CUDA-only)."""
    return torch.get_default_device().type == "cuda" and dtype == torch.bfloat16


class PartialNeoxRope(nn.Module):
    """Rotary embedding on ``x[..., :rotary_dim]`` (halves paired NeoX-style), rest untouched."""

    def __init__(self, rotary_dim: int, theta: float):
        super().__init__()
        self.rotary_dim = rotary_dim
        exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        self.register_buffer("inv_freq", 1.0 / (theta**exponent), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T]`` positions -> cos, sin ``[T, 1, rotary_dim / 2]`` in fp32."""
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]  # [T, rd/2]
        return freqs.cos()[:, None, :], freqs.sin()[:, None, :]

    def cos_sin_table(self, max_positions: int) -> torch.Tensor:
        """``[max_positions, rotary_dim]`` fp32, cos then sin of each position: the layout of SGLang's
        ``RotaryEmbedding.cos_sin_cache``, which its fused RoPE kernels read."""
        positions = torch.arange(max_positions, dtype=torch.float32, device=self.inv_freq.device)
        cos, sin = self.cos_sin(positions)
        return torch.cat((cos[:, 0], sin[:, 0]), dim=-1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x``: ``[T, heads, head_dim]``."""
        half = self.rotary_dim // 2
        x1 = x[..., :half].float()
        x2 = x[..., half : self.rotary_dim].float()
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
        return torch.cat((rotated, x[..., self.rotary_dim :]), dim=-1)


def swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """``swiglu_oai``; on CUDA in half precision through SGLang's torch-compiled copy of it (one fused
    kernel instead of seven). fp32 stays eager, so token-exact runs keep torch's arithmetic."""
    if gate_up.is_cuda and gate_up.dtype != torch.float32:
        from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe import (
            swiglu_no_interleaved_with_alpha_and_limit,
        )

        return swiglu_no_interleaved_with_alpha_and_limit(gate_up, alpha, limit)
    return swiglu_oai(gate_up, alpha, limit)


def fused_qk_norm_rope(
    x: torch.Tensor,
    groups: list[tuple[torch.Tensor, int, int]],
    cos_sin_table: torch.Tensor,
    positions: torch.Tensor,
    eps: float,
) -> None:
    """In place on ``x [T, heads * 128]``: each group ``(gemma_weight [128], first head, head count)`` is
    Gemma-RMS-normed and its first 64 dims rotated (NeoX). SGLang's JIT CUDA kernel, the one its own M3
    path uses (one launch for up to 4 groups; built for head_dim 128 / 64 rotary dims only)."""
    from sglang.kernels.ops.attention.minimax_qknorm_rope import minimax_qknorm_rope_grouped

    minimax_qknorm_rope_grouped(x, groups, cos_sin_table, positions, eps)


FUSED_HEAD_DIM, FUSED_ROTARY_DIM = 128, 64  # the only shape ``fused_qk_norm_rope`` is built for


def swiglu_oai(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """``[..., 2I]`` (gate first, then up) -> ``[..., I]``:
    ``g = clamp(gate, max=limit); u = clamp(up, -limit, limit); g * sigmoid(alpha g) * (u + 1)``."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(gate * alpha) * (up + 1.0)
