"""FP8 linears on our GEMV for a few tokens (``sglang_m3.quant.fp8_gemv_for_few_tokens``).

With ``--quantization fp8`` SGLang's ``Fp8LinearMethod`` quantises each weight row by row at load and runs
its per-token activation quantisation + CUTLASS GEMM; the model wraps each such method's ``apply`` so that
up to ``FP8_GEMV_MAX_TOKENS`` bf16 / fp16 tokens on CUDA run ``sglang_m3_kernels.fp8_gemv`` instead
(weight-only FP8: the activation is not rounded to e4m3). On CPU: which methods are wrapped, the switch
that turns it off, and that anything the GEMV does not take reaches SGLang's ``apply`` unchanged. On CUDA,
a processed SGLang linear: through ``forward`` at 1 / 5 / 16 tokens, the kernel's reference on the
layer's own e4m3 weight and scales (bf16: within one output rounding, 2^-8, and 1e-3 of the output's scale
for the summation order), and SGLang's w8a8 output within 3e-2 relative (its activation rounded to e4m3:
2^-4 per element, averaging down over the dot); at 17 tokens SGLang's output bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from cpu_model import build_online_fp8_model, one_rank
from sglang_m3 import quant
from sglang_m3.tiny import default_checkpoint


@pytest.fixture(scope="module")
def rank():
    with one_rank(default_checkpoint("m3-tiny", "vl")):
        yield


def fp8_linear_methods(model):
    from sglang.srt.layers.quantization.fp8 import Fp8LinearMethod

    return [m.quant_method for m in model.modules() if isinstance(getattr(m, "quant_method", None), Fp8LinearMethod)]


def test_every_row_quantised_linear_is_wrapped(rank, monkeypatch):
    model = build_online_fp8_model(default_checkpoint("m3-tiny", "vl"))
    methods = fp8_linear_methods(model)
    per_layer = 4  # qkv, o, and the dense MLP's or the shared expert's gate_up / down
    assert len(methods) == per_layer * model.m3.num_layers
    assert not any(quant.quantises_rows_alone(m) for m in methods)  # no CUTLASS FP8 on this CPU: none wrapped
    assert quant.fp8_gemv_for_few_tokens(model.model) == 0
    for m in methods:
        m.cutlass_fp8_supported = True  # what a Hopper GPU reports
    monkeypatch.setenv(quant.FP8_GEMV_ENV, "0")
    assert quant.fp8_gemv_for_few_tokens(model.model) == 0  # the A/B switch
    monkeypatch.delenv(quant.FP8_GEMV_ENV)
    assert quant.fp8_gemv_for_few_tokens(model.model) == len(methods)
    assert all(m.apply.func is quant.apply_fp8_gemv for m in methods)
    assert quant.fp8_gemv_for_few_tokens(model.model) == 0  # once only


def test_what_the_gemv_does_not_take_reaches_sglang(rank, monkeypatch):
    from sglang.srt.layers.quantization.fp8 import Fp8Config, Fp8LinearMethod

    seen = []
    monkeypatch.setattr(Fp8LinearMethod, "apply", lambda self, layer, x, bias=None: seen.append(x.shape) or "sglang")
    method = Fp8LinearMethod(Fp8Config())
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.zeros(64, 32).to(torch.float8_e4m3fn).t(), requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(torch.ones(1, 32), requires_grad=False)
    for x in (torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(20, 64, dtype=torch.bfloat16)):
        assert quant.apply_fp8_gemv(method, layer, x) == "sglang"  # a CPU tensor; more than 16 tokens
    assert seen == [(1, 64), (20, 64)]


@pytest.mark.gpu
def test_processed_linear_runs_the_gemv_up_to_16_tokens(rank):
    from sglang.srt.layers.linear import ReplicatedLinear
    from sglang.srt.layers.quantization.fp8 import Fp8Config
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang_m3_kernels.fp8_gemv import fp8_gemv_ref

    with torch.device("cuda"), set_default_torch_dtype(torch.bfloat16):
        layer = ReplicatedLinear(1024, 384, bias=False, quant_config=Fp8Config(), prefix="proj")
    gen = torch.Generator(device="cuda").manual_seed(0)
    layer.weight.data = torch.randn(384, 1024, device="cuda", generator=gen).to(torch.bfloat16) / 32
    layer.quant_method.process_weights_after_loading(layer)
    assert quant.quantises_rows_alone(layer.quant_method) and layer.weight.dtype == torch.float8_e4m3fn
    x = torch.randn(17, 1024, device="cuda", generator=gen).to(torch.bfloat16)
    sglang = {m: layer(x[:m])[0] for m in (1, 5, 16, 17)}
    container = torch.nn.Sequential(layer)
    assert quant.fp8_gemv_for_few_tokens(container) == 1
    for m in (1, 5, 16):
        got = layer(x[:m])[0]
        want = fp8_gemv_ref(x[:m], layer.weight.t(), layer.weight_scale).float()
        torch.testing.assert_close(got.float(), want, rtol=2**-8, atol=1e-3 * want.abs().max().item())
        error = ((got.float() - sglang[m].float()).norm() / sglang[m].float().norm()).item()
        assert 0 < error < 3e-2, (m, error)  # the GEMV ran (SGLang's w8a8 differs), and agrees
    assert torch.equal(layer(x)[0], sglang[17])
