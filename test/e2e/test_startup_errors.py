"""Configs and flags the plugin cannot serve stop SGLang at start-up with a message naming field and value."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import sglang as sgl
from sglang_m3.config import M3ConfigError


def _variant(src, dst, edit):
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f)
    config = json.loads((src / "config.json").read_text())
    edit(config)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _engine(path, **kw):
    return sgl.Engine(model_path=str(path), device="cpu", dtype="float32", disable_cuda_graph=True, **kw)


def test_conflicting_page_size(tiny_vl):
    with pytest.raises(M3ConfigError, match=r"page_size=32 conflicts .*=16"):
        _engine(tiny_vl, page_size=32)


def test_foreign_attention_backend(tiny_vl):
    with pytest.raises(ValueError, match="--attention-backend='triton'"):
        _engine(tiny_vl, attention_backend="triton")


def test_unsupported_kv_cache_dtype(tiny_vl):
    with pytest.raises(ValueError, match="--kv-cache-dtype='fp8_e5m2'"):
        _engine(tiny_vl, kv_cache_dtype="fp8_e5m2")


def test_index_heads_must_equal_kv_heads(tiny_vl, tmp_path):
    bad = _variant(
        tiny_vl,
        tmp_path / "bad",
        lambda c: c["text_config"]["sparse_attention_config"].update(sparse_num_index_heads=2),
    )
    with pytest.raises(M3ConfigError, match=r"sparse_num_index_heads\)=2 != num_key_value_heads=1"):
        _engine(bad)


def test_unknown_layer_type(tiny_gqa_text, tmp_path):
    bad = _variant(
        tiny_gqa_text,
        tmp_path / "bad",
        lambda c: c.update(layer_types=["full_attention", "sliding_attention", "minimax_m3_sparse"]),
    )
    with pytest.raises(M3ConfigError, match=r"unknown layer type layer_types\[1\]='sliding_attention'"):
        _engine(bad)


@pytest.mark.slow
def test_launch_server_exits_with_the_message(tiny_vl, tmp_path):
    bad = _variant(
        tiny_vl, tmp_path / "bad", lambda c: c["text_config"]["sparse_attention_config"].update(sparse_score_type="lse")
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(bad),
            "--device",
            "cpu",
            "--disable-cuda-graph",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "sparse_score_type='lse'" in proc.stderr + proc.stdout


@pytest.mark.parametrize(
    "spec,message",
    [
        (dict(speculative_algorithm="NGRAM"), "--speculative-algorithm='NGRAM'"),
        (dict(speculative_algorithm="EAGLE3"), "--speculative-draft-model-path is required"),
        (
            dict(speculative_algorithm="EAGLE3", speculative_num_steps=3, speculative_eagle_topk=2),
            "--speculative-eagle-topk=2",
        ),
        (dict(speculative_algorithm="EAGLE3", speculative_num_steps=3), "needs --speculative-eagle-topk 1"),
    ],
)
def test_speculative_refusals(tiny_vl, tiny_draft, spec, message):
    if spec.get("speculative_algorithm") == "EAGLE3" and len(spec) > 1:
        spec = dict(spec, speculative_draft_model_path=str(tiny_draft))
    with pytest.raises(ValueError, match=message):
        _engine(tiny_vl, **spec)


def test_draft_with_a_foreign_head_dim(tiny_vl, tiny_draft, tmp_path):
    bad = _variant(tiny_draft, tmp_path / "draft", lambda c: c.update(head_dim=16))
    with pytest.raises(M3ConfigError, match="draft head_dim=16: must equal the target's 32"):
        _engine(tiny_vl, speculative_algorithm="EAGLE3", speculative_draft_model_path=str(bad))
