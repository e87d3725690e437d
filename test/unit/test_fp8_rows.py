"""FP8 linears that take their input quantised by the kernel before them (``sglang_m3.quant.Fp8Rows``).

With ``--quantization fp8`` SGLang's FP8 linear quantises its input per token in a launch of its own;
where the norm or the SwiGLU before it can (``sglang_m3_kernels.fp8_act``), the model hands the layer
that kernel's quantised output instead. On CPU, on the tiny M3 built as ``--quantization fp8`` builds
it (in fp32 here), its weights processed as SGLang's ``Fp8LinearMethod`` processes them on a Hopper GPU
(one e4m3 scale per row; done in torch, since CPU SGLang would take its AMX path), SGLang's FP8 GEMM
and per-token quantisation replaced by their arithmetic in torch (both are CUDA kernels): every decoder
layer's output and residual with the fused path against the same layer on SGLang's own path (its
quantisation, then the GEMM). Both quantise the same fp32 values on the same per-token scales, so the
codes agree and the outputs differ by summation order only (measured 2e-7): bound 1e-5 relative, where
a layer handed the wrong rows or scales moves by O(1). The launches are counted (which path each GEMM's
input took). Also: which layers take rows, and the wrapping leaves other methods alone. The kernels
themselves: ``test/kernel/test_fp8_act.py``; on a GPU in bf16 against SGLang's own kernels:
``test_gpu_layer_matches_sglangs_path``.
"""

from __future__ import annotations

import pytest
import torch
from cpu_model import checkpoint_tensors, one_rank
from sglang_m3.tiny import default_checkpoint

FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def ckpt():
    return default_checkpoint("m3-tiny", "vl")


@pytest.fixture(scope="module")
def rank(ckpt):
    with one_rank(ckpt):
        yield


def fp8_linears(model):
    from sglang.srt.layers.quantization.fp8 import Fp8LinearMethod

    return [m for m in model.modules() if isinstance(getattr(m, "quant_method", None), Fp8LinearMethod)]


def build(ckpt):
    """The tiny M3 as ``--quantization fp8`` builds and loads it on a GPU with CUTLASS, on CPU."""
    from sglang.srt.layers.quantization.fp8 import Fp8Config, Fp8LinearMethod
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang_m3.model.minimax_m3 import MiniMaxM3ForCausalLM
    from sglang_m3.quant import take_fp8_rows
    from transformers import AutoConfig

    orig = Fp8LinearMethod.__init__

    def on_hopper(self, *args, **kwargs):  # what cutlass_fp8_supported() reports on sm_90
        orig(self, *args, **kwargs)
        self.cutlass_fp8_supported = True

    Fp8LinearMethod.__init__ = on_hopper
    try:
        with set_default_torch_dtype(torch.float32):
            model = MiniMaxM3ForCausalLM(AutoConfig.from_pretrained(ckpt), quant_config=Fp8Config())
    finally:
        Fp8LinearMethod.__init__ = orig
    model.load_weights(checkpoint_tensors(ckpt).items())
    for layer in model.model.layers:  # what post_load_weights does on CUDA
        layer.self_attn.fuse_qkv_index()
    for layer in fp8_linears(model):  # Fp8LinearMethod.process_weights_after_loading, per row (CUTLASS)
        weight = layer.weight.data.float()
        scale = (weight.abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-12)
        layer.weight = torch.nn.Parameter((weight / scale).to(FP8).t(), requires_grad=False)
        layer.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
        layer.input_scale = None
    assert take_fp8_rows(model) == 0  # the model wrapped them when it was built
    return model


def scaled_mm(q, weight, x_scale, weight_scale, out_dtype, bias=None):
    """SGLang's ``fp8_scaled_mm`` (CUTLASS, CUDA-only): ``(q x_scale) (w w_scale)`` in fp32, rounded once."""
    out = (q.float() * x_scale) @ (weight.float() * weight_scale.view(1, -1))
    return (out if bias is None else out + bias).to(out_dtype)


@pytest.fixture(scope="module")
def model(rank, ckpt):
    return build(ckpt)


def test_which_layers_take_rows(model):
    from sglang_m3.quant import apply_fp8_rows, takes_fp8_rows

    linears = fp8_linears(model)
    assert all(m.quant_method.apply.func is apply_fp8_rows for m in linears)
    assert all(takes_fp8_rows(m) for m in linears)
    first, moe = model.model.layers[0], model.model.layers[1]
    assert first.self_attn.fp8_input() is False and first.mlp.fp8_input() is False  # rows only
    assert moe.self_attn.fp8_input() is False and moe.mlp.fp8_input() is True  # the router reads the value
    weight = first.mlp.down_proj.weight
    first.mlp.down_proj.weight_scale.data = torch.ones(1)  # one scale for the tensor: SGLang's own path
    try:
        assert not takes_fp8_rows(first.mlp.down_proj) and weight.dtype == FP8
    finally:
        first.mlp.down_proj.weight_scale.data = torch.ones(weight.shape[1], 1)


def test_other_methods_are_left_alone(rank, ckpt):
    from sglang.srt.layers.quantization.fp8 import Fp8Config
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang_m3.model.minimax_m3 import MiniMaxM3ForCausalLM
    from sglang_m3.quant import take_fp8_rows
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(ckpt)
    with set_default_torch_dtype(torch.bfloat16):
        model = MiniMaxM3ForCausalLM(config, quant_config=Fp8Config())  # CPU: no CUTLASS, per-tensor scales
        plain = MiniMaxM3ForCausalLM(config)
    assert take_fp8_rows(model) == 0 and take_fp8_rows(plain) == 0
    assert all("apply" not in vars(m.quant_method) for m in fp8_linears(model))


