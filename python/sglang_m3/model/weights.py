"""Checkpoint tensor names -> parameters of ``MiniMaxM3ForCausalLM``.

Accepts the released layout (DESIGN section 4; transformers' ``conversion_mapping``
entry ``minimax_m3_vl`` is the authoritative rename table) with or without the
VL ``language_model.`` prefix, dense-layer MLPs under either ``mlp.`` (the
release) or ``block_sparse_moe.`` (what some transformers 5.x ``save_pretrained``
write), and transformers' own text layout (``MiniMaxM3VLForCausalLM.save_pretrained``:
fused ``experts.gate_up_proj [E, 2I, H]``, ``mlp.gate``, ``self_attn.indexer.*``).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, replace

# Tensors of the checkpoint that text serving does not use (one log line says how many).
SKIPPED_PREFIXES = ("vision_tower.", "multi_modal_projector.", "patch_merge_mlp.", "mtp.", "model.mtp.")


EXPERT_PARAMS = ".mlp.experts.w"  # FusedMoE's routed-expert parameters (w13_ / w2_ weights and scales)
QUANT_SCALES = ("_scale", "_scale_inv")  # suffixes of quantisation scale parameters (weight_scale, input_scale, ...)
KV_SCALE = "kv_scale"  # Target.param suffix of a checkpoint's per-layer FP8 KV scale (not a parameter)


@dataclass(frozen=True)
class Target:
    param: str
    # fused-linear shard id (q/k/v, or 0/1 for gate/up); FusedMoE's "w1" (gate) / "w3" (up) / "w2" (down);
    # "w13": gate rows then up rows in one tensor; with expert=None ("w13" / "w2"): transformers' fused
    # layout, every expert in one tensor.
    shard: str | int | None = None
    expert: int | None = None


_LAYER = r"^model\.layers\.(\d+)\."
_RULES: list[tuple[re.Pattern, callable]] = [
    (
        re.compile(_LAYER + r"self_attn\.([qkv])_proj\.weight$"),
        lambda m: Target(f"model.layers.{m[1]}.self_attn.qkv_proj.weight", m[2]),
    ),
    # FP8 KV-cache scales of quantised checkpoints, in the spellings SGLang's loaders accept
    # (``self_attn.k_scale``, ``self_attn.k_proj.k_scale``, ``self_attn.attn.k_scale``; ``kv_scale`` = both).
    (
        re.compile(_LAYER + r"self_attn\.(?:[kv]_proj\.|attn\.)?([kv]{1,2})_scale$"),
        lambda m: Target(f"model.layers.{m[1]}.self_attn.{KV_SCALE}", shard=m[2]),
    ),
    # The index q and k projections share one GEMM (``indexer.qk_proj``: this rank's q heads, then k).
    (
        re.compile(_LAYER + r"self_attn\.(?:index_|indexer\.)([qk])_proj\.weight$"),
        lambda m: Target(f"model.layers.{m[1]}.self_attn.indexer.qk_proj.weight", m[2]),
    ),
    (
        re.compile(_LAYER + r"self_attn\.index_([qk])_norm\.weight$"),
        lambda m: Target(f"model.layers.{m[1]}.self_attn.indexer.{m[2]}_norm.weight"),
    ),
    (
        re.compile(_LAYER + r"(?:mlp|block_sparse_moe)\.(gate|up)_proj\.weight$"),
        lambda m: Target(f"model.layers.{m[1]}.mlp.gate_up_proj.weight", 0 if m[2] == "gate" else 1),
    ),
    (
        re.compile(_LAYER + r"(?:mlp|block_sparse_moe)\.down_proj\.weight$"),
        lambda m: Target(f"model.layers.{m[1]}.mlp.down_proj.weight"),
    ),
    (
        re.compile(_LAYER + r"(?:mlp|block_sparse_moe)\.gate\.weight$"),
        lambda m: Target(f"model.layers.{m[1]}.mlp.gate.weight"),
    ),
    (
        re.compile(_LAYER + r"(?:mlp|block_sparse_moe)\.(?:gate\.)?e_score_correction_bias$"),
        lambda m: Target(f"model.layers.{m[1]}.mlp.e_score_correction_bias"),
    ),
    (
        re.compile(_LAYER + r"block_sparse_moe\.experts\.(\d+)\.w([123])\.weight$"),
        lambda m: Target(_experts(m[1], m[3]), shard=f"w{m[3]}", expert=int(m[2])),
    ),
    # transformers' fused layout: all experts in one tensor, gate rows before up rows.
    (re.compile(_LAYER + r"mlp\.experts\.gate_up_proj$"), lambda m: Target(_experts(m[1], "1"), shard="w13")),
    (re.compile(_LAYER + r"mlp\.experts\.down_proj$"), lambda m: Target(_experts(m[1], "2"), shard="w2")),
    (
        re.compile(_LAYER + r"block_sparse_moe\.shared_experts\.(gate|up)_proj\.weight$"),
        lambda m: Target(f"model.layers.{m[1]}.mlp.shared_experts.gate_up_proj.weight", 0 if m[2] == "gate" else 1),
    ),
    (
        re.compile(_LAYER + r"block_sparse_moe\.shared_experts\.down_proj\.weight$"),
        lambda m: Target(f"model.layers.{m[1]}.mlp.shared_experts.down_proj.weight"),
    ),
]


def _experts(layer: str, w: str) -> str:
    """FusedMoE's parameter for checkpoint weight ``w1`` / ``w3`` (gate / up: ``w13_weight``) or ``w2``."""
    return f"model.layers.{layer}.mlp.experts.{'w2' if w == '2' else 'w13'}_weight"


