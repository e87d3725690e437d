"""One KV group (VL checkpoint, released config spelling): sglang.Engine vs transformers 5.12.1 as is.

Tolerance: both sides compute in fp32 with the same math; only reduction order may
differ, so prompt log-probs agree to 1e-4 absolute (observed: ~0) and greedy
continuations agree token for token.
"""

from __future__ import annotations

import pytest
import sglang as sgl
import torch

from .conftest import ENGINE_ARGS, prompts_from
from .hf_reference import greedy, load_hf, prompt_logprobs
from .parity_helpers import LOGPROB_ATOL, NEW_TOKENS, engine_greedy, engine_logprobs, stop_engine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vl_engine(tiny_vl):
    # Small chunks so long prompts go through chunked prefill (extend on a cached prefix).
    engine = sgl.Engine(model_path=str(tiny_vl), chunked_prefill_size=64, **ENGINE_ARGS)
    yield engine
    stop_engine(engine)


@pytest.fixture(scope="module")
def hf_vl(tiny_vl):
    model, info = load_hf(tiny_vl, "vl")
    return model, info


def test_engine_runs_through_the_plugin(vl_engine):
    info = vl_engine.get_server_info()
    assert info["attention_backend"] == "m3_msa"
    assert info["page_size"] == 16  # the checkpoint's index block size, no --page-size given


def test_checkpoint_loads_unchanged_in_transformers(hf_vl):
    _, info = hf_vl
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def test_vl_logits_match_transformers(vl_engine, hf_vl, corpus_ids):
    for ids in prompts_from(corpus_ids):
        ours, ref = engine_logprobs(vl_engine, ids), prompt_logprobs(hf_vl[0], ids)
        torch.testing.assert_close(ours, ref, atol=LOGPROB_ATOL, rtol=0)


def test_vl_greedy_matches_transformers_batched(vl_engine, hf_vl, corpus_ids):
    prompts = prompts_from(corpus_ids)
    ours = engine_greedy(vl_engine, prompts)  # one mixed-length batch
    for ids, got in zip(prompts, ours):
        assert got == greedy(hf_vl[0], ids, NEW_TOKENS), f"prompt of {len(ids)} tokens diverged"


def test_vl_radix_prefix_hit_is_identical(vl_engine, corpus_ids):
    ids = corpus_ids[1100:1300]
    first = vl_engine.generate(input_ids=[ids], sampling_params={"max_new_tokens": 8, "temperature": 0})[0]
    again = vl_engine.generate(input_ids=[ids], sampling_params={"max_new_tokens": 8, "temperature": 0})[0]
    assert again["meta_info"]["cached_tokens"] >= 192  # whole pages of the 200-token prompt come from the tree
    assert again["output_ids"] == first["output_ids"]


def test_partial_weight_updates_reach_the_model(vl_engine, tiny_vl, corpus_ids):
    """SGLang's ``update_weights_from_tensor`` hands the model any subset of the checkpoint (RL trainers
    send buckets): one part of a fused weight (a sparse layer's v rows of ``qkv_proj``) and a whole
    one (layer 0's o_proj) take effect, and restoring them gives the same log-probs again (the cache
    is flushed with each update). Last in the module: it changes the shared engine's weights."""
    from safetensors import safe_open

    names = [
        "language_model.model.layers.1.self_attn.v_proj.weight",
        "language_model.model.layers.0.self_attn.o_proj.weight",
    ]
    original = {}
    for f in sorted(tiny_vl.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            original.update({n: st.get_tensor(n) for n in names if n in st.keys()})
    assert set(original) == set(names)
    ids = corpus_ids[:300]  # past one top-k x block window: layer 1 attends sparsely
    before = engine_logprobs(vl_engine, ids)
    for name in names:
        ok, message = vl_engine.update_weights_from_tensor([(name, torch.zeros_like(original[name]))])[:2]
        assert ok, message
        changed = engine_logprobs(vl_engine, ids)
        assert (changed - before).abs().max() > 1e-2, name
        ok, message = vl_engine.update_weights_from_tensor([(name, original[name])])[:2]
        assert ok, message
        torch.testing.assert_close(engine_logprobs(vl_engine, ids), before, atol=1e-6, rtol=0)
