"""Write a tiny MiniMax-M3 checkpoint in the released format, deterministically.

The weights come from transformers' own ``MiniMaxM3VL*`` classes (so the
checkpoint loads there unchanged) re-initialised from a seeded generator with
fan-in scaled normals: logits spread wide enough that greedy decoding has
clear winners. ``save_pretrained`` of the VL class writes the released tensor
names; ``config.json`` is then rewritten in the released spelling (VL variant)
or kept in transformers' normalised spelling (text variant), so both parse paths
are exercised.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .configs import TINY_CONFIGS
from .tokenizer import train_tokenizer

BUILD_VERSION = 4  # bump when the output of a given (name, variant, seed) changes
VOCAB_SIZE = 512
_VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    patch_size=14,
    image_size=56,
    hidden_act="gelu",
    model_type="clip_vision_model",
)


def released_text_config(name: str, vocab_size: int = VOCAB_SIZE) -> dict:
    """The text config in the released ``config.json`` spelling."""
    spec = dict(TINY_CONFIGS[name])
    layers, moe, msa = spec.pop("layers"), spec.pop("moe"), spec.pop("msa")
    return dict(
        spec,
        vocab_size=vocab_size,
        moe_layer_freq=moe,
        sparse_attention_config=dict(
            msa,
            sparse_num_index_heads=spec["num_key_value_heads"],
            sparse_attention_freq=layers,
            sparse_disable_index_value=layers,
        ),
        architectures=["MiniMaxM3SparseForCausalLM"],
    )


def normalised_text_config(name: str, vocab_size: int = VOCAB_SIZE) -> dict:
    """The same config in transformers' normalised spelling (``index_*``, ``layer_types``)."""
    spec = dict(TINY_CONFIGS[name])
    layers, moe, msa = spec.pop("layers"), spec.pop("moe"), spec.pop("msa")
    for key in (
        "hidden_act",
        "scoring_func",
        "use_routing_bias",
        "use_gemma_norm",
        "use_qk_norm",
        "qk_norm_type",
        "attention_output_gate",
        "n_shared_experts",
        "rope_theta",
        "partial_rotary_factor",
    ):
        spec.pop(key)
    return dict(
        spec,
        vocab_size=vocab_size,
        rope_parameters=dict(
            rope_type="default",
            rope_theta=TINY_CONFIGS[name]["rope_theta"],
            partial_rotary_factor=TINY_CONFIGS[name]["partial_rotary_factor"],
        ),
        index_n_heads=spec["num_key_value_heads"],
        index_head_dim=msa["sparse_index_dim"],
        index_block_size=msa["sparse_block_size"],
        index_topk_blocks=msa["sparse_topk_blocks"],
        index_local_blocks=msa["sparse_local_block"],
        layer_types=["minimax_m3_sparse" if f else "full_attention" for f in layers],
        mlp_layer_types=["sparse" if f else "dense" for f in moe],
    )


def _init_weights(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    tensors = dict(model.named_parameters())
    tensors.update({n: b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")})
    for name in sorted(tensors):
        t = tensors[name]
        if t.ndim >= 2:  # linear / expert / embedding / conv weights: unit-variance outputs
            std = 1.0 / math.sqrt(t[0].numel() if t.ndim > 3 else t.shape[-1])
        else:  # norm weights (Gemma: scale = 1 + w), biases, routing bias
            std = 0.1
        with torch.no_grad():
            t.copy_(torch.randn(t.shape, generator=gen) * std)


def build_checkpoint(out_dir: str | os.PathLike, name: str = "m3-tiny", variant: str = "vl", seed: int = 0) -> Path:
    """Write checkpoint ``name`` (a key of ``TINY_CONFIGS``) as ``variant`` ('vl' or 'text') into ``out_dir``."""
    from transformers import (
        MiniMaxM3SparseForConditionalGeneration,
        MiniMaxM3VLForCausalLM,
    )
    from transformers.models.minimax_m3_vl import (
        MiniMaxM3VLConfig,
        MiniMaxM3VLTextConfig,
    )

    if name not in TINY_CONFIGS:
        raise ValueError(f"unknown tiny config name={name!r}; choose from {sorted(TINY_CONFIGS)}")
    if variant not in ("vl", "text"):
        raise ValueError(f"unknown variant={variant!r}; choose 'vl' or 'text'")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(VOCAB_SIZE, out, TINY_CONFIGS[name]["max_position_embeddings"])
    if len(tok) != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {len(tok)} tokens, expected {VOCAB_SIZE}")
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    ids = dict(eos_token_id=eos, bos_token_id=None, pad_token_id=tok.pad_token_id)

    torch.manual_seed(seed)
    if variant == "vl":
        text = dict(released_text_config(name), **ids)
        extra = dict(
            image_token_index=tok.convert_tokens_to_ids("<|image|>"),
            video_token_index=tok.convert_tokens_to_ids("<|video|>"),
            projector_hidden_size=text["hidden_size"],
        )
        model = MiniMaxM3SparseForConditionalGeneration(
            MiniMaxM3VLConfig(text_config=text, vision_config=_VISION, **extra)
        )
    else:
        text = dict(normalised_text_config(name), **ids)
        model = MiniMaxM3VLForCausalLM(MiniMaxM3VLTextConfig(**text))
    _init_weights(model, seed)
    model.to(torch.bfloat16)
    for module in model.modules():  # the released router weight and bias are fp32
        if type(module).__name__ == "MiniMaxM3VLTopKRouter":
            module.float()
    model.save_pretrained(out)

    if variant == "vl":
        config = dict(
            architectures=["MiniMaxM3SparseForConditionalGeneration"],
            model_type="minimax_m3_vl",
            text_config=text,
            vision_config=_VISION,
            torch_dtype="bfloat16",
            **extra,
        )
    else:
        config = json.loads((out / "config.json").read_text())
        config["architectures"] = ["MiniMaxM3SparseForCausalLM"]
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}, indent=2) + "\n")
    return out


def cache_root() -> Path:
    return Path(os.environ.get("SGLANG_M3_CACHE", Path.home() / ".cache" / "sglang_m3"))


def default_checkpoint(name: str = "m3-tiny", variant: str = "vl") -> Path:
    """Path of the cached checkpoint, building it on first use (atomic, safe across processes)."""
    return cached(cache_root() / f"{name}-{variant}-v{BUILD_VERSION}", lambda tmp: build_checkpoint(tmp, name, variant))


def cached(final: Path, build) -> Path:
    """``final`` if it was built before, else ``build(tmp)`` into a fresh folder beside it, renamed
    into place: atomic, and safe when several processes build at once."""
    if (final / "config.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        build(tmp)
        try:
            tmp.rename(final)
        except OSError:  # another process finished first
            if not (final / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
