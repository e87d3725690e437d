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
