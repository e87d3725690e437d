"""One GEMM for a sparse layer's q / k / v and index q / k projections (``M3Attention.fuse_qkv_index``;
``post_load_weights`` applies it on CUDA in half precision beside an unquantised ``qkv_proj``, as
SGLang's own M3 path fuses them).

On CPU the fusion is applied by hand to the tiny M3 in fp32, and what each sparse layer hands the
attention backend (q, k, v, index q, index k: normed and rotated) is compared with what the separate
projections give. Each output column is the same dot product either way; the bound (1e-6 relative)
leaves room for a GEMM's blocking only. Also: the parameters become views of the one weight (no copy),
and weights loaded after the fusion reach the fused GEMM.

At the release's head shapes (head and index dim 128, 64 rotary dims) on CUDA in bf16, the layer's whole
fast path (one GEMM, one launch of SGLang's fused norm + RoPE over four head groups) against its torch
path (two GEMMs, Gemma norms, our RoPE) on the same weights, within bf16 roundings: the torch path
rounds the norm's output to bf16 before rotating where the fused kernel rounds once, and the two GEMMs
may round a projection differently from the one (1 ulp, 2^-8 relative). A wrong head group or offset
moves values by O(1).

With ``--quantization fp8`` (SGLang's ``Fp8LinearMethod`` quantising the BF16 weight at load, one scale per
row on its CUTLASS GEMM) the fusion happens before that processing: ``qkv_proj``'s weight becomes the
concatenation and the indexer's copy is released (checked on CPU). On CUDA the processed fused layer
against the same layer processed unfused (q / k / v: the same FP8 rows and activation scales, so within
bf16 roundings) and against its BF16 indexer (index q / k: FP8 against BF16, relative error within 5e-2;
the index rows are scaled down 10^4 first, which rows sharing the qkv rows' scale would not survive).
"""

from __future__ import annotations

import copy

import pytest
import torch
from cpu_model import build_model, checkpoint_tensors, one_rank
from sglang_m3.config import M3Config
from sglang_m3.model import attention
from sglang_m3.tiny import default_checkpoint
from sglang_m3.tiny.build import released_text_config

FP32 = dict(atol=1e-6, rtol=1e-6)
BF16 = dict(atol=3e-2, rtol=2e-2)  # about 3 bf16 ulps at the largest values (~4.5)
INPUTS = ("q", "k", "v", "index_q", "index_k")


@pytest.fixture(scope="module")
def ckpt():
    return default_checkpoint("m3-tiny", "vl")


@pytest.fixture(scope="module")
def rank(ckpt):
    with one_rank(ckpt):
        yield


class Recorder:
    """Stands in for the attention backend: keeps what the layer hands it."""

    def forward(self, q, k, v, layer, forward_batch, **index):
        self.seen = {"q": q, "k": k, "v": v, **index}
        return q.reshape(q.shape[0], -1).clone()


def backend_inputs(attn, x, positions, monkeypatch) -> dict[str, torch.Tensor]:
    recorder = Recorder()
    monkeypatch.setattr(attention, "get_attn_backend", lambda: recorder)
    attn(positions, x, None)
    return {name: t.reshape(t.shape[0], -1).clone() for name, t in recorder.seen.items()}


def sparse_layers(model):
    return [layer.self_attn for layer in model.model.layers if layer.self_attn.indexer is not None]


def test_fused_projection_hands_the_backend_the_same_inputs(rank, ckpt, monkeypatch):
    model = build_model(ckpt, torch.float32)
    layers = sparse_layers(model)
    assert len(layers) == 3 and all(a.qkv_index is None for a in layers)  # CPU: post_load_weights keeps them apart
    torch.manual_seed(0)
    x = torch.randn(6, model.m3.hidden_size)
    positions = torch.tensor([0, 3, 17, 64, 200, 4095])
    for attn in layers:
        want = backend_inputs(attn, x, positions, monkeypatch)
        attn.fuse_qkv_index()
        fused = attn.qkv_index.layer.weight
        assert attn.qkv_proj.weight.data_ptr() == fused.data_ptr()  # views of the one weight
        assert attn.indexer.qk_proj.weight.data_ptr() == fused[attn.qkv_index.split :].data_ptr()
        got = backend_inputs(attn, x, positions, monkeypatch)
        assert set(got) == set(want) == set(INPUTS)
        for name in INPUTS:
            torch.testing.assert_close(got[name], want[name], **FP32, msg=name)
    dense = model.model.layers[0].self_attn
    dense.fuse_qkv_index()
    assert dense.indexer is None and dense.qkv_index is None  # nothing to fuse on a dense layer


