"""A released-format checkpoint whose MoE width SGLang's CPU path pads (48 -> 64).

SGLang rewrites ``intermediate_size`` in the config on CPU and keeps the checkpoint's value
as ``original_intermediate_size``; the model must build the checkpoint's shapes. fp32 on both
sides, so transformers' greedy continuation is matched token for token.
"""

from __future__ import annotations

import pytest
import sglang as sgl
import torch
from sglang_m3.tiny import default_checkpoint

from .conftest import ENGINE_ARGS
from .hf_reference import greedy, load_hf, prompt_logprobs
from .parity_helpers import LOGPROB_ATOL, NEW_TOKENS, engine_greedy, engine_logprobs, stop_engine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def w48():
    return default_checkpoint("m3-tiny-w48", "vl")


def test_padded_moe_width_serves_like_transformers(w48, corpus_ids):
    prompts = [corpus_ids[:40], corpus_ids[200:330]]  # dense-equivalent and past the sparse threshold (64)
    engine = sgl.Engine(model_path=str(w48), **ENGINE_ARGS)
    try:
        server_cfg = engine.get_server_info()
        assert server_cfg["attention_backend"] == "m3_msa"
        ours = engine_greedy(engine, prompts)
        lps = [engine_logprobs(engine, ids) for ids in prompts]
    finally:
        stop_engine(engine)
    hf = load_hf(w48, "vl")[0]
    assert hf.config.text_config.intermediate_size == 48
    for ids, got, lp in zip(prompts, ours, lps):
        torch.testing.assert_close(lp, prompt_logprobs(hf, ids), atol=LOGPROB_ATOL, rtol=0)
        assert got == greedy(hf, ids, NEW_TOKENS), f"prompt of {len(ids)} tokens diverged"
