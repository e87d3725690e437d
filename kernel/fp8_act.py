"""Per-token FP8 activations made by the kernel that computes them, for the FP8 GEMM after it.

An FP8 linear layer whose weight has one scale per row (``--quantization fp8`` on CUTLASS) takes its
input as e4m3 with one fp32 scale per token; made separately that is one more launch before each
GEMM. These kernels write it as they compute the value:

* ``add_rmsnorm_fp8``: ``residual += x`` (in place, when given), ``y = s / rms(s) * (offset + w)``
  over the sum ``s``, rounded to ``x``'s dtype (``offset`` 1: M3's Gemma norm; 0: plain RMSNorm);
  returns the quantised ``y`` and, with ``keep=True``, ``y`` itself (for layers that read it
  unquantised, such as the MoE router).
* ``swiglu_fp8``: M3's clamped SwiGLU of ``[gate | up]`` (``swiglu_oai_ref``), rounded to the input's
  dtype, then quantised.

Per-token quantisation (``quantise_rows_ref``): ``scale = max(|y|) / 448`` per row in fp32 (a zero row
gets ``FP8_TINY``), ``q = e4m3(y / scale)`` rounded to nearest even; ``q * scale`` is ``y`` within
half an e4m3 step. One program per row, launched with PDL where the GPU has it (``pdl.py``); nothing here
knows about SGLang.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv_quant import _e4m3_round
from .pdl import INTERPRET, gdc_launch_dependents, gdc_wait, use_pdl

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_TINY = 1e-12  # the scale of an all-zero row (its codes are 0 whatever the scale)


# ----------------------------------------------------------------------------- references
def quantise_rows_ref(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, N]`` -> (e4m3 ``[T, N]``, fp32 scales ``[T, 1]``)."""
    scale = (y.float().abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=FP8_TINY)
    q = (y.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def add_rmsnorm_ref(x, residual, weight, eps: float, offset: float):
    """(``y`` in ``x.dtype``, the new residual or ``None``); ``residual`` is not modified."""
    s = x.float() if residual is None else x.float() + residual.float()
    new_residual = None if residual is None else s.to(residual.dtype)
    y = s * torch.rsqrt(s.pow(2).mean(dim=-1, keepdim=True) + eps) * (offset + weight.float())
    return y.to(x.dtype), new_residual


def swiglu_oai_ref(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """``[T, 2I]`` (gate then up) -> ``[T, I]`` in the input's dtype:
    ``g = min(gate, limit); u = clamp(up, -limit, limit); g * sigmoid(alpha g) * (u + 1)``."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (gate * torch.sigmoid(gate * alpha) * (up + 1.0)).to(gate_up.dtype)


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _quantise_row(y, cols, mask, q_ptr, scale_ptr, row, EMULATE_RNE: tl.constexpr):
    """``y``: one row rounded to the activation dtype, held in fp32; ``q_ptr``: that row's start. The cast
    to e4m3 rounds to nearest even on the GPU; Triton's CPU interpreter does not (``EMULATE_RNE``)."""
    scale = tl.maximum(tl.max(tl.where(mask, tl.abs(y), 0.0), axis=0) / 448.0, 1e-12)
    q = tl.clamp(tl.math.div_rn(y, scale), -448.0, 448.0)
    if EMULATE_RNE:
        q = _e4m3_round(q)
    tl.store(q_ptr + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


@triton.jit
def _add_rmsnorm_fp8_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    y_ptr,
    q_ptr,
    scale_ptr,
    N,
    stride_x,
    stride_r,
    stride_y,
    stride_q,
    eps,
    offset,
    HAS_RES: tl.constexpr,
    KEEP: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # a weight: no kernel before writes it
    gdc_wait(PDL)
    s = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r_ptrs = res_ptr + row * stride_r + cols
        s += tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(r_ptrs, s.to(res_ptr.dtype.element_ty), mask=mask)
    inv = tl.math.rsqrt(tl.sum(s * s, axis=0) / N + eps)
    y = (s * inv * (offset + w)).to(x_ptr.dtype.element_ty)
    if KEEP:
        tl.store(y_ptr + row * stride_y + cols, y, mask=mask)
    _quantise_row(y.to(tl.float32), cols, mask, q_ptr + row * stride_q, scale_ptr, row, EMULATE_RNE)
    gdc_launch_dependents(PDL)


@triton.jit
def _swiglu_fp8_kernel(
    gu_ptr,
    q_ptr,
    scale_ptr,
    N,
    stride_gu,
    stride_q,
    alpha,
    limit,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    gdc_wait(PDL)
    gate = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_gu + N + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.minimum(gate, limit)
    up = tl.clamp(up, -limit, limit)
    y = (gate * tl.sigmoid(gate * alpha) * (up + 1.0)).to(gu_ptr.dtype.element_ty)
    _quantise_row(y.to(tl.float32), cols, mask, q_ptr + row * stride_q, scale_ptr, row, EMULATE_RNE)
    gdc_launch_dependents(PDL)


# ----------------------------------------------------------------------------- launchers
def _outputs(rows: int, cols: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=device),
        torch.empty(rows, 1, dtype=torch.float32, device=device),
    )


def _launch(device: torch.device, block: int) -> dict:
    """Launch settings: warps for a row of ``block``; programmatic dependent launch where supported
    (``pdl.py``: the launch and the weight load overlap the previous kernel's tail)."""
    pdl = use_pdl(device)
    return dict(
        BLOCK=block,
        PDL=pdl,
        EMULATE_RNE=INTERPRET,
        num_warps=max(4, min(16, block // 512)),
        **(dict(launch_pdl=True) if pdl else {}),
    )


def add_rmsnorm_fp8(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, offset: float, keep: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``x [T, N]`` (rows contiguous), ``residual`` like ``x`` or ``None`` (updated in place) ->
    ``(q [T, N] e4m3, scale [T, 1] fp32, y [T, N] or None)``."""
    rows, n = x.shape
    q, scale = _outputs(rows, n, x.device)
    y = torch.empty_like(x) if keep else q  # ``q`` stands in for an unused pointer
    if rows:
        _add_rmsnorm_fp8_kernel[(rows,)](
            x,
            x if residual is None else residual,
            weight,
            y,
            q,
            scale,
            n,
            x.stride(0),
            x.stride(0) if residual is None else residual.stride(0),
            y.stride(0),
            q.stride(0),
            eps,
            offset,
            HAS_RES=residual is not None,
            KEEP=keep,
            **_launch(x.device, triton.next_power_of_2(n)),
        )
    return q, scale, (y if keep else None)


def swiglu_fp8(gate_up: torch.Tensor, alpha: float, limit: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, 2I]`` (gate then up, rows contiguous) -> ``(q [T, I] e4m3, scale [T, 1] fp32)``."""
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    q, scale = _outputs(rows, n, gate_up.device)
    if rows:
        _swiglu_fp8_kernel[(rows,)](
            gate_up,
            q,
            scale,
            n,
            gate_up.stride(0),
            q.stride(0),
            alpha,
            limit,
            **_launch(gate_up.device, triton.next_power_of_2(n)),
        )
    return q, scale
