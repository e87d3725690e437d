"""M3Config parsing: both spellings of the released config, and every refusal."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from sglang_m3.config import M3Config, M3ConfigError, check_page_size

RELEASED = Path(__file__).resolve().parents[3] / "shared" / "data" / "minimax-m3" / "config.json"


@pytest.fixture(scope="module")
def released() -> dict:
    if not RELEASED.exists():
        pytest.fail(f"released config missing at {RELEASED} (shared/ must sit beside the repo)")
    return json.loads(RELEASED.read_text())


def _check_released_values(cfg: M3Config) -> None:
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (60, 6144, 64, 4, 128)
    assert cfg.dense_layer_ids == [0, 1, 2] and cfg.sparse_layer_ids == list(range(3, 60))
    assert cfg.moe_layers == tuple([False] * 3 + [True] * 57)
    assert (cfg.msa.index_heads, cfg.msa.index_dim, cfg.msa.block_size, cfg.msa.topk_blocks, cfg.msa.local_blocks) == (
        4,
        128,
        128,
        16,
        1,
    )
    assert (cfg.rotary_dim, cfg.rope_theta, cfg.vocab_size) == (64, 5e6, 200064)
    assert (cfg.num_experts, cfg.top_k, cfg.routed_scaling_factor) == (128, 4, 2.0)
    assert (cfg.dense_intermediate_size, cfg.moe_intermediate_size, cfg.shared_intermediate_size) == (12288, 3072, 3072)


def test_released_spelling(released):
    cfg = M3Config.from_hf(released)
    assert cfg.architecture == "MiniMaxM3SparseForConditionalGeneration"
    _check_released_values(cfg)


def test_transformers_normalised_spelling(released):
    from transformers.models.minimax_m3_vl import (
        MiniMaxM3VLConfig,
        MiniMaxM3VLTextConfig,
    )

    vl = MiniMaxM3VLConfig(text_config=copy.deepcopy(released["text_config"]), architectures=released["architectures"])
    assert not hasattr(vl.text_config, "sparse_attention_config")  # transformers dropped the released keys
    _check_released_values(M3Config.from_hf(vl))
    text = MiniMaxM3VLTextConfig(**copy.deepcopy(released["text_config"]))
    _check_released_values(M3Config.from_hf(text))


def _variant(released, **sparse_changes):
    d = copy.deepcopy(released)
    d["text_config"]["sparse_attention_config"].update(sparse_changes)
    return d


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(sparse_score_type="lse"), "sparse_score_type='lse'"),
        (dict(sparse_init_block=1), "sparse_init_block=1"),
        (dict(sparse_num_index_heads=1), r"index_n_heads \(sparse_num_index_heads\)=1 != num_key_value_heads=4"),
        (dict(sparse_attention_freq=[0, 2] + [1] * 58), r"unknown layer type sparse_attention_freq\[1\]=2"),
        (dict(sparse_attention_freq=[1] * 59), "sparse_attention_freq has 59 entries"),
    ],
)
def test_refusals_name_field_and_value(released, changes, message):
    with pytest.raises(M3ConfigError, match=message):
        M3Config.from_hf(_variant(released, **changes))


def test_refuses_unknown_normalised_layer_type(released):
    text = dict(
        released["text_config"],
        layer_types=["full_attention"] * 59 + ["sliding_attention"],
        mlp_layer_types=["dense"] * 60,
        architectures=["MiniMaxM3SparseForCausalLM"],
    )
    del text["sparse_attention_config"], text["moe_layer_freq"]
    with pytest.raises(M3ConfigError, match=r"layer_types\[59\]='sliding_attention'"):
        M3Config.from_hf(
            dict(
                text,
                index_n_heads=4,
                index_head_dim=128,
                index_block_size=128,
                index_topk_blocks=16,
                index_local_blocks=1,
            )
        )


def test_refuses_other_activation_and_missing_field(released):
    d = copy.deepcopy(released)
    d["text_config"]["hidden_act"] = "gelu"
    with pytest.raises(M3ConfigError, match="hidden_act='gelu'"):
        M3Config.from_hf(d)
    d = copy.deepcopy(released)
    del d["text_config"]["swiglu_limit"]
    with pytest.raises(M3ConfigError, match="'swiglu_limit'"):
        M3Config.from_hf(d)


def test_page_size_follows_block_and_conflicts_are_refused(released):
    msa = M3Config.from_hf(released).msa
    assert check_page_size(None, msa) == 128
    assert check_page_size(128, msa) == 128
    with pytest.raises(M3ConfigError, match="page_size=64 conflicts .*=128"):
        check_page_size(64, msa)


def test_eagle3_aux_layers_follow_the_plus_one_convention(released):
    from sglang_m3.config import aux_capture_inputs

    # Default outputs (2, N/2, N-3) are captured as the inputs of layers (3, N/2+1, N-2).
    assert aux_capture_inputs(None, M3Config.from_hf(released).num_layers) == (3, 31, 58)
    assert aux_capture_inputs([0, 1, 2], 4) == (1, 2, 3)
    assert aux_capture_inputs([3, 3], 4) == (4, 4)  # the last layer's output: the final pre-norm state
    assert aux_capture_inputs([-1, 0], 4) == (0, 1)  # output -1 = the embeddings = input of layer 0
    with pytest.raises(M3ConfigError, match=r"\[4\]"):
        aux_capture_inputs([1, 4], 4)


def _draft_dir(tmp_path, **changes):
    d = dict(
        architectures=["LlamaForCausalLMEagle3"],
        hidden_size=6144,
        num_attention_heads=48,
        num_key_value_heads=4,
        head_dim=128,
        num_hidden_layers=1,
        eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 30, 57]},
    )
    d.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(d))
    return str(tmp_path)


def test_draft_config_reads_the_pool_geometry(tmp_path, released):
    from sglang_m3.config import DraftConfig

    draft = DraftConfig.from_path(_draft_dir(tmp_path), M3Config.from_hf(released))
    assert (draft.num_layers, draft.num_kv_heads) == (1, 4)


@pytest.mark.parametrize(
    "changes,field",
    [
        (dict(head_dim=64), "head_dim=64"),
        (dict(hidden_size=4096), "hidden_size=4096"),
        (dict(num_hidden_layers=2), "num_hidden_layers=2"),
        (dict(architectures=["LlamaForCausalLM"]), "architectures[0]='LlamaForCausalLM'"),
        (dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 30, 60]}), "ids [60]"),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "rope_scaling"),
    ],
)
def test_draft_config_refusals_name_the_field(tmp_path, released, changes, field):
    from sglang_m3.config import DraftConfig

    with pytest.raises(M3ConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
        DraftConfig.from_path(_draft_dir(tmp_path, **changes), M3Config.from_hf(released))


def test_draft_config_by_hub_id_reads_the_hub_cache(tmp_path, released, monkeypatch):
    """A hub id (as SGLang accepts for --speculative-draft-model-path) resolves through huggingface_hub's cache."""
    import huggingface_hub.constants as hub
    from sglang_m3.config import DraftConfig

    snapshot = tmp_path / "models--acme--m3-eagle3" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    _draft_dir(snapshot)
    (tmp_path / "models--acme--m3-eagle3" / "refs").mkdir()
    (tmp_path / "models--acme--m3-eagle3" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)  # no network here: the cached snapshot must do
    draft = DraftConfig.from_path("acme/m3-eagle3", M3Config.from_hf(released))
    assert (draft.num_layers, draft.num_kv_heads) == (1, 4)
    with pytest.raises(M3ConfigError, match=r"'acme/not-cached': not a local directory"):
        DraftConfig.from_path("acme/not-cached", M3Config.from_hf(released))
