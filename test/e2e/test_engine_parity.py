"""sglang.Engine (our plugin, CPU, fp32) against transformers' MiniMaxM3VL* classes.

Tolerance: both sides compute in fp32 with the same math; only reduction order may
differ, so prompt log-probs agree to 1e-4 absolute (observed: ~0) and greedy
continuations agree token for token.
"""

from __future__ import annotations

import pytest
import sglang as sgl
import torch

from .conftest import ENGINE_ARGS, prompts_from
from .hf_reference import greedy, load_hf, per_group_indexer, prompt_logprobs

pytestmark = pytest.mark.slow
LOGPROB_ATOL = 1e-4
NEW_TOKENS = 40


def engine_logprobs(engine, ids):
    out = engine.generate(input_ids=[ids], sampling_params={"max_new_tokens": 1, "temperature": 0},
                          return_logprob=True, logprob_start_len=0)
    return torch.tensor([lp for lp, _, _ in out[0]["meta_info"]["input_token_logprobs"][1:]])


def engine_greedy(engine, prompts):
    outs = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": NEW_TOKENS, "temperature": 0,
                                                               "ignore_eos": True})
    return [o["output_ids"] for o in outs]


# ---------------------------------------------------------------- one KV group, VL checkpoint, released config spelling


@pytest.fixture(scope="module")
def vl_engine(tiny_vl):
    # Small chunks so long prompts go through chunked prefill (extend on a cached prefix).
    engine = sgl.Engine(model_path=str(tiny_vl), chunked_prefill_size=64, **ENGINE_ARGS)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def hf_vl(tiny_vl):
    model, info = load_hf(tiny_vl, "vl")
    return model, info


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


# ---------------------------------------------------------------- two KV groups, text checkpoint, normalised spelling


@pytest.fixture(scope="module")
def gqa_engine(tiny_gqa_text):
    engine = sgl.Engine(model_path=str(tiny_gqa_text), **ENGINE_ARGS)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def hf_gqa(tiny_gqa_text):
    model, info = load_hf(tiny_gqa_text, "text")
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model


def test_gqa_logits_match_per_group_reference(gqa_engine, hf_gqa, corpus_ids):
    for ids in prompts_from(corpus_ids):
        with per_group_indexer():
            ref = prompt_logprobs(hf_gqa, ids)
        torch.testing.assert_close(engine_logprobs(gqa_engine, ids), ref, atol=LOGPROB_ATOL, rtol=0)


def test_gqa_per_group_differs_from_transformers_5_12_shared_selection(hf_gqa, corpus_ids):
    ids = prompts_from(corpus_ids)[-1]  # 317 tokens: 20 blocks, top-4
    with per_group_indexer():
        per_group = prompt_logprobs(hf_gqa, ids)
    shared = prompt_logprobs(hf_gqa, ids)
    below_threshold = slice(0, 62)  # <= 64 keys: both rules keep every block
    torch.testing.assert_close(per_group[below_threshold], shared[below_threshold], atol=LOGPROB_ATOL, rtol=0)
    assert (per_group - shared).abs().max() > 1e-2


def test_gqa_greedy_matches_per_group_reference(gqa_engine, hf_gqa, corpus_ids):
    prompts = prompts_from(corpus_ids)
    ours = engine_greedy(gqa_engine, prompts)
    with per_group_indexer():
        for ids, got in zip(prompts, ours):
            assert got == greedy(hf_gqa, ids, NEW_TOKENS), f"prompt of {len(ids)} tokens diverged"
