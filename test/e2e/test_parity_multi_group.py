"""Two KV groups (text checkpoint, normalised spelling): sglang.Engine vs a per-group reference.

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
from .parity_helpers import LOGPROB_ATOL, NEW_TOKENS, engine_greedy, engine_logprobs, stop_engine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gqa_engine(tiny_gqa_text):
    engine = sgl.Engine(model_path=str(tiny_gqa_text), **ENGINE_ARGS)
    yield engine
    stop_engine(engine)


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
