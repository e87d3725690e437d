"""Every request type under EAGLE3 on CPU: grammars, penalties, logit bias, min_new_tokens, stop strings,
seeds, NaN, client aborts.

The EAGLE3 engine runs under SGLang's overlap scheduler (the default). Greedy requests must give the
same tokens with and without speculation (fp32). Grammar
requests run on CPU with and without speculation (SGLang's xgrammar path pins memory and
applies masks with GPU kernels only; ``cpu_hooks.py``). The sampled path's distribution:
``test_eagle3_sampling.py``.
"""

from __future__ import annotations

import asyncio
import json
import re

import pytest
import sglang as sgl
from fastapi import HTTPException

from .conftest import ENGINE_ARGS as BASE_ARGS
from .conftest import SPEC_ARGS, prompts_from
from .parity_helpers import stop_engine, used_tokens_settle_to_zero

pytestmark = pytest.mark.slow

NEW = 32
# Compact JSON: with any whitespace allowed the random tiny model spends its tokens on tabs.
ENGINE_ARGS = dict(BASE_ARGS, constrained_json_disable_any_whitespace=True)
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
REGEX = "(yes|no) [0-9]{2}!"
EBNF = 'root ::= ("up" | "down") " " [a-z] [a-z] [a-z]? "."'
GREEDY = {"max_new_tokens": NEW, "temperature": 0}
CASES = {
    "json_schema": dict(GREEDY, json_schema=json.dumps(SCHEMA)),
    "regex": dict(GREEDY, regex=REGEX),
    "ebnf": dict(GREEDY, ebnf=EBNF),
    "frequency_penalty": dict(GREEDY, frequency_penalty=0.5, ignore_eos=True),
    "presence_penalty": dict(GREEDY, presence_penalty=0.75, ignore_eos=True),
    "repetition_penalty": dict(GREEDY, repetition_penalty=1.3, ignore_eos=True),
    "logit_bias": dict(GREEDY, logit_bias={"69": 2.0, "88": -1.5}, ignore_eos=True),
}


@pytest.fixture(scope="module")
def prompts(corpus_ids):
    return prompts_from(corpus_ids)[:3]


def _run_cases(engine, prompts, stop_ids, stop_strings):
    out = {}
    for name, params in CASES.items():
        out[name] = engine.generate(input_ids=prompts, sampling_params=params)
    # min_new_tokens holds back a stop token the model emits early (the 3rd greedy token of each prompt)
    out["min_new_tokens"] = [
        engine.generate(input_ids=[p], sampling_params=dict(GREEDY, stop_token_ids=[s], min_new_tokens=20))[0]
        for p, s in zip(prompts, stop_ids)
    ]
    # a stop string from the middle of each greedy text, the prompts as one batch
    out["stop_string"] = engine.generate(
        input_ids=prompts, sampling_params=[dict(GREEDY, stop=[s], ignore_eos=True) for s in stop_strings]
    )
    return out


