"""The LM head's logits for one token on a weight-streaming GEMV (``sglang_m3_kernels.gemv``).

M3's head is 200,064 x 6144 (2.46 GB in bf16): at batch 1 it is over half of a decode step's bytes.
SGLang's ``LogitsProcessor`` computes it with ``torch.matmul`` (cuBLAS), which on an H100 reads it in
835 us a call, 1.03x its bytes over the device-copy rate; the GEMV takes 769 us, 0.95x (a graph of
back-to-back calls; ``kernel/gemv.py``). The decode step at batch 1 gains ~50 us (BF16 2.069 -> 2.016
ms, FP8 1.640 -> 1.595; ``benchmarks/e2e.md``); at two tokens it gained nothing. ``StreamedHeadMethod``
is SGLang's unquantised embedding method with its ``apply`` taking the GEMV for a bf16 / fp16 row on
CUDA; everything else (more rows, fp32, CPU, a bias) is SGLang's ``F.linear``.
SGLang's ``LogitsProcessor`` calls a head's ``quant_method.apply`` whenever the method is not one of
its unquantised ones, and reads the weight itself otherwise.
"""

from __future__ import annotations

import torch
from sglang.srt.layers.quantization.unquant import UnquantizedEmbeddingMethod
from sglang.srt.runtime_context import get_exec
from sglang_m3_kernels import gemv as gemv_kernel
from torch import nn

GEMV_ROWS = 1  # at 2 rows the step did not move (BF16 batch 2: 2.558 against 2.551 ms); at 4 cuBLAS wins
GEMV_DTYPES = (torch.bfloat16, torch.float16)


class StreamedHeadMethod(UnquantizedEmbeddingMethod):
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        w = layer.weight
        if bias is None and x.is_cuda and w.dtype in GEMV_DTYPES and x.dim() == 2 and 1 <= x.shape[0] <= GEMV_ROWS:
            return gemv_kernel.gemv(x.to(w.dtype).contiguous(), w)
        return super().apply(layer, x.to(w.dtype), bias)


def stream_head(head: nn.Module) -> bool:
    """Give ``head`` the GEMV ``apply`` when it carries SGLang's plain unquantised method and the
    logits processor is not asked for an fp32 head (``--enable-fp32-lm-head``: SGLang applies a head's
    method before it looks at that). Returns whether it did. (SGLang's RL on-policy option, the other
    one it reads there, needs a deterministic attention backend, which an M3 server never has.)"""
    if type(getattr(head, "quant_method", None)) is not UnquantizedEmbeddingMethod:
        return False
    if get_exec().features.enable_fp32_lm_head:
        return False
    head.quant_method = StreamedHeadMethod()
    return True
