"""The block-FP8 copy of the tiny M3 (``sglang_m3.tiny.fp8``) and how SGLang's Fp8 methods take it.

The copy: fp8 weights with per-block ``weight_scale_inv`` exactly where a block-FP8 release has
them, dequantising to the originals within e4m3's rounding (``error_bound``: |w| / 16 + scale_inv
x 2**-10 per element), and a ``quantization_config`` SGLang's ``Fp8Config`` reads. The model: built
on CPU with that ``Fp8Config`` (parameters only, no kernels), every layer built with
``quant_config`` gets an fp8 weight and a block scale of the right shape; ``load_weights`` puts
every checkpoint tensor, scales included, into a parameter, and the loaded fused weights
dequantise to what the BF16 original loads.
"""

from __future__ import annotations

import hashlib
import json
import re

import pytest
import torch
from cpu_model import build_model, checkpoint_tensors, one_rank
from sglang_m3.model.weights import map_name
from sglang_m3.tiny import default_checkpoint
from sglang_m3.tiny.fp8 import (
    MODULES_TO_NOT_CONVERT,
    TINY_BLOCK,
    build_fp8_copy,
    default_fp8_checkpoint,
    dequantize_block,
    error_bound,
    quantize_block,
)

# Which released tensors a block-FP8 M3 stores in fp8, spelled out independently of the generator.
QUANTISED = re.compile(
    r"^language_model\.model\.layers\.\d+\.(?:self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj"
    r"|block_sparse_moe\.experts\.\d+\.w[123]|block_sparse_moe\.shared_experts\.(?:gate|up|down)_proj)\.weight$"
)


@pytest.fixture(scope="module")
def src():
    return default_checkpoint("m3-tiny", "vl")


@pytest.fixture(scope="module")
def fp8(src):
    return default_fp8_checkpoint("m3-tiny", "vl")


