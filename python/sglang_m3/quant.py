"""Which weight quantisations sglang-m3 serves M3 with.

SGLang's own quantisation methods do the work once ``quant_config`` reaches every linear
and the MoE: ``--quantization fp8`` (per-tensor FP8 weights made at load, Hopper's FP8
GEMMs) and checkpoints that carry a block-FP8 ``quantization_config`` (``quant_method:
fp8`` with ``weight_block_size``). The router, the indexer projections and the norms stay
unquantised (the router is fp32 in the release; the indexer's scores pick the pages).
Anything else is refused at start-up naming the method.
"""

from __future__ import annotations

SUPPORTED_QUANTIZATION = ("fp8",)


def check_quantization(quant_config) -> None:
    """Refuse a quantisation method sglang-m3 has not been validated with."""
    if quant_config is None:
        return
    name = quant_config.get_name()
    if name not in SUPPORTED_QUANTIZATION:
        raise ValueError(
            f"quantization={name!r}: sglang-m3 serves MiniMax-M3 unquantised or with {list(SUPPORTED_QUANTIZATION)}"
        )
