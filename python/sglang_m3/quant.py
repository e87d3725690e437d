"""Which weight quantisations sglang-m3 serves M3 with.

SGLang's own quantisation methods do the work once ``quant_config`` reaches every linear and the
MoE: ``--quantization fp8`` (FP8 weights made at load: the linears' one scale per output row on
Hopper's CUTLASS GEMM, each routed expert's one scale) and checkpoints that carry a block-FP8
``quantization_config`` (``quant_method: fp8`` with ``weight_block_size``: ``Fp8LinearMethod`` /
``Fp8MoEMethod`` with block scales, the checkpoint's ``weight_scale_inv`` loaded into the fused qkv
/ gate_up / FusedMoE w13 / w2 scale parameters). The router and the norms stay unquantised (the
router is fp32 in the release); the indexer's projections are quantised with the attention's qkv
only where the method gives each weight row its own scale (``quantises_rows_alone``), else they stay
unquantised (their scores pick the pages). Anything else is refused at start-up naming the method.

Block sizes other than the releases' 128 x 128 (the tiny model's 32 x 32) run SGLang's Triton
block-FP8 GEMMs: ``keep_block_fp8_on_triton``. MoE layers with per-tensor FP8 weights (``--quantization
fp8``) quantise their activations per token: ``per_token_moe_activations``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

from torch import nn

logger = logging.getLogger(__name__)

SUPPORTED_QUANTIZATION = ("fp8",)
KERNEL_BLOCK = [128, 128]  # the only block size SGLang's DeepGEMM / CUTLASS / FlashInfer FP8 paths read


def check_quantization(quant_config) -> None:
    """Refuse a quantisation method sglang-m3 has not been validated with."""
    if quant_config is None:
        return
    name = quant_config.get_name()
    if name not in SUPPORTED_QUANTIZATION:
        raise ValueError(
            f"quantization={name!r}: sglang-m3 serves MiniMax-M3 unquantised or with {list(SUPPORTED_QUANTIZATION)}"
        )


def quantises_rows_alone(method) -> bool:
    """Whether a linear's quant method turns its unquantised weight into FP8 at load with one scale per
    output row: SGLang's ``Fp8LinearMethod`` for ``--quantization fp8`` (an unquantised checkpoint) on its
    CUTLASS GEMM (``process_weights_after_loading``: ``per_token_group_quant_fp8`` over each row). Rows
    appended to such a weight before it is processed are quantised as precisely as in a layer of their own.
    Marlin sizes its weight from the layer's declared widths, and a per-tensor or serialised scale is
    shared by all rows: those are left alone."""
    from sglang.srt.layers.quantization.fp8 import Fp8LinearMethod

    return (
        isinstance(method, Fp8LinearMethod)
        and not (method.block_quant or method.use_mxfp8 or method.use_marlin)
        and not method.is_checkpoint_fp8_serialized
        and bool(method.cutlass_fp8_supported)
    )


def keep_block_fp8_on_triton(model: nn.Module, quant_config) -> int:
    """Block-FP8 layers whose block is not 128 x 128 on SGLang's Triton kernels; returns how many linears moved.

    SGLang picks a block-FP8 linear's GEMM without looking at the block size (fp8_utils
    ``_dispatch_auto_backend``: DeepGEMM whenever it is installed, and on Hopper / Blackwell it sends
    every 64 x 128 aligned weight there), and those kernels read 128 x 128 weight / 1 x 128 activation
    scales only; its Triton GEMM takes any block. The MoE runner is chosen per process: a block other
    than 128 x 128 with a runner other than Triton is refused here, naming ``--moe-runner-backend``."""
    block = list(getattr(quant_config, "weight_block_size", None) or [])
    if not block or block == KERNEL_BLOCK:
        return 0
    import torch
    from sglang.srt.layers.moe.utils import get_moe_runner_backend
    from sglang.srt.layers.quantization import fp8_utils
    from sglang.srt.layers.quantization.fp8 import Fp8LinearMethod, Fp8MoEMethod

    if torch.version.hip is not None:
        return 0
    moved = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, Fp8MoEMethod) and method.block_quant:
            runner = get_moe_runner_backend()
            if not (runner.is_triton() or (runner.is_auto() and not method.is_deepgemm_moe_runner_backend_enabled())):
                raise ValueError(
                    f"weight_block_size={block} with --moe-runner-backend={runner.value!r}"
                    f"{' (DeepGEMM)' if runner.is_auto() else ''}: only SGLang's Triton MoE runner reads blocks other "
                    f"than {KERNEL_BLOCK}; use --moe-runner-backend triton"
                )
        elif isinstance(method, Fp8LinearMethod) and method.block_quant and not method.use_mxfp8:
            if method.w8a8_block_fp8_linear is not fp8_utils.triton_w8a8_block_fp8_linear:
                method.w8a8_block_fp8_linear = fp8_utils.triton_w8a8_block_fp8_linear
                moved += 1
    if moved:
        logger.info("sglang-m3: %d block-FP8 linears (block %s) on SGLang's Triton GEMM", moved, block)
    return moved


def per_token_moe_activations(model: nn.Module, quant_config) -> int:
    """Per-tensor FP8 MoE layers on SGLang's Triton runner quantise activations per token; returns how many.

    SGLang's ``Fp8MoEMethod`` hands its Triton runner one weight scale per expert, and the runner then
    quantises each GEMM's input with one dynamic scale for the whole batch (``scaled_fp8_quant``: a zeroed
    scale, an absmax reduction, the quantisation: three kernels before each of the two GEMMs, six a layer,
    and every token rounded on the batch's largest value). The runner's per-channel mode takes one scale
    per token (one kernel a GEMM) and one per weight row; an expert's single scale broadcast over its rows
    (a stride-0 view, ``per_token_quant_info``) is that per-row scale, so the product is the same but for
    the finer activation scales: what SGLang's ``Fp8LinearMethod`` does for the linears of the same model
    (per-row weight scales, per-token activations). Dynamic activation scales
    only (a static ``input_scale`` stays per tensor). The step time did not move (``docs/perf-notes.md``)."""
    if quant_config is None or getattr(quant_config, "activation_scheme", None) != "dynamic":
        return 0
    from sglang.srt.layers.quantization.fp8 import Fp8MoEMethod

    switched = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, Fp8MoEMethod) and not method.block_quant and not method.use_mxfp8:
            method.get_triton_quant_info = functools.partial(per_token_quant_info, method)
            switched += 1
    return switched


def per_token_quant_info(method, layer: nn.Module):
    """``Fp8MoEMethod.get_triton_quant_info`` with per-token activations: each expert's weight scale
    (``[E]``) as a per-row scale (``[E, rows]``, stride 0 along the rows)."""
    from sglang.srt.layers.quantization.fp8 import Fp8MoEMethod

    info = Fp8MoEMethod.get_triton_quant_info(method, layer)
    experts = layer.w13_weight.shape[0]
    return dataclasses.replace(
        info,
        per_channel_quant=True,
        w13_scale=info.w13_scale.view(experts, 1).expand(experts, layer.w13_weight.shape[1]),
        w2_scale=info.w2_scale.view(experts, 1).expand(experts, layer.w2_weight.shape[1]),
    )
