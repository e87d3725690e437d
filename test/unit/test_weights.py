"""Checkpoint-name mapping: released names, transformers' save names, skipped tensors."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from sglang_m3.model.weights import LoadedParts, fused_shared_target, map_name


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
        ("mlp.shared_experts.gate_up_proj.weight", "experts.w13_weight", "w13"),  # transformers' layout
    ],
)
def test_fused_shared_expert_goes_to_slot_e(name, param, shard):
    """With the shared expert fused into FusedMoE, its tensors load into expert slot E (128 in the release)."""
    target = fused_shared_target(map_name(f"language_model.model.layers.7.{name}"), 128)
    assert (target.param, target.shard, target.expert) == (f"model.layers.7.mlp.{param}", shard, 128)


def test_fused_gate_up_reaches_fusedmoe_as_gate_and_up():
    """A fused gate_up tensor (transformers' layout: the shared expert moved to slot E, or every routed
    expert at once) reaches FusedMoE's loader as its gate (w1) and up (w3) halves, a scalar scale as both."""
    from sglang_m3.model.minimax_m3 import _load_experts

    calls = []

    def loader(param, weight, name, shard, expert):
        calls.append((shard, expert, weight.tolist()))

    gate_up = torch.arange(8.0).view(4, 2)  # 2 gate rows, then 2 up rows
    shared = fused_shared_target(map_name("model.layers.7.mlp.shared_experts.gate_up_proj.weight"), 128)
    _load_experts(loader, None, gate_up, shared, LoadedParts())
    assert calls == [("w1", 128, [[0.0, 1.0], [2.0, 3.0]]), ("w3", 128, [[4.0, 5.0], [6.0, 7.0]])]

    calls.clear()
    _load_experts(loader, None, torch.tensor(0.5), replace(shared, param=shared.param + "_scale"), LoadedParts())
    assert calls == [("w1", 128, 0.5), ("w3", 128, 0.5)]

    calls.clear()
    routed = map_name("model.layers.7.mlp.experts.gate_up_proj")
    _load_experts(loader, None, torch.stack([gate_up, gate_up + 8]), routed, LoadedParts())
    assert [c[:2] for c in calls] == [("w1", 0), ("w3", 0), ("w1", 1), ("w3", 1)]
    assert calls[3][2] == [[12.0, 13.0], [14.0, 15.0]]
