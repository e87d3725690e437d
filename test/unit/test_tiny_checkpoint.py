"""The embedded default checkpoint: deterministic, released tensor names, both config spellings."""

from __future__ import annotations

import hashlib
import json

import pytest
from safetensors import safe_open
from sglang_m3.config import M3Config
from sglang_m3.tiny import build_checkpoint


def _digest(path):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir()) if f.is_file()}


def test_build_is_deterministic_and_uses_released_names(tmp_path):
    a, b = build_checkpoint(tmp_path / "a"), build_checkpoint(tmp_path / "b")
    assert _digest(a) == _digest(b)
    with safe_open(a / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert f.get_slice("language_model.model.layers.1.block_sparse_moe.gate.weight").get_dtype() == "F32"
        assert f.get_slice("language_model.model.layers.1.self_attn.q_proj.weight").get_dtype() == "BF16"
    for key in (
        "language_model.lm_head.weight",
        "language_model.model.layers.0.mlp.gate_proj.weight",
        "language_model.model.layers.1.block_sparse_moe.experts.7.w3.weight",
        "language_model.model.layers.1.block_sparse_moe.e_score_correction_bias",
        "language_model.model.layers.1.block_sparse_moe.shared_experts.down_proj.weight",
        "language_model.model.layers.1.self_attn.index_k_proj.weight",
    ):
        assert key in keys, key
    assert any(k.startswith("vision_tower.") for k in keys)
    config = json.loads((a / "config.json").read_text())
    assert "sparse_attention_config" in config["text_config"]  # released spelling
    assert (a / "tokenizer.json").exists() and "<|im_start|>" in (a / "chat_template.jinja").read_text()


def test_text_variant_uses_normalised_spelling(tmp_path):
    path = build_checkpoint(tmp_path / "t", "m3-tiny-gqa", "text")
    config = json.loads((path / "config.json").read_text())
    assert "layer_types" in config and "sparse_attention_config" not in config
    cfg = M3Config.from_hf(config)
    assert cfg.num_kv_heads == cfg.msa.index_heads == 2 and cfg.sparse_layer_ids == [1, 2, 3]


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tiny_shapes_take_the_tp_sizes_the_parallel_tests_run(tp):
    """``test_tensor_parallel``'s GPU half runs ``m3-tiny-gqa`` and its EAGLE3 draft at TP = the GPUs present
    (2, 4 or 8, EP = TP too) and ``m3-tiny``'s pair at up to TP4, which its 4 query heads refuse beyond."""
    from sglang_m3.config import M3ConfigError
    from sglang_m3.parallel import check_parallel
    from sglang_m3.tiny.build import released_text_config
    from sglang_m3.tiny.eagle3 import draft_config

    def cfg(name):
        return M3Config.from_text_dict(released_text_config(name), "MiniMaxM3SparseForCausalLM")

    for ep in (1, tp):
        check_parallel(cfg("m3-tiny-gqa"), tp, ep)
    assert draft_config(released_text_config("m3-tiny-gqa"))["num_attention_heads"] % tp == 0
    if tp <= 4:
        check_parallel(cfg("m3-tiny"), tp, tp)
    else:
        with pytest.raises(M3ConfigError, match=f"--tp-size={tp} does not divide num_attention_heads=4"):
            check_parallel(cfg("m3-tiny"), tp, 1)