# Scales of an FP8 checkpoint beside a weight (block-FP8: ``weight_scale_inv``); they go to the parameter
# of that weight's name with the same suffix (``qkv_proj.weight_scale_inv``, ``experts.w13_weight_scale_inv``).
_WEIGHT_SCALE = re.compile(r"^(.+)\.(weight_scale_inv|weight_scale|input_scale)$")


_SHARED = re.compile(r"^(model\.layers\.\d+\.mlp\.)shared_experts\.(gate_up|down)_proj\.(weight\w*)$")


def fused_shared_target(target: Target, slot: int) -> Target:
    """A shared-expert target moved to FusedMoE's expert ``slot`` (the shared expert fused as expert E)."""
    m = _SHARED.match(target.param)
    if m is None:
        raise ValueError(f"{target.param!r} is not a shared-expert parameter")
    if m[2] == "down":
        return Target(f"{m[1]}experts.w2_{m[3]}", shard="w2", expert=slot)
    shard = {0: "w1", 1: "w3", None: "w13"}[target.shard]  # None: transformers' fused gate_up_proj
    return Target(f"{m[1]}experts.w13_{m[3]}", shard=shard, expert=slot)


def map_name(name: str) -> Target | None:
    """Parameter target of a checkpoint tensor, or ``None`` for tensors text serving skips."""
    if name.startswith("language_model."):
        name = name[len("language_model.") :]
    if name.startswith(SKIPPED_PREFIXES):
        return None
    scale = _WEIGHT_SCALE.match(name)
    if scale:
        target = map_name(scale[1] + ".weight")
        return replace(target, param=target.param.removesuffix("weight") + scale[2])
    for pattern, build in _RULES:
        m = pattern.match(name)
        if m:
            return build(m)
    return Target(name)


# The parts a fused parameter is loaded in (the shard ids its weight loader takes), by a name piece.
_FUSED_PARTS = ((".qkv_proj.", {"q", "k", "v"}), (".qk_proj.", {"q", "k"}), ("gate_up_proj.", {0, 1}))


class LoadedParts:
    """What a checkpoint filled: parameters, and the parts of fused ones. A fused weight (q / k / v in
    ``qkv_proj``, gate and up in ``gate_up_proj``, an expert's gate and up in FusedMoE's ``w13``) that
    misses one of its tensors would otherwise serve uninitialised rows."""

    def __init__(self):
        self._parts: dict[str, set] = defaultdict(set)

    def add(self, param: str, shard: str | int | None = None, expert: int | None = None) -> None:
        """``param`` took a tensor: whole (``shard`` None), one part, or one expert's part."""
        self._parts[param].add((shard, expert))

    def missing(self, params) -> list[str]:
        """Names of ``params`` never loaded, and ``"name[part]"`` for each absent part of a fused one
        (experts: of each expert the checkpoint has; experts absent altogether are another rank's
        business or the loader's)."""
        out = sorted(set(params) - set(self._parts))
        for param, parts in sorted(self._parts.items()):
            if (None, None) in parts:
                continue
            if EXPERT_PARAMS + "13_" in param:
                for expert in sorted({e for _, e in parts}):
                    out += [f"{param}[{s}, expert {expert}]" for s in ("w1", "w3") if (s, expert) not in parts]
                continue
            want = next((p for piece, p in _FUSED_PARTS if piece in param), set())
            out += [f"{param}[{s!r}]" for s in sorted(want - {s for s, _ in parts}, key=str)]
        return out
