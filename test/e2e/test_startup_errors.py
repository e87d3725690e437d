"""Configs and flags the plugin cannot serve stop SGLang at start-up with a message naming field and value."""

from __future__ import annotations

import json
import re
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
        lambda c: c.update(layer_types=["full_attention", "sliding_attention", *c["layer_types"][2:]]),
    )
    with pytest.raises(M3ConfigError, match=r"unknown layer type layer_types\[1\]='sliding_attention'"):
        _engine(bad)


def _launch_server_output(model_path, *flags: str) -> str:
    """``python -m sglang.launch_server`` on CPU, expected to fail at start-up; its output.

    A subprocess, because a scheduler that fails while loading takes its parent process down
    (SGLang kills the launching process tree)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(model_path),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--disable-cuda-graph",
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    return proc.stderr + proc.stdout


@pytest.mark.slow
def test_launch_server_exits_with_the_message(tiny_vl, tmp_path):
    bad = _variant(
        tiny_vl, tmp_path / "bad", lambda c: c["text_config"]["sparse_attention_config"].update(sparse_score_type="lse")
    )
    assert "sparse_score_type='lse'" in _launch_server_output(bad)


@pytest.mark.slow
def test_quantization_other_than_fp8_is_refused_naming_it(tiny_vl):
    """The model refuses a method it has not been validated with (bf16: SGLang's own dtype check passes first)."""
    out = _launch_server_output(tiny_vl, "--dtype", "bfloat16", "--quantization", "w8a8_int8")
    assert "quantization='w8a8_int8': sglang-m3 serves MiniMax-M3 unquantised or with ['fp8']" in out, out[-3000:]


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
        (
            dict(speculative_algorithm="EAGLE3", speculative_accept_threshold_single=0.5),
            r"--speculative-accept-threshold-single=0\.5: .*relaxed acceptance",
        ),
        (
            dict(speculative_algorithm="EAGLE3", speculative_accept_threshold_acc=0.7),
            "--speculative-accept-threshold-acc=0.7",
        ),
        (dict(speculative_algorithm="EAGLE3", speculative_adaptive=True), "--speculative-adaptive=True"),
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


@pytest.mark.parametrize(
    "flags,message",
    [
        (dict(pp_size=2), "--pp-size=2"),
        (dict(enable_dp_attention=True), "--enable-dp-attention=True"),
        (dict(enable_hierarchical_cache=True), "--enable-hierarchical-cache=True"),
    ],
)
def test_unsupported_parallel_and_cache_features(tiny_vl, flags, message):
    with pytest.raises(ValueError, match=message):
        _engine(tiny_vl, **flags)


def _draft_with(tiny_draft, dst, edit_config=None, edit_tensors=None):
    """A copy of the tiny draft with its config and/or tensors edited."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for f in tiny_draft.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            (dst / f.name).symlink_to(f)
    config = json.loads((tiny_draft / "config.json").read_text())
    (edit_config or (lambda c: None))(config)
    (dst / "config.json").write_text(json.dumps(config))
    for f in tiny_draft.glob("*.safetensors"):
        tensors = load_file(f)
        (edit_tensors or (lambda t: None))(tensors)
        save_file(tensors, dst / f.name, metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize(
    "edit_config,edit_tensors,message",
    [
        (lambda c: c.update(intermediate_size=64), None, r"the config implies \(64, 64\) .*intermediate_size=64"),
        (None, lambda t: t["d2t"].__setitem__(5, 10_000), r"d2t\[5\]=10000 maps draft id 5 to target id 10005"),
    ],
)
@pytest.mark.slow
def test_draft_tensors_that_do_not_fit_are_refused(tiny_vl, tiny_draft, tmp_path, edit_config, edit_tensors, message):
    bad = _draft_with(tiny_draft, tmp_path / "draft", edit_config, edit_tensors)
    out = _launch_server_output(
        tiny_vl,
        *("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(bad)),
        *("--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"),
    )
    assert re.search(message, out), out[-3000:]
