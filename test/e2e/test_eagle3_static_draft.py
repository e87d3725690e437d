"""The EAGLE3 draft's graph bodies over padded static buffers (``spec/draft_graphs.py``), run eagerly on CPU.

``SGLANG_M3_DRAFT_STATIC_BS=2,4`` makes the worker run the draft chain and the catch-up pass
exactly as the CUDA graphs capture them: live rows copied into static buffers of the smallest
size >= the batch, padded rows writing their KV into the reserved slot 0. Batches of 1 and 3
requests replay sizes 2 and 4 (padded), a batch of 6 runs the eager path. Greedy output must equal
plain (non-speculative) decoding token for token (fp32), and the draft must propose the same
tokens either way: the same prompts accept the same drafts through the padded path and the eager one.
"""

from __future__ import annotations

import pytest
import sglang as sgl
from sglang_m3.spec.draft_graphs import STATIC_BS_ENV

from .conftest import ENGINE_ARGS, SPEC_ARGS, prompts_from
from .parity_helpers import engine_greedy, stop_engine

pytestmark = pytest.mark.slow

NEW = 40
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def prompts(corpus_ids):
    return prompts_from(corpus_ids)


@pytest.fixture(scope="module")
def reference(tiny_vl, prompts):
    engine = sgl.Engine(model_path=str(tiny_vl), **ENGINE_ARGS)
    try:
        return engine_greedy(engine, prompts, NEW)
    finally:
        stop_engine(engine)


@pytest.fixture(scope="module")
def spec_engine(tiny_vl, tiny_draft, reference):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(STATIC_BS_ENV, "2,4")  # read by the scheduler process at start-up
        engine = sgl.Engine(
            model_path=str(tiny_vl), speculative_draft_model_path=str(tiny_draft), **SPEC_ARGS, **ENGINE_ARGS
        )
    yield engine
    stop_engine(engine)


def _stats(engine) -> dict:
    return engine.get_server_info()["internal_states"][0]["sglang_m3_eagle3"]


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in ("chain_replays", "catch_up_replays", "eager_chain", "eager_catch_up")}


def _histograms(outs) -> list:
    return [o["meta_info"]["spec_correct_drafts_histogram"] for o in outs]


def test_padded_batches_equal_plain_decoding(spec_engine, reference, prompts):
    before = _stats(spec_engine)
    assert before["draft_graphs"] == "static" and before["sizes"] == [2, 4]
    batched = spec_engine.generate(input_ids=prompts[:3], sampling_params=GREEDY)  # 3 rows replayed as 4
    alone = [spec_engine.generate(input_ids=[p], sampling_params=GREEDY)[0] for p in prompts[:3]]  # 1 as 2
    assert [o["output_ids"] for o in batched] == reference[:3]
    assert [o["output_ids"] for o in alone] == reference[:3]
    assert _histograms(alone) == _histograms(batched)
    steps = sum(o["meta_info"]["spec_verify_ct"] for o in batched)
    assert (3 * NEW - 3) / steps > 3.0, steps  # the memorised continuations: whole chains accepted
    delta = _delta(_stats(spec_engine), before)
    assert delta["chain_replays"] >= steps // 3 and delta["catch_up_replays"] >= steps // 3, delta
    assert delta["eager_chain"] == delta["eager_catch_up"] == 0, delta


def test_above_the_largest_size_runs_eagerly_with_the_same_drafts(spec_engine, reference, prompts):
    padded = spec_engine.generate(input_ids=prompts[:3], sampling_params=GREEDY)
    before = _stats(spec_engine)
    eager = spec_engine.generate(input_ids=prompts + prompts[:2], sampling_params=GREEDY)  # 6 rows > 4
    delta = _delta(_stats(spec_engine), before)
    assert [o["output_ids"] for o in eager] == reference + reference[:2]
    assert _histograms(eager)[:3] == _histograms(padded)
    assert delta["eager_chain"] > 0 and delta["eager_catch_up"] > 0, delta
    assert delta["chain_replays"] == delta["catch_up_replays"] == 0, delta


def test_a_shrinking_batch_moves_between_the_paths(spec_engine, reference, prompts):
    """Requests end one after another: 6 rows (eager), 5, then 4 and fewer (padded static buffers), so
    requests see draft KV and seeds written by both paths."""
    lens = [40, 36, 30, 22, 12, 6]
    cycle = prompts + prompts[:2]
    before = _stats(spec_engine)
    outs = spec_engine.generate(input_ids=cycle, sampling_params=[dict(GREEDY, max_new_tokens=n) for n in lens])
    delta = _delta(_stats(spec_engine), before)
    assert [o["output_ids"] for o in outs] == [reference[i % 4][:n] for i, n in enumerate(lens)]
    assert delta["eager_catch_up"] > 0 and delta["catch_up_replays"] > 0, delta
