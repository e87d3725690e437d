"""A checkpoint that lacks a tensor is refused at load, naming it, also where the tensor is one part of a
fused weight (q / k / v in ``qkv_proj``, the index q / k in ``qk_proj``, gate / up in ``gate_up_proj``, an
expert's gate / up in FusedMoE's ``w13``): such a weight would otherwise serve uninitialised rows.

``LoadedParts`` on its own, then the tiny M3 (CPU, fp32) loaded with one tensor dropped."""

from __future__ import annotations

import pytest
import torch
from cpu_model import build_model, checkpoint_tensors, one_rank
from sglang_m3.model.weights import LoadedParts
from sglang_m3.tiny import default_checkpoint

QKV = "model.layers.1.self_attn.qkv_proj.weight"
W13 = "model.layers.1.mlp.experts.w13_weight"


@pytest.mark.parametrize(
    "loads, missing",
    [
        ([(QKV, "q"), (QKV, "k"), (QKV, "v")], []),
        ([(QKV, "q"), (QKV, "k")], [f"{QKV}['v']"]),
        ([(QKV, None)], []),  # loaded whole
        ([("m.indexer.qk_proj.weight", "k")], ["m.indexer.qk_proj.weight['q']"]),
        ([("m.mlp.gate_up_proj.weight", 0)], ["m.mlp.gate_up_proj.weight[1]"]),
        ([("m.mlp.down_proj.weight", None)], []),
        ([(W13, "w1", 0), (W13, "w3", 0), (W13, "w1", 5)], [f"{W13}[w3, expert 5]"]),
        ([("m.mlp.experts.w2_weight", "w2", 3)], []),  # one part an expert
    ],
)
def test_loaded_parts(loads, missing):
    parts = LoadedParts()
    for load in loads:
        parts.add(*load)
    assert parts.missing({load[0] for load in loads}) == missing
    assert parts.missing({load[0] for load in loads} | {"never.loaded"}) == ["never.loaded", *missing]


@pytest.fixture(scope="module")
def ckpt():
    return default_checkpoint("m3-tiny", "vl")


@pytest.fixture(scope="module")
def tensors(ckpt):
    with one_rank(ckpt):
        yield checkpoint_tensors(ckpt)


@pytest.mark.parametrize(
    "dropped, named",
    [
        ("self_attn.v_proj.weight", "model.layers.1.self_attn.qkv_proj.weight['v']"),
        ("self_attn.index_k_proj.weight", "model.layers.1.self_attn.indexer.qk_proj.weight['k']"),
        ("block_sparse_moe.shared_experts.up_proj.weight", "model.layers.1.mlp.shared_experts.gate_up_proj.weight[1]"),
        ("block_sparse_moe.experts.5.w3.weight", "model.layers.1.mlp.experts.w13_weight[w3, expert 5]"),
        ("block_sparse_moe.gate.weight", "model.layers.1.mlp.gate.weight"),
    ],
)
def test_a_checkpoint_lacking_a_tensor_is_refused_naming_it(ckpt, tensors, dropped, named):
    name = f"language_model.model.layers.1.{dropped}"
    assert name in tensors
    with pytest.raises(ValueError, match=r"checkpoint lacks 1 MiniMax-M3 parameters or parts") as err:
        build_model(ckpt, torch.float32, {k: v for k, v in tensors.items() if k != name})
    assert named in str(err.value), str(err.value)
