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
from dataclasses import dataclass

# Tensors of the checkpoint that text serving does not use (one log line says how many).
SKIPPED_PREFIXES = ("vision_tower.", "multi_modal_projector.", "patch_merge_mlp.", "mtp.", "model.mtp.")


@dataclass(frozen=True)
class Target:
    param: str
    shard: str | int | None = None  # fused-linear shard id (q/k/v, or 0/1 for gate/up)
    expert: int | None = None
    rows: slice | None = None  # rows of the stacked expert tensor this tensor fills


_LAYER = r"^model\.layers\.(\d+)\."
_RULES: list[tuple[re.Pattern, callable]] = [
    (
        re.compile(_LAYER + r"self_attn\.([qkv])_proj\.weight$"),
        lambda m, I: Target(f"model.layers.{m[1]}.self_attn.qkv_proj.weight", m[2]),
    ),
    (
        re.compile(_LAYER + r"self_attn\.index_([qk])_(proj|norm)\.weight$"),
        lambda m, I: Target(f"model.layers.{m[1]}.self_attn.indexer.{m[2]}_{m[3]}.weight"),
    ),
    (
        re.compile(_LAYER + r"(?:mlp|block_sparse_moe)\.(gate|up)_proj\.weight$"),
        lambda m, I: Target(f"model.layers.{m[1]}.mlp.gate_up_proj.weight", 0 if m[2] == "gate" else 1),
    ),
    (
        re.compile(_LAYER + r"(?:mlp|block_sparse_moe)\.down_proj\.weight$"),
        lambda m, I: Target(f"model.layers.{m[1]}.mlp.down_proj.weight"),
    ),
    (
        re.compile(_LAYER + r"(?:mlp|block_sparse_moe)\.gate\.weight$"),
        lambda m, I: Target(f"model.layers.{m[1]}.mlp.router"),
    ),
    (
        re.compile(_LAYER + r"(?:mlp|block_sparse_moe)\.(?:gate\.)?e_score_correction_bias$"),
        lambda m, I: Target(f"model.layers.{m[1]}.mlp.e_score_correction_bias"),
    ),
    (re.compile(_LAYER + r"block_sparse_moe\.experts\.(\d+)\.w([123])\.weight$"), lambda m, I: _expert(m, I)),
    # transformers' fused layout: all experts in one tensor, gate rows before up rows (like w13).
    (re.compile(_LAYER + r"mlp\.experts\.gate_up_proj$"), lambda m, I: Target(f"model.layers.{m[1]}.mlp.w13")),
    (re.compile(_LAYER + r"mlp\.experts\.down_proj$"), lambda m, I: Target(f"model.layers.{m[1]}.mlp.w2")),
    (
        re.compile(_LAYER + r"block_sparse_moe\.shared_experts\.(gate|up)_proj\.weight$"),
        lambda m, I: Target(f"model.layers.{m[1]}.mlp.shared_experts.gate_up_proj.weight", 0 if m[2] == "gate" else 1),
    ),
    (
        re.compile(_LAYER + r"block_sparse_moe\.shared_experts\.down_proj\.weight$"),
        lambda m, I: Target(f"model.layers.{m[1]}.mlp.shared_experts.down_proj.weight"),
    ),
]


def _expert(m: re.Match, intermediate: int) -> Target:
    layer, expert, w = m[1], int(m[2]), m[3]
    if w == "2":
        return Target(f"model.layers.{layer}.mlp.w2", expert=expert, rows=slice(None))
    rows = slice(0, intermediate) if w == "1" else slice(intermediate, 2 * intermediate)  # w1 = gate, w3 = up
    return Target(f"model.layers.{layer}.mlp.w13", expert=expert, rows=rows)


def map_name(name: str, moe_intermediate_size: int) -> Target | None:
    """Parameter target of a checkpoint tensor, or ``None`` for tensors text serving skips."""
    if name.startswith("language_model."):
        name = name[len("language_model.") :]
    if name.startswith(SKIPPED_PREFIXES):
        return None
    for pattern, build in _RULES:
        m = pattern.match(name)
        if m:
            return build(m, moe_intermediate_size)
    return Target(name)
