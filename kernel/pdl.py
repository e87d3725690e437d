"""Programmatic dependent launch (PDL, sm_90+) for this package's kernels, and the interpreter switch.

With PDL a kernel may start while the one launched before it on the stream is still running.
Every kernel of this package calls ``gdc_wait`` before its first read of anything the previous
kernel may have written, and ``gdc_launch_dependents`` once its main loop is done, so the next
kernel's launch and prologue overlap this one's tail. Environment switches (read once at import):

* ``SGLANG_M3_PDL=0`` turns PDL off (default on where the GPU supports it);
* ``TRITON_INTERPRET=1`` (Triton's CPU interpreter, set by the tests without CUDA) turns it off.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
_PDL = os.environ.get("SGLANG_M3_PDL", "1") != "0"


def use_pdl(device: torch.device) -> bool:
    """Whether launches on ``device`` use PDL: CUDA, compute capability >= 9, not switched off."""
    if not _PDL or INTERPRET or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


@triton.jit
def gdc_wait(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def gdc_launch_dependents(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