def test_quantised_tensors_round_trip_within_the_e4m3_block_bound(src, fp8):
    orig, copy = checkpoint_tensors(src), checkpoint_tensors(fp8)
    quantised = sorted(n for n in orig if QUANTISED.match(n))
    assert len(quantised) == 4 * 4 + 2 + 1 + 3 * (3 * 8 + 3)  # q/k/v/o x4, dense gate/up/down, 3 MoE layers
    assert set(copy) == set(orig) | {n + "_scale_inv" for n in quantised}
    worst = 0.0
    for name in quantised:
        w, q, s = orig[name], copy[name], copy[name + "_scale_inv"]
        rows, cols = (-(-d // b) for d, b in zip(w.shape, TINY_BLOCK))
        assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape, name
        assert s.dtype == torch.float32 and s.shape == (rows, cols), name
        err = (dequantize_block(q, s, TINY_BLOCK) - w.float()).abs()
        bound = error_bound(w, s, TINY_BLOCK)
        assert (err <= bound).all(), f"{name}: {(err - bound).max():.3e} over the bound"
        worst = max(worst, (err / bound).max().item())
    assert worst > 0.5  # the bound is not loose: some element comes close to it
    for name in set(orig) - set(quantised):  # router, bias, indexer, norms, embedding, lm_head, vision
        assert copy[name].dtype == orig[name].dtype and torch.equal(copy[name], orig[name]), name


def test_quantize_block_pads_ragged_edges_and_zero_blocks():
    w = torch.zeros(40, 70)
    w[:3, :5] = torch.randn(3, 5)
    w[39, 69] = 1000.0
    q, s = quantize_block(w, (32, 32))
    assert q.shape == (40, 70) and s.shape == (2, 3)
    assert s[0, 1] == 1.0 and s[1, 2] == 1000.0 / 448  # an all-zero block keeps scale 1; amax -> 448
    assert (dequantize_block(q, s, (32, 32)) - w).abs().le(error_bound(w, s, (32, 32))).all()


def test_config_carries_a_quantization_config_sglang_reads(fp8):
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    config = json.loads((fp8 / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc == {
        "quant_method": "fp8",
        "fmt": "float8_e4m3fn",
        "activation_scheme": "dynamic",
        "weight_block_size": list(TINY_BLOCK),
        "modules_to_not_convert": MODULES_TO_NOT_CONVERT,
    }
    parsed = Fp8Config.from_config(qc)
    assert parsed.get_name() == "fp8" and parsed.is_checkpoint_fp8_serialized
    assert parsed.weight_block_size == list(TINY_BLOCK) and parsed.activation_scheme == "dynamic"


def test_sglang_detects_the_quantization_from_the_checkpoint(fp8):
    """No ``--quantization`` flag: SGLang's ModelConfig reads the top-level ``quantization_config``."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.server_args import ServerArgs

    config = ModelConfig.from_server_args(ServerArgs(model_path=str(fp8), device="cpu", dtype="bfloat16"))
    assert config.quantization == "fp8"


def test_build_is_deterministic(src, tmp_path):
    def digest(path):
        return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}

    assert digest(build_fp8_copy(src, tmp_path / "a")) == digest(build_fp8_copy(src, tmp_path / "b"))


@pytest.fixture(scope="module")
def models(src, fp8):
    """(BF16 model, block-FP8 model), built on CPU in bf16 with SGLang's parallel state for one rank."""
    with one_rank(fp8):
        yield tuple(build_model(path, torch.bfloat16) for path in (src, fp8))


QUANT_LAYERS = re.compile(r"\.(?:qkv_proj|o_proj|gate_up_proj|down_proj)$")


def test_every_quantised_layer_gets_a_block_scale_of_the_right_shape(models):
    from sglang.srt.layers.linear import LinearBase
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang_m3.model.layers import Router

    _, model = models
    bn, bk = TINY_BLOCK
    seen = {"linear": 0, "moe": 0, "plain": 0}
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE):
            e, two_i, h = module.w13_weight.shape
            assert module.w13_weight.dtype == module.w2_weight.dtype == torch.float8_e4m3fn
            assert module.w13_weight_scale_inv.shape == (e, two_i // bn, h // bk)
            assert module.w2_weight_scale_inv.shape == (e, h // bn, two_i // 2 // bk)
            seen["moe"] += 1
        elif isinstance(module, LinearBase) and QUANT_LAYERS.search(name):
            out, inp = module.weight.shape
            assert module.weight.dtype == torch.float8_e4m3fn, name
            assert module.weight_scale_inv.shape == (-(-out // bn), -(-inp // bk)), name
            assert module.weight_scale_inv.dtype == torch.float32
            seen["linear"] += 1
        elif isinstance(module, (LinearBase, Router)):  # router, indexer: unquantised
            assert module.weight.dtype in (torch.bfloat16, torch.float32) and not hasattr(module, "weight_scale_inv")
            seen["plain"] += 1
    assert seen == {"linear": 4 * 2 + 2 + 3 * 2, "moe": 3, "plain": 3 + 3}
    assert model.lm_head.weight.dtype == model.model.embed_tokens.weight.dtype == torch.bfloat16


def test_every_scale_name_maps_to_an_existing_parameter(models, fp8):
    _, model = models
    params = dict(model.named_parameters())
    scales = [n for n in checkpoint_tensors(fp8) if n.endswith("weight_scale_inv")]
    assert scales
    for name in scales:
        target = map_name(name)
        assert target.param in params and target.param.endswith("weight_scale_inv"), (name, target)
    assert {n for n in params if n.endswith("_scale_inv")} == {map_name(n).param for n in scales}


def test_loaded_fp8_weights_dequantise_to_the_bf16_model(models):
    """The loader's placement of fp8 shards and their block scales into the fused qkv / gate_up /
    FusedMoE w13 / w2 parameters (offsets in blocks) against the BF16 model loaded from the original."""
    bf16, quant = models
    ref, got = dict(bf16.named_parameters()), dict(quant.named_parameters())
    assert set(got) == set(ref) | {n for n in got if n.endswith("_scale_inv")}
    for name, want in ref.items():
        if name + "_scale_inv" not in got:
            assert torch.equal(got[name], want), name
            continue
        q, s = got[name], got[name + "_scale_inv"]
        for i in range(q.shape[0]) if q.ndim == 3 else [None]:  # FusedMoE: per expert
            qi, si, wi = (q, s, want) if i is None else (q[i], s[i], want[i])
            err = (dequantize_block(qi, si, TINY_BLOCK) - wi.float()).abs()
            assert (err <= error_bound(wi, si, TINY_BLOCK)).all(), (name, i)


def test_block_fp8_linears_other_than_128_stay_on_triton(models, monkeypatch):
    """SGLang would send a 64 x 128 aligned block-FP8 linear to DeepGEMM (128 x 128 scales only) where it is
    installed; the model moves every linear of another block size to SGLang's Triton GEMM."""
    from sglang.srt.layers.quantization import fp8_utils
    from sglang.srt.layers.quantization.fp8 import Fp8LinearMethod
    from sglang_m3.quant import keep_block_fp8_on_triton

    _, model = models
    methods = [m.quant_method for m in model.modules() if isinstance(getattr(m, "quant_method", None), Fp8LinearMethod)]
    assert len(methods) == 16
    assert all(m.w8a8_block_fp8_linear is fp8_utils.triton_w8a8_block_fp8_linear for m in methods)
    for m in methods[:3]:
        monkeypatch.setattr(m, "w8a8_block_fp8_linear", fp8_utils.deepgemm_w8a8_block_fp8_linear_with_fallback)
    assert keep_block_fp8_on_triton(model.model, model.quant_config) == 3
    assert all(m.w8a8_block_fp8_linear is fp8_utils.triton_w8a8_block_fp8_linear for m in methods)


def test_block_fp8_moe_other_than_128_needs_the_triton_runner(models, monkeypatch):
    from sglang.srt.layers.moe import utils
    from sglang_m3.quant import keep_block_fp8_on_triton

    _, model = models
    monkeypatch.setattr(utils, "get_moe_runner_backend", lambda: utils.MoeRunnerBackend.DEEP_GEMM)
    with pytest.raises(ValueError, match=r"weight_block_size=\[32, 32\] with --moe-runner-backend='deep_gemm'"):
        keep_block_fp8_on_triton(model.model, model.quant_config)
