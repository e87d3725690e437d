"""MoE router logits in fp32 from a half-precision hidden state: ``x.float() @ weight.T`` in one launch.

M3's router weight is fp32 and its routing runs in fp32 (DESIGN section 5; transformers computes
``F.linear(hidden.float(), gate.weight)``). Through torch that is a bf16 -> fp32 copy of the hidden
state, then cuBLAS's SIMT fp32 GEMM (no tensor cores for fp32 inputs) and its split-K reduction:
three launches, ~50 us a MoE layer at batch 32 in the real-width decode profile (H100), for 3 MB of
weight. Here one program per (``E_PER`` experts, ``BLOCK_T`` tokens) reads the weight rows once and
the hidden state in place, accumulating exact fp32 products (bf16 widens exactly) in a fixed order:
deterministic, and equal to the reference up to fp32 summation order. Meant for decode-sized token
counts; a prefill's thousands of tokens are a GEMM that cuBLAS does well (``ROUTER_KERNEL_MAX_TOKENS``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROUTER_KERNEL_MAX_TOKENS = 128  # decode up to 128 requests, a verify of 32 x 4 rows; above: one torch fp32 GEMM
_PRODUCTS = 8192  # fp32 products a program holds per step (BLOCK_T x E_PER x BLOCK_K): 64 registers a thread


def router_logits_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``[T, H]`` (any float dtype) x ``[E, H]`` fp32 -> ``[T, E]`` fp32, as transformers computes it."""
    return torch.nn.functional.linear(x.float(), weight.float())


@triton.jit
def _router_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    T,
    E,
    K,
    stride_xt,
    stride_we,
    stride_ot,
    BLOCK_T: tl.constexpr,
    E_PER: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.program_id(0) * E_PER + tl.arange(0, E_PER)
    t_ok, e_ok = t < T, e < E
    acc = tl.zeros([BLOCK_T, E_PER], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        # masked lanes load 0 (a masked load leaves them undefined otherwise): they add nothing
        x = tl.load(
            x_ptr + t[:, None].to(tl.int64) * stride_xt + k[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0
        )
        w = tl.load(w_ptr + e[:, None] * stride_we + k[None, :], mask=e_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w[None, :, :], axis=2)  # [BLOCK_T, E_PER]
    tl.store(out_ptr + t[:, None].to(tl.int64) * stride_ot + e[None, :], acc, mask=t_ok[:, None] & e_ok[None, :])


def router_logits(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` ``[T, H]`` bf16 / fp16 / fp32 (last dim contiguous), ``weight`` ``[E, H]`` fp32 (contiguous
    rows) -> ``[T, E]`` fp32 logits; ``out`` optional. Same result as :func:`router_logits_ref` up to
    fp32 summation order."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be [T, H] and weight [E, H], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if weight.dtype != torch.float32:
        raise ValueError(f"weight must be fp32 (the router runs in fp32), got {weight.dtype}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be bf16, fp16 or fp32, got {x.dtype}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight must be contiguous in their last dim")
    T, K = x.shape
    E = weight.shape[0]
    if out is None:
        out = torch.empty((T, E), dtype=torch.float32, device=x.device)
    elif out.shape != (T, E) or out.dtype != torch.float32 or out.stride(1) != 1:
        raise ValueError(f"out must be [{T}, {E}] fp32, contiguous in its last dim, got {tuple(out.shape)} {out.dtype}")
    if T == 0:
        return out
    # few tokens: one expert a program and long weight strides (the weight is the traffic); more
    # tokens: experts share each loaded hidden-state tile (the hidden state is re-read per program)
    block_t = min(triton.next_power_of_2(T), 16)
    e_per = max(1, block_t // 4)
    block_k = max(64, min(triton.next_power_of_2(K), _PRODUCTS // (block_t * e_per)))
    _router_kernel[(triton.cdiv(E, e_per), triton.cdiv(T, block_t))](
        x,
        weight,
        out,
        T,
        E,
        K,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        BLOCK_T=block_t,
        E_PER=e_per,
        BLOCK_K=block_k,
        num_warps=4,
    )
    return out
