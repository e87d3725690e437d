"""M3Config parsing: both spellings of the released config, and every refusal."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from sglang_m3.config import M3Config, M3ConfigError, check_page_size

RELEASED = Path(__file__).resolve().parents[2] / "python" / "sglang_m3" / "assets" / "minimax-m3-config.json"


@pytest.fixture(scope="module")
def released() -> dict:
    if not RELEASED.exists():
        pytest.fail(f"released config missing at {RELEASED}")
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
        intermediate_size=16384,
        vocab_size=200064,
        draft_vocab_size=32000,
        rms_norm_eps=1e-6,
        rope_theta=5e6,
        eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 30, 57]},
    )
    d.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(d))
    return str(tmp_path)


def test_draft_config_reads_the_pool_geometry(tmp_path, released):
    from sglang_m3.config import DraftConfig

    draft = DraftConfig.from_path(_draft_dir(tmp_path), M3Config.from_hf(released))
    assert (draft.num_layers, draft.num_kv_heads) == (1, 4)


def test_draft_sizes_sglang_padded_on_cpu_read_the_originals(tmp_path, released):
    """SGLang's CPU path pads a draft's head counts (2 KV heads at TP8: to 8, q heads with them) and MLP
    width as it does the target's, keeping original_*: the checkpoint's shapes are the originals."""
    from sglang_m3.config import DraftConfig

    padded = dict(
        num_attention_heads=192,
        original_num_attention_heads=48,
        num_key_value_heads=16,
        original_total_num_kv_heads=4,
        intermediate_size=16896,
        original_intermediate_size=16384,
    )
    draft = DraftConfig.from_path(_draft_dir(tmp_path, **padded), M3Config.from_hf(released))
    assert (draft.num_heads, draft.num_kv_heads, draft.intermediate_size) == (48, 4, 16384)


@pytest.mark.parametrize(
    "changes,field",
    [
        (dict(head_dim=64), "head_dim=64"),
        (dict(hidden_size=4096), "hidden_size=4096"),
        (dict(num_hidden_layers=2), "num_hidden_layers=2"),
        (dict(architectures=["LlamaForCausalLM"]), "architectures[0]='LlamaForCausalLM'"),
        (dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 30, 60]}), "ids [60]"),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "rope_scaling"),
        (dict(vocab_size=32000, draft_vocab_size=None), "draft vocab_size=32000: must equal the target's 200064"),
        (dict(draft_vocab_size=300000), "draft_vocab_size=300000 exceeds its vocab_size=200064"),
        (dict(num_key_value_heads=0), "num_key_value_heads=0: must be a positive integer"),
        (dict(intermediate_size=None), "'intermediate_size'"),
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


def _text(released, **changes):
    d = copy.deepcopy(released)
    d["text_config"].update(changes)
    return d


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(num_key_value_heads=0), "num_key_value_heads=0: must be a positive integer"),
        (dict(num_attention_heads=-64), "num_attention_heads=-64: must be a positive integer"),
        (  # SGLang's padded copy absent: the message names the field the value came from
            dict(original_num_attention_heads=None, num_attention_heads=0),
            "^num_attention_heads=0: must be a positive integer",
        ),
        (dict(original_num_attention_heads=0), "^original_num_attention_heads=0: must be a positive integer"),
        (dict(intermediate_size=0), "intermediate_size=0"),
        (dict(num_experts_per_tok=129), "num_experts_per_tok=129 exceeds num_local_experts=128"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling.rope_type='yarn'"),
        (dict(rope_parameters={"rope_type": "llama3"}), "rope_parameters.rope_type='llama3'"),
        (dict(partial_rotary_factor=1.5), "partial_rotary_factor=1.5"),
    ],
)
def test_refusals_of_text_fields(released, changes, message):
    with pytest.raises(M3ConfigError, match=message):
        M3Config.from_hf(_text(released, **changes))


def test_sparse_layer_with_an_index_value_path_is_refused(released):
    flags = [0, 0, 0] + [1] * 57
    flags[7] = 0
    with pytest.raises(M3ConfigError, match=r"sparse_disable_index_value\[7\]=0 on sparse layer 7"):
        M3Config.from_hf(_variant(released, sparse_disable_index_value=flags))
    flags = [1] * 60  # dense layers may say either
    assert M3Config.from_hf(_variant(released, sparse_disable_index_value=flags)).num_layers == 60


def test_rotary_dims_follow_transformers_rule(released, caplog):
    """transformers rotates head_dim x partial_rotary_factor (1.0 when absent) and ignores rotary_dim."""
    from transformers.models.minimax_m3_vl import MiniMaxM3VLTextConfig

    for changes, dims in [
        (dict(), 64),  # released: rotary_dim 64 and factor 0.5 agree
        (dict(partial_rotary_factor=None), 128),  # no factor anywhere: full rotation
        (dict(partial_rotary_factor=None, rope_parameters={"rope_theta": 5e6, "partial_rotary_factor": 0.25}), 32),
        (dict(partial_rotary_factor=None, rope_scaling={"rope_type": "default", "partial_rotary_factor": 0.25}), 32),
    ]:
        text = {k: v for k, v in _text(released, **changes)["text_config"].items() if v is not None}
        ours = M3Config.from_text_dict(text, "MiniMaxM3SparseForCausalLM")
        hf = MiniMaxM3VLTextConfig(**copy.deepcopy(text))
        hf_dims = int(hf.head_dim * hf.rope_parameters.get("partial_rotary_factor", 1.0))
        assert ours.rotary_dim == hf_dims == dims, changes
        assert M3Config.from_hf(hf).rotary_dim == dims
    text = {k: v for k, v in _text(released, partial_rotary_factor=None)["text_config"].items() if v is not None}
    with caplog.at_level("WARNING"):
        M3Config.from_text_dict(dict(text, rms_norm_eps=1e-5), "MiniMaxM3SparseForCausalLM")  # a fresh parse
    assert "rotary_dim=64 disagrees with head_dim=128 x partial_rotary_factor=1.0 = 128" in caplog.text


def test_rope_theta_from_released_rope_scaling(released):
    text = dict(released["text_config"], rope_scaling={"rope_type": "default", "rope_theta": 1e6})
    del text["rope_theta"]
    assert M3Config.from_text_dict(text, "MiniMaxM3SparseForCausalLM").rope_theta == 1e6


def test_sizes_sglang_padded_on_cpu_read_the_originals(released):
    """SGLang's CPU path pads intermediate sizes and head counts in the config, keeping original_*."""
    padded = _text(
        released,
        intermediate_size=3104,
        original_intermediate_size=3072,
        num_attention_heads=72,
        original_num_attention_heads=64,
    )
    cfg = M3Config.from_hf(padded)
    assert (cfg.moe_intermediate_size, cfg.num_heads) == (3072, 64)


def test_parse_is_cached(released):
    assert M3Config.from_hf(copy.deepcopy(released)) is M3Config.from_hf(copy.deepcopy(released))