def test_weights_loaded_after_the_fusion_reach_the_fused_gemm(rank, ckpt, monkeypatch):
    """A second load (as a weight update does) writes through the views into the fused weight."""
    torch.manual_seed(1)
    tensors = checkpoint_tensors(ckpt)
    changed = {
        n: t + torch.randn_like(t) if n.endswith("_proj.weight") and ".self_attn." in n else t
        for n, t in tensors.items()
    }
    fused = build_model(ckpt, torch.float32)
    for attn in sparse_layers(fused):
        attn.fuse_qkv_index()
    fused.load_weights(changed.items())
    reference = build_model(ckpt, torch.float32, changed)
    x, positions = torch.randn(4, fused.m3.hidden_size), torch.tensor([1, 30, 99, 1000])
    for got_attn, want_attn in zip(sparse_layers(fused), sparse_layers(reference)):
        assert got_attn.qkv_index is not None
        got = backend_inputs(got_attn, x, positions, monkeypatch)
        want = backend_inputs(want_attn, x, positions, monkeypatch)
        for name in INPUTS:
            torch.testing.assert_close(got[name], want[name], **FP32, msg=name)


def release_shaped_layer(device: str, dtype: torch.dtype, quant_config=None) -> attention.M3Attention:
    """A sparse M3 attention layer with the release's head shapes (4 q heads, 1 KV head), random weights."""
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    spec = released_text_config("m3-tiny")
    spec.update(hidden_size=256, head_dim=128)
    spec["sparse_attention_config"] = dict(spec["sparse_attention_config"], sparse_index_dim=128)
    cfg = M3Config.from_text_dict(spec, "MiniMaxM3SparseForCausalLM")
    assert attention.fused_norm_rope_fits(cfg) and cfg.sparse_layers[1]
    with torch.device(device), set_default_torch_dtype(dtype):
        layer = attention.M3Attention(cfg, 1, prefix="model.layers.1.self_attn", quant_config=quant_config)
    gen = torch.Generator().manual_seed(2)
    for param in layer.parameters():  # unit-variance projections; norm weights near 0 (Gemma: x (1 + w))
        scale = param.shape[-1] ** -0.5 if param.dim() > 1 else 0.2
        param.data = (torch.randn(param.shape, generator=gen) * scale).to(device, dtype)
    return layer  # the RoPE frequencies stay fp32, as the model builds them


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_release_shaped_layer_fast_path_matches_its_torch_path(rank, device, monkeypatch):
    """CPU: the one GEMM only (fp32). CUDA: the one GEMM and the one four-group norm + RoPE launch (bf16)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    slow = release_shaped_layer(device, dtype)
    fast = copy.deepcopy(slow)
    if device == "cuda":
        attention.use_fused_norm_rope([fast], fast.rope.cos_sin_table(8192))
    fast.fuse_qkv_index()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 256, generator=gen).to(device, dtype)
    positions = torch.tensor([0, 7, 300, 4095, 8191], device=device)
    want = backend_inputs(slow, x, positions, monkeypatch)
    got = backend_inputs(fast, x, positions, monkeypatch)
    tolerance = BF16 if device == "cuda" else FP32
    for name in INPUTS:
        torch.testing.assert_close(got[name].float(), want[name].float(), **tolerance, msg=name)


def test_row_quantised_qkv_takes_the_index_rows_before_it_is_processed(rank):
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    layer = release_shaped_layer("cpu", torch.bfloat16, Fp8Config())
    qkv, index = layer.qkv_proj.weight.detach().clone(), layer.indexer.qk_proj.weight.detach().clone()
    layer.fuse_qkv_index()
    assert layer.qkv_index.layer is layer.qkv_proj and layer.qkv_index.split == qkv.shape[0]
    assert torch.equal(layer.qkv_proj.weight, torch.cat([qkv, index]))  # what the quant method will process
    assert layer.indexer.qk_proj.weight.numel() == 0  # the unquantised copy is released
    layer.fuse_qkv_index()  # twice (loaders may call post_load_weights again): no change
    assert layer.qkv_proj.weight.shape[0] == qkv.shape[0] + index.shape[0]

    processed = release_shaped_layer("cpu", torch.bfloat16, Fp8Config())
    processed.qkv_proj.weight.data = processed.qkv_proj.weight.data.to(torch.float8_e4m3fn)
    processed.fuse_qkv_index()  # a loader that restores already processed weights: left apart
    assert processed.qkv_index is None and processed.indexer.qk_proj.weight.numel() > 0


def test_which_quant_methods_quantise_rows_alone(rank):
    from sglang.srt.layers.quantization.fp8 import Fp8Config, Fp8LinearMethod
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod
    from sglang_m3.quant import quantises_rows_alone

    def method(config, **attrs):
        m = Fp8LinearMethod(config)
        m.cutlass_fp8_supported = True  # what a Hopper GPU reports
        for name, value in attrs.items():
            setattr(m, name, value)
        return m

    assert quantises_rows_alone(method(Fp8Config()))  # --quantization fp8 on a BF16 checkpoint
    assert not quantises_rows_alone(method(Fp8Config(), cutlass_fp8_supported=False))  # one scale per tensor
    assert not quantises_rows_alone(method(Fp8Config(), use_marlin=True))  # sized from the declared widths
    assert not quantises_rows_alone(method(Fp8Config(is_checkpoint_fp8_serialized=True)))  # the checkpoint's scales
    block = Fp8Config(is_checkpoint_fp8_serialized=True, weight_block_size=[128, 128])
    assert not quantises_rows_alone(method(block))
    assert not quantises_rows_alone(UnquantizedLinearMethod())


@pytest.mark.gpu
def test_fp8_fused_projection_matches_the_separate_ones(rank, monkeypatch):
    from sglang.srt.layers.quantization.fp8 import Fp8Config
    from sglang_m3.quant import quantises_rows_alone

    slow, fast = (release_shaped_layer("cuda", torch.bfloat16, Fp8Config()) for _ in range(2))  # same weights
    for layer in (slow, fast):
        layer.indexer.qk_proj.weight.data *= 1e-4  # far below the q / k / v rows: needs scales of its own
        attention.use_fused_norm_rope([layer], layer.rope.cos_sin_table(8192))
    assert quantises_rows_alone(fast.qkv_proj.quant_method)
    fast.fuse_qkv_index()
    for layer in (slow, fast):  # what SGLang's loader does after post_load_weights
        for module in layer.modules():
            if getattr(module, "quant_method", None) is not None:
                module.quant_method.process_weights_after_loading(module)
    assert fast.qkv_proj.weight.dtype == torch.float8_e4m3fn and slow.indexer.qk_proj.weight.dtype == torch.bfloat16
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(5, 256, generator=gen).to("cuda", torch.bfloat16)
    positions = torch.tensor([0, 7, 300, 4095, 8191], device="cuda")
    want = backend_inputs(slow, x, positions, monkeypatch)
    got = backend_inputs(fast, x, positions, monkeypatch)
    for name in ("q", "k", "v"):
        torch.testing.assert_close(got[name].float(), want[name].float(), **BF16, msg=name)
    for name in ("index_q", "index_k"):
        error = (got[name].float() - want[name].float()).norm() / want[name].float().norm()
        assert error < 5e-2, (name, error.item())
