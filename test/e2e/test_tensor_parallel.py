"""Tensor and expert parallelism: greedy output token for token equal to one rank's (fp32 model and KV,
DESIGN section 5), on CPU (two ranks on gloo, each bound to one core: ``parity_helpers.greedy_of``) and on
several GPUs (NCCL; marker ``gpu``, skipped with fewer than two).

* ``m3-tiny-gqa`` (2 KV groups): at TP2 each rank holds one KV group with its own index head; fp32 KV and
  FP8 KV; ``--ep-size`` = TP: each rank holds its share of the 8 experts.
* ``m3-tiny`` (1 KV group) with its EAGLE3 draft: its one KV head (and index head) is replicated on every
  rank, the draft's 2 KV heads split (TP2) or replicated (TP4); with FP8 KV and EP too.

On GPUs: TP = the GPUs present, at most 4 (the tiny models have 4 q heads; a larger TP is refused at
start-up for them), IEEE fp32 dots (``conftest._triton_env``), CUDA graphs and overlap scheduling on (the
defaults), so the graphs replay SGLang's all-reduce; NVLink multicast stays off (on shared hosts a program
using it can take the GPUs out of service).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from .conftest import ENGINE_ARGS, SPEC_ARGS, prompts_from
from .parity_helpers import greedy_of

pytestmark = pytest.mark.slow
NEW = 24
GPU_ARGS = dict(
    device="cuda", dtype="float32", log_level="error", max_total_tokens=8192, mem_fraction_static=0.3,
    cuda_graph_max_bs_decode=8,
)  # fmt: skip
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
GPUS = torch.cuda.device_count()


@dataclasses.dataclass(frozen=True)
class Platform:
    engine_args: dict
    tp: int  # the TP size tested against TP1

    def greedy(self, model_path, prompts, **kw):
        return greedy_of(model_path, prompts, dict(self.engine_args, **kw), NEW)


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(("cpu", 2), id="cpu"),
        pytest.param(
            ("cuda", min(GPUS, 4)),
            id="gpus",
            marks=[pytest.mark.gpu, pytest.mark.skipif(GPUS < 2, reason="needs two or more GPUs")],
        ),
    ],
)
def platform(request, monkeypatch_module):
    device, tp_size = request.param
    if device == "cuda":
        for k, v in NO_MULTICAST.items():
            monkeypatch_module.setenv(k, v)
    return Platform(ENGINE_ARGS if device == "cpu" else GPU_ARGS, tp_size)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def prompts(corpus_ids):
    return prompts_from(corpus_ids)[:3]


@pytest.fixture(scope="module")
def gqa_tp1(platform, tiny_gqa_text, prompts):
    return {kv: platform.greedy(tiny_gqa_text, prompts, kv_cache_dtype=kv) for kv in ("auto", "fp8_e4m3")}


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_tp_split_kv_groups_equals_tp1(platform, tiny_gqa_text, prompts, gqa_tp1, kv_cache_dtype):
    got = platform.greedy(tiny_gqa_text, prompts, tp_size=platform.tp, kv_cache_dtype=kv_cache_dtype)
    assert got == gqa_tp1[kv_cache_dtype]


def test_ep_equals_tp1(platform, tiny_gqa_text, prompts, gqa_tp1):
    tp = platform.tp
    assert platform.greedy(tiny_gqa_text, prompts, tp_size=tp, ep_size=tp) == gqa_tp1["auto"]


def test_tp_replicated_kv_head_with_eagle3_equals_tp1(platform, tiny_vl, tiny_draft, prompts):
    want = platform.greedy(tiny_vl, prompts)
    spec = dict(SPEC_ARGS, speculative_draft_model_path=str(tiny_draft))
    assert platform.greedy(tiny_vl, prompts, tp_size=platform.tp, **spec) == want


def test_tp_ep_with_eagle3_and_fp8_kv_equals_tp1(platform, tiny_vl, tiny_draft, prompts):
    tp = platform.tp
    want = platform.greedy(tiny_vl, prompts, kv_cache_dtype="fp8_e4m3")
    spec = dict(SPEC_ARGS, speculative_draft_model_path=str(tiny_draft))
    assert platform.greedy(tiny_vl, prompts, tp_size=tp, ep_size=tp, kv_cache_dtype="fp8_e4m3", **spec) == want
