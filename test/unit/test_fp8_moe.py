"""Per-tensor FP8 experts with per-token activation scales (``sglang_m3.quant.per_token_moe_activations``).

With ``--quantization fp8`` SGLang's ``Fp8MoEMethod`` holds one weight scale per expert; the model hands
its Triton runner each expert's scale broadcast over the expert's rows (a stride-0 view) and the runner's
per-channel mode, which quantises each GEMM's input per token. On CPU: which layers switch and what the
runner is handed. On CUDA: SGLang's fused MoE on that hand-over against a torch reference of the same
arithmetic (every token's input to each GEMM rounded to e4m3 on its own scale), on fresh random inputs,
and tokens beside a 30000x larger one keep their precision, which one scale for the batch loses.
Tolerance: the kernel stores the gate/up product and the SwiGLU in bf16 where the reference keeps fp32
until the same points, so single elements may land one e4m3 step apart; relative error of the whole
output within 2e-2.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from cpu_model import one_rank
from sglang_m3.tiny import default_checkpoint
from sglang_m3.tiny.fp8 import FP8_MAX


@pytest.fixture(scope="module")
def rank():
    """SGLang's parallel state for one rank (the fused MoE asks for its TP group) and runtime context,
    once for the module: SGLang's model-parallel groups can be initialised once a process."""
    with one_rank(default_checkpoint("m3-tiny", "vl")):
        yield


@pytest.fixture(scope="module")
def fp8_model(rank):
    """The tiny M3 built on CPU as ``--quantization fp8`` builds it (BF16 checkpoint, weights made FP8 at load)."""
    from sglang.srt.layers.quantization.fp8 import Fp8Config
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang_m3.model.minimax_m3 import MiniMaxM3ForCausalLM
    from transformers import AutoConfig

    with set_default_torch_dtype(torch.bfloat16):
        return MiniMaxM3ForCausalLM(
            AutoConfig.from_pretrained(default_checkpoint("m3-tiny", "vl")), quant_config=Fp8Config()
        )


def moe_layers(model):
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    return [m for m in model.modules() if isinstance(m, FusedMoE)]


def test_every_per_tensor_fp8_moe_switches_to_per_token(fp8_model):
    from sglang_m3.quant import per_token_moe_activations

    layers = moe_layers(fp8_model)
    assert len(layers) == sum(fp8_model.m3.moe_layers) > 0
    assert all(m.quant_method.get_triton_quant_info.func.__name__ == "per_token_quant_info" for m in layers)
    assert per_token_moe_activations(fp8_model.model, fp8_model.quant_config) == len(layers)


def test_static_or_block_scales_stay_as_sglang_has_them(fp8_model):
    from sglang.srt.layers.quantization.fp8 import Fp8Config
    from sglang_m3.quant import per_token_moe_activations

    static = Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="static")
    assert per_token_moe_activations(fp8_model.model, static) == 0
    block = fp8_model.quant_config
    for m in moe_layers(fp8_model):
        m.quant_method.block_quant = True
    try:
        assert per_token_moe_activations(fp8_model.model, block) == 0
    finally:
        for m in moe_layers(fp8_model):
            m.quant_method.block_quant = False


def test_the_runner_gets_each_experts_scale_on_every_row(fp8_model):
    layer = moe_layers(fp8_model)[0]
    experts, rows13, rows2 = layer.w13_weight.shape[0], layer.w13_weight.shape[1], layer.w2_weight.shape[1]
    layer.w13_weight_scale = torch.nn.Parameter(torch.rand(experts), requires_grad=False)  # [E] after loading
    layer.w2_weight_scale = torch.nn.Parameter(torch.rand(experts), requires_grad=False)
    info = layer.quant_method.get_triton_quant_info(layer)
    assert info.per_channel_quant and info.use_fp8_w8a8 and info.block_shape is None and info.a13_scale is None
    pairs = ((info.w13_scale, layer.w13_weight_scale, rows13), (info.w2_scale, layer.w2_weight_scale, rows2))
    for got, scale, rows in pairs:
        assert got.shape == (experts, rows) and got.stride() == (1, 0)  # a view: no copy of the scales
        assert torch.equal(got, scale[:, None].expand(experts, rows))


