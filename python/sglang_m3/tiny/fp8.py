"""A block-FP8 copy of an M3 checkpoint, in the layout of the public block-FP8 releases.

DeepSeek-V3's and MiniMax's FP8 checkpoints store each quantised linear as ``weight``
(``float8_e4m3fn``) beside ``weight_scale_inv`` (fp32, ``[ceil(out / bn), ceil(in / bk)]``):
the dequantised weight is ``weight.float() * weight_scale_inv`` broadcast over each
``bn x bk`` block. ``config.json`` carries ``quantization_config`` (``quant_method: fp8``,
``activation_scheme: dynamic``, ``weight_block_size: [bn, bk]``, ``modules_to_not_convert``
as MiniMax-M2's FP8 release spells it), which SGLang's ``Fp8Config`` reads.

Quantised: the tensors that land in a module our model builds with ``quant_config``: the
attention q/k/v/o projections, the dense MLP, the routed experts' w1/w2/w3 and the shared
expert. Kept as they are: the router (fp32) and its ``e_score_correction_bias``, the MSA
indexer projections and norms, every norm, the embedding, ``lm_head`` and the vision tower.

Each block is scaled so its largest magnitude maps to e4m3's 448 and rounded to nearest:
per element ``|dequantised - original| <= |original| / 16 + scale_inv * 2**-10`` (3 mantissa
bits: half a unit in the last place is 2**-4 relative for normals; subnormals below 2**-6
are spaced 2**-9 apart).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

from ..model.weights import Target, map_name
from .build import BUILD_VERSION, cache_root, cached, default_checkpoint

FP8_VERSION = 1  # bump when the copy of a given source changes
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
TINY_BLOCK = (32, 32)  # the tiny model's widths are multiples of 32, not of the releases' 128
# MiniMax-M2's FP8 release lists these; SGLang matches them on dotted module-path boundaries.
MODULES_TO_NOT_CONVERT = ["gate", "e_score_correction_bias", "lm_head"]
# Parameters of modules our model builds with quant_config (attention.py, mlp.py).
_QUANTISED_PARAMS = ("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight")
_QUANTISED_EXPERTS = ("experts.w13_weight", "experts.w2_weight")


def quantization_config(block: tuple[int, int]) -> dict:
    return {
        "quant_method": "fp8",
        "fmt": "float8_e4m3fn",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
        "modules_to_not_convert": list(MODULES_TO_NOT_CONVERT),
    }


def is_quantised(name: str) -> bool:
    """Whether a block-FP8 checkpoint stores tensor ``name`` as fp8 with a ``weight_scale_inv``."""
    target = map_name(name)
    if target is None or not name.endswith(".weight"):
        return False
    if target.param.endswith(_QUANTISED_EXPERTS):
        return _per_expert(name, target)
    return target.param.endswith(_QUANTISED_PARAMS)


def _per_expert(name: str, target: Target) -> bool:
    if target.expert is None:  # transformers' fused [E, 2I, H] tensor: no scale name exists for it
        raise ValueError(f"{name!r}: a block-FP8 copy needs one tensor per expert (the released layout)")
    return True


def quantize_block(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [out, in]`` -> (``float8_e4m3fn [out, in]``, ``scale_inv`` fp32 ``[ceil(out/bn), ceil(in/bk)]``)."""
    bn, bk = block
    out, inp = weight.shape
    rows, cols = math.ceil(out / bn), math.ceil(inp / bk)
    padded = torch.zeros(rows * bn, cols * bk, dtype=torch.float32)
    padded[:out, :inp] = weight.float()
    blocks = padded.view(rows, bn, cols, bk)
    amax = blocks.abs().amax(dim=(1, 3))  # [rows, cols]
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(rows * bn, cols * bk)[:out, :inp].contiguous(), scale_inv.contiguous()


def dequantize_block(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """fp32 ``q.float() * scale_inv`` broadcast per ``block``."""
    bn, bk = block
    out, inp = q.shape
    scale = scale_inv.repeat_interleave(bn, dim=0)[:out].repeat_interleave(bk, dim=1)[:, :inp]
    return q.float() * scale


def error_bound(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Per-element bound of ``|dequantize_block(quantize_block(w)) - w|`` (module docstring)."""
    bn, bk = block
    out, inp = weight.shape
    scale = scale_inv.repeat_interleave(bn, dim=0)[:out].repeat_interleave(bk, dim=1)[:, :inp]
    return weight.float().abs() / 16 + scale * 2.0**-10


def build_fp8_copy(src: str | Path, dst: str | Path, block: tuple[int, int] = TINY_BLOCK) -> Path:
    """Write a block-FP8 copy of checkpoint ``src`` (released tensor names) into ``dst``."""
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for path in sorted(src.glob("*.safetensors")):
        tensors = load_file(path)
        out = {}
        for name in sorted(tensors):
            if is_quantised(name):
                out[name], out[name + "_scale_inv"] = quantize_block(tensors[name], block)
            else:
                out[name] = tensors[name]
        save_file(out, dst / path.name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, path.name))
    for path in src.iterdir():
        if path.suffix == ".safetensors" or path.name == "config.json":
            continue
        if path.name == "model.safetensors.index.json":
            index = json.loads(path.read_text())
            index["weight_map"] = dict(sorted(weight_map.items()))
            (dst / path.name).write_text(json.dumps(index, indent=2) + "\n")
        elif path.is_file():
            shutil.copyfile(path, dst / path.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(block)
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return dst


def default_fp8_checkpoint(name: str = "m3-tiny", variant: str = "vl", block: tuple[int, int] = TINY_BLOCK) -> Path:
    """The cached block-FP8 copy of the cached tiny checkpoint (built on first use)."""
    if variant != "vl":
        raise ValueError(f"variant={variant!r}: the block-FP8 copy needs the released layout ('vl')")
    src = default_checkpoint(name, variant)
    final = cache_root() / f"{name}-{variant}-v{BUILD_VERSION}-fp8b{block[0]}x{block[1]}-v{FP8_VERSION}"
    return cached(final, lambda tmp: build_fp8_copy(src, tmp, block))