def _stop_strings(greedy) -> list[str]:
    texts = [o["text"] for o in greedy]
    return [t[len(t) // 2 :][:3] for t in texts]


@pytest.fixture(scope="module")
def plain(tiny_vl, prompts):
    """Outputs of a non-speculative engine (started and stopped first). Without overlap scheduling, like
    the EAGLE3 worker: with it, SGLang's penalizers see each output token one step late."""
    engine = sgl.Engine(model_path=str(tiny_vl), disable_overlap_schedule=True, **ENGINE_ARGS)
    try:
        greedy = engine.generate(input_ids=prompts, sampling_params=dict(GREEDY, ignore_eos=True))
        stop_ids = [o["output_ids"][2] for o in greedy]
        stop_strings = _stop_strings(greedy)
        short = [
            engine.generate(input_ids=[p], sampling_params=dict(GREEDY, stop_token_ids=[s]))[0]
            for p, s in zip(prompts, stop_ids)
        ]
        return dict(
            _run_cases(engine, prompts, stop_ids, stop_strings),
            stop_ids=stop_ids,
            stop_strings=stop_strings,
            greedy=greedy,
            short=short,
        )
    finally:
        stop_engine(engine)


@pytest.fixture(scope="module")
def spec_engine(tiny_vl, tiny_draft, plain):
    engine = sgl.Engine(
        model_path=str(tiny_vl), speculative_draft_model_path=str(tiny_draft), **SPEC_ARGS, **ENGINE_ARGS
    )
    yield engine
    stop_engine(engine)


@pytest.fixture(scope="module")
def spec(spec_engine, prompts, plain):
    return _run_cases(spec_engine, prompts, plain["stop_ids"], plain["stop_strings"])


def _valid(text: str) -> bool:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return False
    return set(obj) == {"ok", "n"} and isinstance(obj["ok"], bool) and obj["n"] in (1, 2, 3)


def test_overlap_scheduling_is_on(spec_engine):
    assert spec_engine.get_server_info()["disable_overlap_schedule"] is False


@pytest.mark.parametrize("case", [*CASES, "min_new_tokens", "stop_string"])
def test_greedy_equals_plain_decoding(plain, spec, case):
    assert [o["output_ids"] for o in spec[case]] == [o["output_ids"] for o in plain[case]]
    assert [o["text"] for o in spec[case]] == [o["text"] for o in plain[case]]


def test_the_cases_change_the_output(plain):
    """Each case shapes the output (else the equality above would prove nothing about it)."""
    base = [o["output_ids"] for o in plain["greedy"]]
    for case in CASES:
        assert [o["output_ids"] for o in plain[case]] != base, case
    assert all(len(o["output_ids"]) <= 3 for o in plain["short"])  # the stop token ends them early ...
    assert all(len(o["output_ids"]) >= 20 for o in plain["min_new_tokens"])  # ... unless min_new_tokens holds it
    assert all(s.strip() for s in plain["stop_strings"]), plain["stop_strings"]
    for o in plain["stop_string"]:
        assert o["meta_info"]["finish_reason"]["type"] == "stop" and len(o["output_ids"]) < NEW, o["meta_info"]


def test_grammar_outputs_parse(plain, spec):
    for outs in (plain, spec):
        assert all(_valid(o["text"]) for o in outs["json_schema"]), [o["text"] for o in outs["json_schema"]]
        assert all(re.fullmatch(REGEX, o["text"]) for o in outs["regex"]), [o["text"] for o in outs["regex"]]
        assert all(re.fullmatch(r"(up|down) [a-z]{2,3}\.", o["text"]) for o in outs["ebnf"]), [
            o["text"] for o in outs["ebnf"]
        ]


def test_sampled_grammar_requests_stay_valid(spec_engine, prompts):
    sampled = {"max_new_tokens": NEW, "temperature": 1.0, "top_k": 8}
    outs = spec_engine.generate(input_ids=prompts * 4, sampling_params=dict(sampled, json_schema=json.dumps(SCHEMA)))
    assert all(_valid(o["text"]) for o in outs), [o["text"] for o in outs]
    outs = spec_engine.generate(input_ids=prompts * 4, sampling_params=dict(sampled, regex=REGEX))
    assert all(re.fullmatch(REGEX, o["text"]) for o in outs), [o["text"] for o in outs]


def test_non_finite_logits_end_one_request(spec_engine, prompts, plain):
    """A NaN in one request's logits (here through its logit bias) among concurrent requests (as HTTP
    clients send them): that request ends with an error, the others give the same tokens as without it."""

    async def run():
        params = [dict(GREEDY, ignore_eos=True) for _ in prompts]
        params[1] = dict(params[1], logit_bias={"5": float("nan")})
        calls = [spec_engine.async_generate(input_ids=p, sampling_params=s) for p, s in zip(prompts, params)]
        return await asyncio.gather(*calls, return_exceptions=True)

    outs = spec_engine.loop.run_until_complete(run())
    assert isinstance(outs[1], HTTPException) and outs[1].status_code == 500, outs[1]
    assert "non-finite logits" in outs[1].detail
    for i in (0, 2):
        assert outs[i]["output_ids"] == plain["greedy"][i]["output_ids"]


def test_client_abort_frees_the_request(spec_engine, prompts, plain):
    """A request aborted by its client mid-decode (overlap: a step of it is still in flight when the abort
    lands) ends with finish_reason abort; the requests beside it give their plain tokens, and every KV
    slot comes back."""
    rid = "eagle3-client-abort"

    async def run():
        long = asyncio.ensure_future(
            spec_engine.async_generate(
                input_ids=prompts[0], sampling_params=dict(GREEDY, max_new_tokens=2000, ignore_eos=True), rid=rid
            )
        )
        others = await asyncio.gather(
            *[
                spec_engine.async_generate(input_ids=p, sampling_params=dict(GREEDY, ignore_eos=True))
                for p in prompts[1:]
            ]
        )
        spec_engine.tokenizer_manager.abort_request(rid)
        return await long, others

    aborted, others = spec_engine.loop.run_until_complete(run())
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort", aborted["meta_info"]
    assert 0 < len(aborted["output_ids"]) < 2000
    assert [o["output_ids"] for o in others] == [o["output_ids"] for o in plain["greedy"][1:]]
    spec_engine.flush_cache()
    assert used_tokens_settle_to_zero(spec_engine)
