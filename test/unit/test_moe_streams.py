"""The MoE's two CUDA streams inside a captured graph (``model/mlp.py``).

While a CUDA graph is captured, the separate shared expert runs on a side stream beside the router and
the routed experts. On the tiny M3's first MoE layer in bf16 with fresh random weights, the graph must
compute what the eager one-stream forward computes for the same input, and follow a new input on replay.
Tolerance: the same kernels on the same inputs, so bf16 ties (atol 1e-2, rtol 1e-2) stand only for a
GEMM that picks another algorithm under capture; a missing stream dependency reads stale or unwritten
memory.
"""

from __future__ import annotations

import pytest
import torch
from cpu_model import one_rank
from sglang_m3.tiny import default_checkpoint

BF16 = dict(atol=1e-2, rtol=1e-2)


@pytest.fixture(scope="module")
def cfg():
    from sglang_m3.config import M3Config
    from transformers import AutoConfig

    path = default_checkpoint("m3-tiny", "vl")
    with one_rank(path):
        yield M3Config.from_hf(AutoConfig.from_pretrained(path))


def random_moe(cfg, seed):
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang_m3.model.mlp import MoE

    layer = cfg.moe_layers.index(True)
    with torch.device("cuda"), set_default_torch_dtype(torch.bfloat16):
        moe = MoE(cfg, layer, prefix=f"model.layers.{layer}.mlp")
    g = torch.Generator(device="cuda").manual_seed(seed)
    for p in moe.parameters():
        p.data.copy_(torch.randn(p.shape, device="cuda", generator=g) * 0.1)
    return moe


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8])
def test_the_shared_expert_on_its_side_stream_in_a_graph_computes_the_eager_forward(cfg, tokens):
    from sglang.srt.model_executor.runner import model_capture_mode

    moe = random_moe(cfg, seed=tokens)
    assert moe.shared_experts is not None and moe.side_stream is not None
    x = torch.randn(tokens, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    static = x.clone()
    graph = torch.cuda.CUDAGraph()
    with model_capture_mode():
        warm = torch.cuda.Stream()
        warm.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(warm):
            moe(static)
        torch.cuda.current_stream().wait_stream(warm)
        with torch.cuda.graph(graph):
            out = moe(static)
    for inp in (x, torch.randn_like(x)):  # the captured input, then a new one
        static.copy_(inp)
        graph.replay()
        torch.testing.assert_close(out, moe(inp), **BF16)  # eager: not capturing, one stream
