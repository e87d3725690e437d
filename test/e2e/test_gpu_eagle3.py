"""On a GPU: CUDA-graph decode and verify, and EAGLE3 chain speculation, against eager decoding.

fp32 model and KV, IEEE fp32 dots (``conftest._triton_env``), so greedy output can be
compared token for token.
Graph replays pad the batch to a captured size, which may change the fused MoE's tile
config (and so its reduction order): log-probs are compared to 1e-5, tokens exactly.
With graphs on, the EAGLE3 draft's chain and catch-up replay their own CUDA graphs
(``spec/draft_graphs.py``); the batch of 3 replays the captured size 4 (padded rows).
EAGLE3 with graphs runs under SGLang's overlap scheduler (the default: forward and copy streams,
the next step prepared while this one runs); eager EAGLE3 runs with ``--disable-overlap-schedule``
(the synchronous path), so both paths are covered without another engine.
"""

from __future__ import annotations

import os

import pytest
import sglang as sgl

from .conftest import SPEC_ARGS, prompts_from
from .parity_helpers import engine_greedy, engine_output_logprobs, stop_engine, used_tokens_settle_to_zero

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
NEW = 40
BASE = dict(device="cuda", dtype="float32", log_level="error", max_total_tokens=8192, mem_fraction_static=0.3)
GRAPHS = dict(BASE, disable_cuda_graph=False, cuda_graph_max_bs_decode=8)
EAGER = dict(BASE, disable_cuda_graph=True)


def _run(model, args, prompts, **extra):
    engine = sgl.Engine(model_path=str(model), **args, **extra)
    try:
        greedy = engine_greedy(engine, prompts, NEW)
        logprobs, outs = engine_output_logprobs(engine, prompts[:2])
        stats = [o["meta_info"].get("spec_verify_ct") for o in outs]
        padded = engine_greedy(engine, prompts[:3], NEW)  # 3 requests: replayed as the captured size 4
        info = engine.get_server_info()
        draft = info["internal_states"][0].get("sglang_m3_eagle3")  # EAGLE3 runs only
        draft = draft and dict(draft, overlap=not info["disable_overlap_schedule"])
        engine.flush_cache()
        assert used_tokens_settle_to_zero(engine)
    finally:
        stop_engine(engine)
    return greedy, logprobs, stats, padded, draft


@pytest.fixture(scope="module")
def runs(tiny_vl, tiny_draft, corpus_ids):
    assert os.environ["TRITON_F32_DEFAULT"] == "ieee"  # conftest._triton_env
    prompts = prompts_from(corpus_ids)
    spec = dict(SPEC_ARGS, speculative_draft_model_path=str(tiny_draft))
    return {
        "eager": _run(tiny_vl, EAGER, prompts),
        "graphs": _run(tiny_vl, GRAPHS, prompts),
        "eagle3_eager": _run(tiny_vl, EAGER, prompts, **spec, disable_overlap_schedule=True),
        "eagle3_graphs": _run(tiny_vl, GRAPHS, prompts, **spec),
    }


@pytest.mark.parametrize("variant", ["graphs", "eagle3_eager", "eagle3_graphs"])
def test_token_exact_against_eager_decode(runs, variant):
    greedy, logprobs, _, padded, _ = runs[variant]
    ref_greedy, ref_logprobs, _, ref_padded, _ = runs["eager"]
    assert greedy == ref_greedy
    assert padded == ref_padded
    for got, want in zip(logprobs, ref_logprobs):
        assert got == pytest.approx(want, abs=1e-5)


def test_eagle3_draft_passes_replay_cuda_graphs(runs):
    """With overlap scheduling on (the token-exact check above covers its output)."""
    graphs, eager = runs["eagle3_graphs"][4], runs["eagle3_eager"][4]
    assert graphs["overlap"] and not eager["overlap"], (graphs, eager)
    assert graphs["draft_graphs"] == "cuda_graph" and graphs["sizes"][-1] >= 4, graphs
    assert graphs["chain_replays"] > 0 and graphs["catch_up_replays"] > 0, graphs
    assert graphs["eager_chain"] == graphs["eager_catch_up"] == 0, graphs  # every batch here is <= 4 requests
    assert eager["draft_graphs"] == "off" and eager["eager_catch_up"] > 0, eager


def test_eagle3_accepts_drafts_on_gpu(runs):
    for variant in ("eagle3_eager", "eagle3_graphs"):
        steps = runs[variant][2]
        # 12 tokens: 1 from the prefill, 11 from verify steps; the draft memorised these prompts' continuations.
        assert all(s is not None and s <= 6 for s in steps), (variant, steps)