def test_rows_path_matches_sglangs_quantise_then_gemm(model, monkeypatch):
    from sglang.srt.layers.quantization import fp8_utils
    from sglang_m3 import quant
    from sglang_m3.model import attention, mlp
    from sglang_m3_kernels import fp8_act

    class Backend:  # stands in for the MSA backend: these tests are about the linears around it
        def forward(self, q, k, v, layer, forward_batch, **index):
            return q.reshape(q.shape[0], -1) * 0.5

    calls = {"gemm": 0, "sglang_quant": 0, "norm_kernel": 0, "swiglu_kernel": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(attention, "get_attn_backend", lambda: Backend())
    monkeypatch.setattr(fp8_utils, "fp8_scaled_mm", counted("gemm", scaled_mm), raising=False)
    # SGLang's own per-token quantisation is a CUDA kernel (and its CPU fallback's e4m3 casts are not
    # rounded to nearest under Triton's interpreter): the same arithmetic in torch stands in for it
    quantise = counted("sglang_quant", lambda x, group_size: fp8_act.quantise_rows_ref(x))
    monkeypatch.setattr(fp8_utils, "per_token_group_quant_fp8", quantise)
    monkeypatch.setattr(fp8_act, "add_rmsnorm_fp8", counted("norm_kernel", fp8_act.add_rmsnorm_fp8))
    monkeypatch.setattr(mlp, "swiglu_fp8", counted("swiglu_kernel", mlp.swiglu_fp8))
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(4, model.m3.hidden_size, generator=gen)
    positions = torch.tensor([0, 9, 130, 4000])
    layers = model.model.layers

    def run():
        outs, h, r = [], hidden.clone(), None  # layer 0's input becomes the residual, updated in place
        for layer in layers:
            h, r = layer(positions, h, r, None)
            outs.append((h.clone(), r.clone()))  # later layers update the residual in place
        counts = dict(calls)
        calls.update(dict.fromkeys(calls, 0))
        return outs, counts

    got, fused = run()
    n = len(layers)
    # every FP8 GEMM (qkv, o, gate/up, down) ran; SGLang quantised only o_proj's input (the attention's output)
    assert fused == {"gemm": 4 * n, "sglang_quant": n, "norm_kernel": 2 * n, "swiglu_kernel": n}, fused
    for module in (quant, attention, mlp):
        monkeypatch.setattr(module, "takes_fp8_rows", lambda layer: False)
    want, sglang = run()
    assert sglang == {"gemm": 4 * n, "sglang_quant": 4 * n, "norm_kernel": 0, "swiglu_kernel": 0}, sglang
    for i, ((h, r), (wh, wr)) in enumerate(zip(got, want)):
        for name, a, b in (("output", h, wh), ("residual", r, wr)):
            error = ((a - b).norm() / b.norm()).item()
            assert error < 1e-5, (i, name, error)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_gpu_layer_matches_sglangs_path(rank, ckpt, tokens, monkeypatch):
    """CUDA, bf16: the Gemma norm's fused add + quantisation and the MLP's SwiGLU + quantisation feeding
    SGLang's CUTLASS FP8 GEMMs, against SGLang's fused-add norm, its per-token quantisation kernel and the
    same GEMMs. The residual is the same fp32 sum rounded once (equal); the two norms may round a value to
    bf16 a step apart, which can move its e4m3 code: the MLP's output within 2e-2 relative."""
    from sglang.srt.layers.quantization.fp8 import Fp8Config
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang_m3 import quant
    from sglang_m3.config import M3Config
    from sglang_m3.model import mlp
    from sglang_m3.model.layers import GemmaNorm
    from transformers import AutoConfig

    cfg = M3Config.from_hf(AutoConfig.from_pretrained(ckpt))
    with torch.device("cuda"), set_default_torch_dtype(torch.bfloat16):
        block = mlp.DenseMLP(cfg, cfg.dense_intermediate_size, prefix="mlp", quant_config=Fp8Config())
        norm = GemmaNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    for param in (block.gate_up_proj.weight, block.down_proj.weight):
        param.data = torch.randn(param.shape, device="cuda", generator=gen).bfloat16() * param.shape[1] ** -0.5
    norm.weight.data = (torch.randn(cfg.hidden_size, device="cuda", generator=gen) * 0.2).bfloat16()
    for layer in (block.gate_up_proj, block.down_proj):
        layer.quant_method.process_weights_after_loading(layer)
    assert quant.take_fp8_rows(block) == 2 and block.fp8_input() is False
    x = torch.randn(tokens, cfg.hidden_size, device="cuda", generator=gen).bfloat16()
    residual = torch.randn(tokens, cfg.hidden_size, device="cuda", generator=gen).bfloat16()

    rows, got_residual = norm.fp8_rows(x, residual.clone(), keep=False)
    got = block(rows).float()
    for module in (quant, mlp):
        monkeypatch.setattr(module, "takes_fp8_rows", lambda layer: False)
    normed, want_residual = norm(x, residual.clone())
    want = block(normed).float()
    assert torch.equal(got_residual, want_residual)
    error = ((got - want).norm() / want.norm()).item()
    print(f"{tokens} tokens: MLP output, fused against SGLang's path: relative error {error:.1e}")
    assert error < 2e-2
