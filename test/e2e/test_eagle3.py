"""EAGLE3 chain speculation through sglang-m3's worker, on CPU, against plain decoding.

Greedy speculative output must equal greedy non-speculative output token for token
(fp32 model and KV): verify runs the MSA ladder, so any misplaced row, position,
page or draft-KV slot shows up as a different token. The tiny draft memorised the
target's continuations of these prompts, so whole chains are accepted and the accepted
paths (not just rejections) are exercised; chains cross MSA block boundaries (block 16).

The module's engine runs under SGLang's overlap scheduler (the default with EAGLE3): each step's
lengths and draft input reach the worker through the ``FutureMap`` while the host has not yet
processed the previous step. The memory-pressure test runs once more with
``--disable-overlap-schedule`` (the synchronous path).
"""

from __future__ import annotations

import pytest
import sglang as sgl

from .conftest import ENGINE_ARGS, SPEC_ARGS, prompts_from
from .parity_helpers import engine_greedy, engine_output_logprobs, stop_engine, used_tokens_settle_to_zero

pytestmark = pytest.mark.slow

NEW = 40


@pytest.fixture(scope="module")
def prompts(corpus_ids):
    return prompts_from(corpus_ids)


@pytest.fixture(scope="module")
def probes(tiny_vl):
    """The 8 first probe prompts (the tiny draft memorised their continuations too)."""
    from sglang_m3.tiny.prompts import probe_prompts
    from transformers import AutoTokenizer

    return probe_prompts(AutoTokenizer.from_pretrained(tiny_vl))[:8]


@pytest.fixture(scope="module")
def reference(tiny_vl, prompts, probes):
    """Greedy outputs and per-token log-probs of a plain engine (started and stopped first), and the
    probes' greedy outputs."""
    engine = sgl.Engine(model_path=str(tiny_vl), **ENGINE_ARGS)
    try:
        greedy = engine_greedy(engine, prompts, NEW)
        logprobs, _ = engine_output_logprobs(engine, prompts[:2])
        probe_greedy = engine_greedy(engine, probes, NEW)
    finally:
        stop_engine(engine)
    return greedy, logprobs, probe_greedy


@pytest.fixture(scope="module")
def spec_engine(tiny_vl, tiny_draft, reference):
    engine = sgl.Engine(
        model_path=str(tiny_vl), speculative_draft_model_path=str(tiny_draft), **SPEC_ARGS, **ENGINE_ARGS
    )
    yield engine
    stop_engine(engine)


def test_overlap_scheduling_is_on(spec_engine):
    assert spec_engine.get_server_info()["disable_overlap_schedule"] is False


