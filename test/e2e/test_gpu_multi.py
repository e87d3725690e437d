"""Several GPUs (NCCL): tensor and expert parallelism of the tiny M3 and its EAGLE3 draft give greedy output
token for token equal to TP1 on the same machine (the CPU twin, two ranks on gloo: test_tensor_parallel.py).

fp32 model and KV, IEEE fp32 dots (``conftest._triton_env``); CUDA graphs and overlap scheduling on (the
defaults), so the graphs replay SGLang's all-reduce. TP = the GPUs present, at most 4: the tiny models have
4 q heads (a larger TP is refused at start-up for them). At TP4 the gqa model's 2 KV heads (and index heads)
are replicated on two ranks each, the 1-group model's one on all four; EP = TP puts 2 of the 8 experts on a
rank. Skipped with fewer than 2 GPUs.
"""

from __future__ import annotations

import os

import pytest
import torch

from .conftest import SPEC_ARGS, prompts_from
from .parity_helpers import greedy_of

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two or more GPUs"),
]
NEW = 24
TP = min(torch.cuda.device_count(), 4)
GPU_ARGS = dict(
    device="cuda", dtype="float32", log_level="error", max_total_tokens=8192, mem_fraction_static=0.3,
    cuda_graph_max_bs_decode=8,
)  # fmt: skip
# NVLink multicast stays off: on shared hosts a program using it can take the GPUs out of service.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@pytest.fixture(scope="module", autouse=True)
def _no_multicast():
    saved = {k: os.environ.get(k) for k in NO_MULTICAST}
    os.environ.update(NO_MULTICAST)
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k)
        else:
            os.environ[k] = v


def _greedy(model_path, prompts, **kw):
    return greedy_of(model_path, prompts, dict(GPU_ARGS, **kw), NEW)


@pytest.fixture(scope="module")
def prompts(corpus_ids):
    return prompts_from(corpus_ids)[:4]


@pytest.fixture(scope="module")
def gqa_tp1(tiny_gqa_text, prompts):
    return {kv: _greedy(tiny_gqa_text, prompts, kv_cache_dtype=kv) for kv in ("auto", "fp8_e4m3")}


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_tp_equals_tp1(tiny_gqa_text, prompts, gqa_tp1, kv_cache_dtype):
    assert _greedy(tiny_gqa_text, prompts, tp_size=TP, kv_cache_dtype=kv_cache_dtype) == gqa_tp1[kv_cache_dtype]


def test_ep_equals_tp1(tiny_gqa_text, prompts, gqa_tp1):
    assert _greedy(tiny_gqa_text, prompts, tp_size=TP, ep_size=TP) == gqa_tp1["auto"]


@pytest.fixture(scope="module")
def vl_tp1(tiny_vl, prompts):
    return _greedy(tiny_vl, prompts)


@pytest.mark.parametrize("ep_size", [1, TP])
def test_tp_with_eagle3_equals_tp1(tiny_vl, tiny_draft, prompts, vl_tp1, ep_size):
    spec = dict(SPEC_ARGS, speculative_draft_model_path=str(tiny_draft))
    assert _greedy(tiny_vl, prompts, tp_size=TP, ep_size=ep_size, **spec) == vl_tp1