def e4m3_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row dynamic e4m3 quantisation: (fp8 values as fp32, per-row scale)."""
    scale = x.float().abs().amax(-1, keepdim=True).clamp_min(1e-10) / FP8_MAX
    return (x.float() / scale).to(torch.float8_e4m3fn).float(), scale


def experts_reference(x, w13, s13, w2, s2, weights, ids, alpha, limit, quantise=True):
    """The per-token FP8 arithmetic in torch: per-token e4m3 inputs (``quantise=False``: the inputs as they
    are), fp32 products, bf16 where the kernel stores."""
    from sglang_m3.model.layers import swiglu_oai

    def rows(v):
        return e4m3_rows(v) if quantise else (v.float(), torch.ones_like(v[..., :1], dtype=torch.float32))

    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    xq, xs = rows(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = ((xq[t] @ w13[e].float().t()) * xs[t] * s13[e]).bfloat16()
            a = swiglu_oai(h.float(), alpha, limit).bfloat16()
            aq, a_s = rows(a[None])
            out[t] += ((aq[0] @ w2[e].float().t()) * a_s[0] * s2[e] * weights[t, k]).bfloat16().float()
    return out


def run_fused(x, w13, s13, w2, s2, weights, ids, alpha, limit, per_token):
    """SGLang's fused MoE on what ``Fp8MoEMethod`` hands its runner: ``per_token_quant_info``'s hand-over,
    or SGLang's own (one activation scale for the batch)."""
    from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe import fused_experts_impl
    from sglang.srt.layers.quantization.fp8 import Fp8MoEMethod
    from sglang_m3.quant import per_token_quant_info

    layer = SimpleNamespace(w13_weight=w13, w2_weight=w2, w13_weight_scale=s13, w2_weight_scale=s2)
    layer.w13_input_scale = layer.w2_input_scale = None  # dynamic activation scales
    method = SimpleNamespace(use_mxfp8=False, block_quant=False, weight_block_size=None)
    info = (per_token_quant_info if per_token else Fp8MoEMethod.get_triton_quant_info)(method, layer)
    assert info.per_channel_quant == per_token
    return fused_experts_impl(
        x, w13, w2, weights, ids, use_fp8_w8a8=True, per_channel_quant=info.per_channel_quant,
        w1_scale=info.w13_scale, w2_scale=info.w2_scale, gemm1_alpha=alpha, gemm1_limit=limit,
        gate_up_interleaved=False,
    )  # fmt: skip


def random_experts(experts, hidden, inter, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, device="cuda", generator=g) / inter**0.5
    out = []
    for w in (w13, w2):
        scale = w.abs().amax(dim=(1, 2)) / FP8_MAX  # one scale per expert, as SGLang quantises at load
        out += [(w / scale[:, None, None]).to(torch.float8_e4m3fn), scale.float()]
    return out


def routing(tokens, experts, top_k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.rand(tokens, experts, device="cuda", generator=g).argsort(-1)[:, :top_k].to(torch.int32)
    weights = torch.rand(tokens, top_k, device="cuda", generator=g) + 0.1
    return weights / weights.sum(-1, keepdim=True), ids


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 5, 64])
def test_per_token_fused_moe_matches_the_torch_reference(rank, tokens):
    experts, hidden, inter, top_k, alpha, limit = 8, 256, 128, 2, 1.702, 7.0
    w13, s13, w2, s2 = random_experts(experts, hidden, inter, seed=tokens)
    weights, ids = routing(tokens, experts, top_k, seed=tokens + 1)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    got = run_fused(x, w13, s13, w2, s2, weights, ids, alpha, limit, per_token=True).float()
    ref = experts_reference(x, w13, s13, w2, s2, weights, ids, alpha, limit)
    err = ((got - ref).norm() / ref.norm()).item()
    print(f"{tokens} tokens: relative error {err:.2e}")
    assert err < 2e-2


@pytest.mark.gpu
def test_tokens_beside_an_outlier_keep_their_precision(rank):
    """Token 0 is 30000x the others: with one scale for the batch their inputs fall into e4m3's subnormals
    (~13 % error on the first GEMM's input, against ~3 % for any scale that fits the token itself), so the
    per-token path's error against unquantised activations is under half the batch-scale path's."""
    experts, hidden, inter, top_k, alpha, limit = 8, 256, 128, 2, 1.702, 7.0
    w13, s13, w2, s2 = random_experts(experts, hidden, inter, seed=7)
    weights, ids = routing(8, experts, top_k, seed=8)
    x = torch.randn(8, hidden, device="cuda", dtype=torch.bfloat16)
    x[0] *= 30000
    exact = experts_reference(x, w13, s13, w2, s2, weights, ids, alpha, limit, quantise=False)[1:]

    def rel_err(per_token):
        got = run_fused(x, w13, s13, w2, s2, weights, ids, alpha, limit, per_token)[1:].float()
        return ((got - exact).norm() / exact.norm()).item()

    per_token, per_batch = rel_err(True), rel_err(False)
    print(f"tokens beside the outlier, error against unquantised activations: per token {per_token:.2e}, "
          f"one scale a batch {per_batch:.2e}")  # fmt: skip
    assert 2 * per_token < per_batch
