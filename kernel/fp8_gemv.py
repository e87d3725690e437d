"""Weight-only FP8 GEMV for a few tokens: ``y = (x @ w.T) * scale``, ``w`` e4m3 with one fp32 scale per row.

At one to a few tokens a linear layer is a stream of its weight bytes; a GEMM's tiles, built for many
rows, leave part of that stream idle. Here each program owns ``BLOCK_N`` weight rows (output columns)
and walks the whole reduction dimension: it reads its ``[BLOCK_N, BLOCK_K]`` e4m3 tiles, widens them to
the activation's dtype (exact: every e4m3 value is a bf16 / fp16 value) and multiplies them on the
tensor cores against the activation rows padded to ``BLOCK_M`` (the weight on the dot's wide side, so
a 16-row dot serves 1 to ``BLOCK_M`` tokens); fp32 accumulation, the row scale applied once at the end.
No split-K: every output is one program's sum, in a fixed order (the result does not depend on the
grid or on the other rows of the batch).

The activation is not quantised (SGLang's w8a8 GEMM rounds it to e4m3 per token first): the product
is the weight-only one, ``fp8_gemv_ref``. Weight layout: ``w[N, K]`` with unit stride along ``K`` (SGLang's
FP8 linear keeps ``weight.t()`` of exactly that). Nothing here knows about SGLang.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import gdc_launch_dependents, gdc_wait, use_pdl

MAX_TOKENS = 16  # the activation rows one dot holds (BLOCK_M)


def fp8_gemv_ref(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [M, K]``, ``w [N, K]`` e4m3, ``scale`` (N fp32 values, any shape) -> ``[M, N]`` in ``x.dtype``:
    ``sum_k x[m, k] * float(w[n, k])`` in fp32, times ``scale[n]``."""
    return ((x.float() @ w.float().t()) * scale.reshape(1, -1).float()).to(x.dtype)


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    toks = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_K)
    row_ok = rows < N
    tok_ok = toks < M
    w_ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_wn + cols[None, :]
    x_ptrs = x_ptr + toks[:, None] * stride_xm + cols[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    gdc_wait(PDL)  # the activation is the previous kernel's output (the weight is not, but one wait is simpler)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, mask=row_ok[:, None], other=0.0)
            x = tl.load(x_ptrs, mask=tok_ok[:, None], other=0.0)
        else:
            k_ok = (k0 + cols) < K
            w = tl.load(w_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=tok_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(w.to(x.dtype), tl.trans(x), acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    gdc_launch_dependents(PDL)
    s = tl.load(scale_ptr + rows, mask=row_ok, other=0.0)
    y = acc * s[:, None]
    y_ptrs = y_ptr + toks[None, :] * stride_ym + rows[:, None]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & tok_ok[None, :])


def fp8_gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    *,
    block_n: int = 16,
    block_k: int = 512,
    num_warps: int = 4,
    num_stages: int = 4,
) -> torch.Tensor:
    """``fp8_gemv_ref`` on the GPU for ``x [M, K]`` bf16 / fp16 with ``M <= MAX_TOKENS``, ``w [N, K]`` e4m3
    (unit stride along ``K``), ``scale``: ``N`` contiguous fp32 values (``[N]``, ``[N, 1]`` or ``[1, N]``)."""
    M, K = x.shape
    N = w.shape[0]
    if not 1 <= M <= MAX_TOKENS:
        raise ValueError(f"x.shape[0]={M}: fp8_gemv takes 1 to {MAX_TOKENS} tokens")
    if w.shape[1] != K or w.dtype != torch.float8_e4m3fn or w.stride(1) != 1:
        raise ValueError(f"w: shape {tuple(w.shape)}, {w.dtype}, strides {w.stride()}; want [N, {K}] e4m3, K stride 1")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"x.dtype={x.dtype}: fp8_gemv takes bf16 / fp16 activations")
    if scale.numel() != N or not scale.is_contiguous() or scale.dtype != torch.float32:
        raise ValueError(f"scale: {scale.numel()} values, dtype {scale.dtype}; want {N} contiguous fp32")
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    pdl = use_pdl(x.device)
    _fp8_gemv_kernel[(triton.cdiv(N, block_n),)](
        x,
        w,
        scale,
        y,
        M,
        N,
        K,
        x.stride(0),
        w.stride(0),
        y.stride(0),
        BLOCK_M=MAX_TOKENS,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_K=K % block_k == 0,
        PDL=pdl,
        num_warps=num_warps,
        num_stages=num_stages,
        **(dict(launch_pdl=True) if pdl else {}),
    )
    return y
