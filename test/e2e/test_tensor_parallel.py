"""Tensor and expert parallelism on CPU (two ranks on gloo): greedy output token for token
equal to one rank's (fp32 model and KV, DESIGN section 5).

* ``m3-tiny-gqa`` (2 KV groups): at TP2 each rank holds one KV group with its own index head;
  BF16-free fp32 KV and FP8 KV; ``--ep-size 2``: each rank holds half the experts.
* ``m3-tiny`` (1 KV group) with its EAGLE3 draft: at TP2 the one KV head (and index head) is
  replicated on both ranks, the draft's 2 KV heads split; with FP8 KV and ``--ep-size 2`` too.

Each CPU rank is bound to one core (``parity_helpers.greedy_of``).
"""

from __future__ import annotations

import pytest

from .conftest import ENGINE_ARGS, SPEC_ARGS, prompts_from
from .parity_helpers import greedy_of

pytestmark = pytest.mark.slow
NEW = 24


def _greedy(model_path, prompts, **kw):
    return greedy_of(model_path, prompts, dict(ENGINE_ARGS, **kw), NEW)


@pytest.fixture(scope="module")
def prompts(corpus_ids):
    return prompts_from(corpus_ids)[:3]


@pytest.fixture(scope="module")
def gqa_tp1(tiny_gqa_text, prompts):
    return {kv: _greedy(tiny_gqa_text, prompts, kv_cache_dtype=kv) for kv in ("auto", "fp8_e4m3")}


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_tp2_split_kv_groups_equals_tp1(tiny_gqa_text, prompts, gqa_tp1, kv_cache_dtype):
    assert _greedy(tiny_gqa_text, prompts, tp_size=2, kv_cache_dtype=kv_cache_dtype) == gqa_tp1[kv_cache_dtype]


def test_ep2_equals_tp1(tiny_gqa_text, prompts, gqa_tp1):
    assert _greedy(tiny_gqa_text, prompts, tp_size=2, ep_size=2) == gqa_tp1["auto"]


def test_tp2_replicated_kv_head_with_eagle3_equals_tp1(tiny_vl, tiny_draft, prompts):
    want = _greedy(tiny_vl, prompts)
    spec = dict(SPEC_ARGS, speculative_draft_model_path=str(tiny_draft))
    assert _greedy(tiny_vl, prompts, tp_size=2, **spec) == want


def test_tp2_ep2_with_eagle3_and_fp8_kv_equals_tp1(tiny_vl, tiny_draft, prompts):
    want = _greedy(tiny_vl, prompts, kv_cache_dtype="fp8_e4m3")
    spec = dict(SPEC_ARGS, speculative_draft_model_path=str(tiny_draft))
    assert _greedy(tiny_vl, prompts, tp_size=2, ep_size=2, kv_cache_dtype="fp8_e4m3", **spec) == want
