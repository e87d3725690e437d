"""Tensor and expert parallelism: greedy output token for token equal to one rank's (fp32 model and KV,
DESIGN section 5), on CPU (two ranks on gloo, and eight for the release's TP8 layout, bound to the cores in
turn: ``parity_helpers.greedy_of``) and on several GPUs (NCCL; marker ``gpu``, skipped with fewer than two).

* ``m3-tiny-gqa`` (8 q heads, 2 KV groups): at TP2 each rank holds one KV group with its own index head, at
  TP4 / TP8 each group is replicated on two / four ranks; fp32 KV and FP8 KV; ``--ep-size`` = TP: each
  rank holds its share of the 8 experts.
* ``m3-tiny`` (4 q heads, 1 KV group) with its EAGLE3 draft (4 q heads): its one KV head (and index head)
  is replicated on every rank, the draft's 2 KV heads split (TP2) or replicated (TP4).
* ``m3-tiny-gqa`` with its EAGLE3 draft (8 q heads, 2 KV heads): the same TP and EP sizes as without
  speculation, FP8 KV; on CPU also TP8 / EP8, each KV group of the target and the draft on four ranks.

On GPUs: TP = as many GPUs as are present, 2, 4 or 8, for ``m3-tiny-gqa`` and its draft; at most 4 for
``m3-tiny``'s pair (its 4 q heads: a larger TP is refused at start-up); IEEE fp32 dots
(``conftest._triton_env``), CUDA graphs and overlap scheduling on (the defaults), so the graphs replay
SGLang's all-reduce; NVLink multicast stays off (on shared hosts a program using it can take the GPUs out
of service).
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
GPU_TP = max((n for n in (2, 4, 8) if n <= GPUS), default=0)  # m3-tiny-gqa's 8 q heads take each of these


@dataclasses.dataclass(frozen=True)
class Platform:
    engine_args: dict
    tp: int  # the TP size tested against TP1
    spec_tp: int  # the same with the EAGLE3 pair (4 q heads)

    def greedy(self, model_path, prompts, **kw):
        return greedy_of(model_path, prompts, dict(self.engine_args, **kw), NEW)


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(("cpu", 2), id="cpu"),
        pytest.param(
            ("cuda", GPU_TP),
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
    return Platform(ENGINE_ARGS if device == "cpu" else GPU_ARGS, tp_size, min(tp_size, 4))


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


def test_tp8_ep8_replicates_each_kv_group_on_four_ranks(platform, tiny_gqa_text, prompts, gqa_tp1):
    """The released model's TP8 layout in small (its 4 KV heads on two ranks each): ``m3-tiny-gqa``'s 2 KV
    groups and index heads on four ranks each, one q head and one of the 8 experts a rank; on CPU, eight
    gloo ranks on the machine's cores (~3 minutes on two). On GPUs the tests above run the GPU count."""
    if platform.engine_args["device"] != "cpu":
        pytest.skip("on GPUs the TP sizes above follow the GPU count")
    assert platform.greedy(tiny_gqa_text, prompts, tp_size=8, ep_size=8) == gqa_tp1["auto"]


def test_tp_replicated_kv_head_with_eagle3_equals_tp1(platform, tiny_vl, tiny_draft, prompts):
    want = platform.greedy(tiny_vl, prompts)
    spec = dict(SPEC_ARGS, speculative_draft_model_path=str(tiny_draft))
    assert platform.greedy(tiny_vl, prompts, tp_size=platform.spec_tp, **spec) == want


@pytest.fixture(scope="module")
def gqa_pair_tp1(platform, tiny_gqa_vl, prompts):
    return platform.greedy(tiny_gqa_vl, prompts, kv_cache_dtype="fp8_e4m3")


def gqa_pair_greedy(platform, tiny_gqa_vl, tiny_gqa_draft, prompts, tp):
    spec = dict(SPEC_ARGS, speculative_draft_model_path=str(tiny_gqa_draft))
    return platform.greedy(tiny_gqa_vl, prompts, tp_size=tp, ep_size=tp, kv_cache_dtype="fp8_e4m3", **spec)


def test_tp_ep_with_eagle3_and_fp8_kv_equals_tp1(platform, tiny_gqa_vl, tiny_gqa_draft, prompts, gqa_pair_tp1):
    assert gqa_pair_greedy(platform, tiny_gqa_vl, tiny_gqa_draft, prompts, platform.tp) == gqa_pair_tp1


def test_tp8_ep8_with_eagle3_equals_tp1(platform, tiny_gqa_vl, tiny_gqa_draft, prompts, gqa_pair_tp1):
    """The release's TP8 layout under EAGLE3, on eight gloo ranks (~4 minutes on two cores): the target's and
    the draft's 2 KV groups on four ranks each. On GPUs the test above runs the GPU count."""
    if platform.engine_args["device"] != "cpu":
        pytest.skip("on GPUs the TP size above follows the GPU count")
    assert gqa_pair_greedy(platform, tiny_gqa_vl, tiny_gqa_draft, prompts, 8) == gqa_pair_tp1
