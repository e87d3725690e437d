"""Checkpoint-name mapping: released names, transformers' save names, skipped tensors."""

from __future__ import annotations

import pytest
from sglang_m3.model.weights import fused_shared_target, map_name


@pytest.mark.parametrize(
    "name, param, shard, expert",
    [
        (
            "language_model.model.layers.3.self_attn.k_proj.weight",
            "model.layers.3.self_attn.qkv_proj.weight",
            "k",
            None,
        ),
        (
            "language_model.model.layers.3.self_attn.index_q_proj.weight",
            "model.layers.3.self_attn.indexer.qk_proj.weight",
            "q",
            None,
        ),
        (
            "language_model.model.layers.3.self_attn.index_k_norm.weight",
            "model.layers.3.self_attn.indexer.k_norm.weight",
            None,
            None,
        ),
        ("language_model.model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.gate_up_proj.weight", 1, None),
        ("model.layers.0.block_sparse_moe.gate_proj.weight", "model.layers.0.mlp.gate_up_proj.weight", 0, None),
        ("language_model.model.layers.5.block_sparse_moe.gate.weight", "model.layers.5.mlp.gate.weight", None, None),
        (
            "language_model.model.layers.5.block_sparse_moe.e_score_correction_bias",
            "model.layers.5.mlp.e_score_correction_bias",
            None,
            None,
        ),
        (
            "language_model.model.layers.5.block_sparse_moe.experts.7.w1.weight",
            "model.layers.5.mlp.experts.w13_weight",
            "w1",
            7,
        ),
        (
            "language_model.model.layers.5.block_sparse_moe.experts.7.w3.weight",
            "model.layers.5.mlp.experts.w13_weight",
            "w3",
            7,
        ),
        (
            "language_model.model.layers.5.block_sparse_moe.experts.7.w2.weight",
            "model.layers.5.mlp.experts.w2_weight",
            "w2",
            7,
        ),
        (
            "language_model.model.layers.5.block_sparse_moe.shared_experts.up_proj.weight",
            "model.layers.5.mlp.shared_experts.gate_up_proj.weight",
            1,
            None,
        ),
        ("language_model.lm_head.weight", "lm_head.weight", None, None),
        # transformers' own text layout (MiniMaxM3VLForCausalLM.save_pretrained)
        ("model.layers.2.mlp.experts.gate_up_proj", "model.layers.2.mlp.experts.w13_weight", "w13", None),
        ("model.layers.2.mlp.experts.down_proj", "model.layers.2.mlp.experts.w2_weight", "w2", None),
        (
            "model.layers.2.mlp.gate.e_score_correction_bias",
            "model.layers.2.mlp.e_score_correction_bias",
            None,
            None,
        ),
        (
            "model.layers.2.self_attn.indexer.k_proj.weight",
            "model.layers.2.self_attn.indexer.qk_proj.weight",
            "k",
            None,
        ),
    ],
)
def test_mapping(name, param, shard, expert):
    t = map_name(name)
    assert (t.param, t.shard, t.expert) == (param, shard, expert)


@pytest.mark.parametrize(
    "name",
    [
        "vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight",
        "multi_modal_projector.linear_1.bias",
        "patch_merge_mlp.linear_2.weight",
        "mtp.layers.0.eh_proj.weight",
    ],
)
def test_skipped(name):
    assert map_name(name) is None


@pytest.mark.parametrize(
    "name, shard",
    [
        ("language_model.model.layers.3.self_attn.k_scale", "k"),
        ("model.layers.3.self_attn.v_proj.v_scale", "v"),
        ("model.layers.3.self_attn.attn.k_scale", "k"),
        ("model.layers.3.self_attn.kv_scale", "kv"),
    ],
)
def test_fp8_kv_scale_names(name, shard):
    from sglang_m3.model.weights import KV_SCALE

    target = map_name(name)
    assert (target.param, target.shard) == (f"model.layers.3.self_attn.{KV_SCALE}", shard)


@pytest.mark.parametrize(
    "name, param, shard, expert",
    [
        (
            "language_model.model.layers.3.self_attn.q_proj.weight_scale_inv",
            "model.layers.3.self_attn.qkv_proj.weight_scale_inv",
            "q",
            None,
        ),
        (
            "model.layers.3.block_sparse_moe.experts.7.w2.weight_scale_inv",
            "model.layers.3.mlp.experts.w2_weight_scale_inv",
            "w2",
            7,
        ),
        (
            "model.layers.3.block_sparse_moe.experts.0.w3.weight_scale_inv",
            "model.layers.3.mlp.experts.w13_weight_scale_inv",
            "w3",
            0,
        ),
        ("model.layers.0.mlp.down_proj.weight_scale", "model.layers.0.mlp.down_proj.weight_scale", None, None),
        (
            "model.layers.4.block_sparse_moe.shared_experts.gate_proj.input_scale",
            "model.layers.4.mlp.shared_experts.gate_up_proj.input_scale",
            0,
            None,
        ),
    ],
)
def test_fp8_checkpoint_scales_follow_their_weight(name, param, shard, expert):
    target = map_name(name)
    assert (target.param, target.shard, target.expert) == (param, shard, expert)


@pytest.mark.parametrize(
    "name, param, shard",
    [
        ("block_sparse_moe.shared_experts.gate_proj.weight", "experts.w13_weight", "w1"),
        ("block_sparse_moe.shared_experts.up_proj.weight", "experts.w13_weight", "w3"),
        ("block_sparse_moe.shared_experts.down_proj.weight", "experts.w2_weight", "w2"),
        ("block_sparse_moe.shared_experts.up_proj.weight_scale_inv", "experts.w13_weight_scale_inv", "w3"),
    ],
)
def test_fused_shared_expert_goes_to_slot_e(name, param, shard):
    """With the shared expert fused into FusedMoE, its tensors load into expert slot E (128 in the release)."""
    target = fused_shared_target(map_name(f"language_model.model.layers.7.{name}"), 128)
    assert (target.param, target.shard, target.expert) == (f"model.layers.7.mlp.{param}", shard, 128)