def test_greedy_speculation_is_token_exact(spec_engine, reference, prompts):
    outs = spec_engine.generate(
        input_ids=prompts, sampling_params={"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
    )
    assert [o["output_ids"] for o in outs] == reference[0]
    steps = sum(o["meta_info"]["spec_verify_ct"] for o in outs)
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    # The tiny draft memorised these prompts' continuations: whole 3-token chains are accepted.
    assert (tokens - len(prompts)) / steps > 3.0, (steps, tokens)  # the prefill emits one token each
    assert all(o["meta_info"]["spec_correct_drafts_histogram"][3] > 0 for o in outs)


def test_single_requests_match_the_batch(spec_engine, reference, prompts):
    for prompt, expected in zip(prompts[:2], reference[0][:2]):
        out = spec_engine.generate(
            input_ids=[prompt], sampling_params={"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
        )
        assert out[0]["output_ids"] == expected


def test_output_logprobs_match_plain_decoding(spec_engine, reference, prompts):
    # fp32 on CPU, yet not bit-equal: the verify's 4-row GEMMs and plain decoding's 1-row ones sum in
    # different orders (the CPU GEMM's blocking follows the row count: 4 or 8 verify rows as the
    # scheduler batches the two requests): up to 1.3e-4 apart at log-probs near -4 (seen once in many
    # runs). What the test is after, a wrong row's or the draft's log-probs, differs by far more.
    spec, _ = engine_output_logprobs(spec_engine, prompts[:2])
    for got, want in zip(spec, reference[1]):
        assert got == pytest.approx(want, abs=5e-4)


def test_top_k_1_sampling_equals_greedy(spec_engine, reference, prompts):
    # Rejection sampling with a one-token support must reproduce greedy exactly.
    outs = spec_engine.generate(
        input_ids=prompts,
        sampling_params={"max_new_tokens": NEW, "temperature": 0.8, "top_k": 1, "ignore_eos": True},
    )
    assert [o["output_ids"] for o in outs] == reference[0]


def test_sampling_runs_and_frees_every_slot(spec_engine, prompts):
    outs = spec_engine.generate(
        input_ids=prompts * 2,
        sampling_params={"max_new_tokens": 24, "temperature": 1.0, "top_p": 0.9, "ignore_eos": True},
    )
    assert all(len(o["output_ids"]) == 24 for o in outs)
    spec_engine.flush_cache()
    # Every slot is back, over-allocated draft slots included (the draft KV shares the target's).
    assert used_tokens_settle_to_zero(spec_engine)


def test_unsupported_sampling_is_refused_at_admission(spec_engine, prompts):
    """SGLang seeds its sampler only with --enable-deterministic-inference (whose seeded prefill sampler
    is a Triton kernel, so not on CPU); under EAGLE3 a seed it would ignore is refused, not dropped."""
    with pytest.raises(ValueError, match="sampling_params.sampling_seed=1234 needs --enable-deterministic-inference"):
        spec_engine.generate(input_ids=[prompts[0]], sampling_params={"max_new_tokens": 4, "sampling_seed": 1234})
    out = spec_engine.generate(input_ids=[prompts[0]], sampling_params={"max_new_tokens": 4, "temperature": 0})
    assert len(out[0]["output_ids"]) == 4  # the engine keeps serving


def test_acceptance_does_not_depend_on_the_batch(spec_engine, reference, probes):
    """The 8 first probe prompts alone and as one batch: the plain greedy tokens, and every request
    accepts the same drafts."""
    sampling = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
    counts = lambda o: (o["output_ids"], o["meta_info"]["spec_correct_drafts_histogram"])  # noqa: E731
    alone = [counts(spec_engine.generate(input_ids=[p], sampling_params=sampling)[0]) for p in probes]
    batched = [counts(o) for o in spec_engine.generate(input_ids=probes, sampling_params=sampling)]
    assert [ids for ids, _ in alone] == reference[2]
    assert batched == alone
    assert sum(h[3] for _, h in alone) > 0  # whole chains accepted: the comparison covers long acceptances


def test_weight_updates_reach_the_target_under_speculation(spec_engine, tiny_vl, reference, prompts):
    """``update_weights_from_tensor`` with EAGLE3 on (SGLang hands it to the speculative worker): a target
    weight zeroed changes the greedy tokens, restored gives plain decoding's tokens again. Last of the
    tests on the module's engine: it changes that engine's weights."""
    import torch
    from safetensors import safe_open

    name = "language_model.model.layers.0.self_attn.o_proj.weight"
    original = None
    for f in sorted(tiny_vl.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            if name in st.keys():
                original = st.get_tensor(name)
    assert original is not None
    for tensor, same in ((torch.zeros_like(original), False), (original, True)):
        ok, message = spec_engine.update_weights_from_tensor([(name, tensor)])[:2]
        assert ok, message
        assert (engine_greedy(spec_engine, prompts, NEW) == reference[0]) is same


@pytest.fixture(scope="module")
def pressure(corpus_ids, spec_engine):
    """24 prompts sharing a 32-token prefix, and their greedy outputs from the roomy engine (itself
    token-exact against plain decoding above)."""
    prompts = [corpus_ids[:32] + corpus_ids[100 + i * 37 : 108 + i * 42] for i in range(24)]  # 40..155 tokens
    sampling = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}
    outs = spec_engine.generate(input_ids=prompts, sampling_params=sampling)
    return prompts, sampling, [o["output_ids"] for o in outs]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "disable_overlap_schedule"])
def test_chunked_prefill_and_memory_pressure(tiny_vl, tiny_draft, pressure, reference, prompts, overlap):
    """24 requests through a 640-token pool with optimistic admission and 64-token prefill chunks:
    queueing, retraction (the draft's reserved slots are released with the rest), radix hits on the
    shared prefix, and a draft prefill pass spanning chunks; outputs equal the roomy engine's and no
    slot leaks. Once with overlap scheduling, once without (``--disable-overlap-schedule``, which
    must give the plain greedy tokens as well)."""
    pressure_prompts, sampling, want = pressure
    args = dict(
        ENGINE_ARGS,
        max_total_tokens=640,
        chunked_prefill_size=64,
        max_running_requests=24,
        schedule_conservativeness=0.05,
        disable_overlap_schedule=not overlap,
    )
    engine = sgl.Engine(model_path=str(tiny_vl), speculative_draft_model_path=str(tiny_draft), **SPEC_ARGS, **args)
    try:
        assert engine.get_server_info()["disable_overlap_schedule"] is not overlap
        outs = engine.generate(input_ids=pressure_prompts, sampling_params=sampling)
        assert [o["output_ids"] for o in outs] == want
        assert sum(o["meta_info"]["num_retractions"] for o in outs) > 0  # the pool ran dry mid-decode
        assert sum(o["meta_info"]["cached_tokens"] for o in outs) > 0
        if not overlap:
            assert engine_greedy(engine, prompts, NEW) == reference[0]
        engine.flush_cache()
        assert used_tokens_settle_to_zero(engine)
    finally:
        stop_engine(engine)
