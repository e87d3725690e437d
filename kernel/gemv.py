"""``y = x @ w.T`` for a few rows of ``x`` (decode): a weight-streaming GEMV, beside its reference.

``x [M, K]`` (M <= ``MAX_ROWS``), ``w [N, K]`` row-major, both bf16 or fp16; fp32 sums, ``y [M, N]`` in
``x``'s dtype. One program per ``BLOCK_N`` weight rows walks the whole reduction (no split-K, so no
second reduction launch), loading each weight tile once for all M rows. The weight never depends on
the kernel launched before, so with programmatic dependent launch (``pdl.py``) a program loads its
first weight tile before it waits for that kernel; ``x`` is read after the wait.

Written for M3's LM head (200,064 x 6144 bf16, 2.46 GB a decode step): on an H100 at one token cuBLAS
reads it at 1.03x its bytes over the device-copy rate, this GEMV at 0.95x (4 weight rows x 1024 a
program); at two tokens 1.02x against 1.03x, at four 1.30x against 1.04x. ``DEFAULT_SETTINGS`` holds
the best tiles found at one and two tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .pdl import gdc_launch_dependents, gdc_wait, use_pdl

MAX_ROWS = 4


@dataclass(frozen=True)
class GemvSettings:
    block_n: int = 8
    block_k: int = 512
    warps: int = 4
    stages: int = 1


# per row count: the best of 36 tiles on the LM head's shape (one H100); others take GemvSettings()
DEFAULT_SETTINGS = {1: GemvSettings(block_n=4, block_k=1024), 2: GemvSettings(block_n=4, block_k=512)}


def gemv_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 reference: ``(x @ w.T)`` rounded once to ``x``'s dtype."""
    return (x.float() @ w.float().t()).to(x.dtype)


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    M_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    PDL: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rm = tl.arange(0, M_P)
    m_ok = rm < M
    # rows past N re-read row N - 1 (in bounds, never stored) instead of masking every load
    w_ptrs = w_ptr + tl.minimum(rn, N - 1)[:, None].to(tl.int64) * stride_wn + rk[None, :]
    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
    if EVEN_K:
        w = tl.load(w_ptrs)
    else:
        w = tl.load(w_ptrs, mask=(rk < K)[None, :], other=0.0)
    gdc_wait(PDL)  # x may be the previous kernel's output
    acc = tl.zeros((M_P, BLOCK_N, BLOCK_K), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs + k0, mask=m_ok[:, None], other=0.0)
            w_next = tl.load(w_ptrs + k0 + BLOCK_K, mask=(k0 + BLOCK_K < K), other=0.0)
        else:
            x = tl.load(x_ptrs + k0, mask=m_ok[:, None] & (k0 + rk < K)[None, :], other=0.0)
            w_next = tl.load(w_ptrs + k0 + BLOCK_K, mask=(k0 + BLOCK_K + rk < K)[None, :], other=0.0)
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        w = w_next
    gdc_launch_dependents(PDL)
    y = tl.sum(acc, axis=2)  # [M_P, BLOCK_N]
    y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & (rn < N)[None, :])


def gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, settings: GemvSettings | None = None):
    """``x @ w.T`` for ``x [M <= MAX_ROWS, K]``, ``w [N, K]`` (unit stride along K)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"gemv: x {tuple(x.shape)} and w {tuple(w.shape)} do not make x @ w.T")
    M, K = x.shape
    N = w.shape[0]
    if not 1 <= M <= MAX_ROWS:
        raise ValueError(f"gemv: M={M} rows; the GEMV takes 1..{MAX_ROWS}")
    s = settings or DEFAULT_SETTINGS.get(M, GemvSettings())
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("gemv: x and w need unit stride along K")
    if out is None:
        out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    pdl = use_pdl(x.device)
    launch = dict(launch_pdl=True) if pdl else {}
    _gemv_kernel[(triton.cdiv(N, s.block_n),)](
        x,
        w,
        out,
        M,
        N,
        K,
        x.stride(0),
        w.stride(0),
        out.stride(0),
        M_P=triton.next_power_of_2(M),
        BLOCK_N=s.block_n,
        BLOCK_K=s.block_k,
        EVEN_K=K % s.block_k == 0,
        PDL=pdl,
        num_warps=s.warps,
        num_stages=s.stages,
        **launch,
    )
    return out
