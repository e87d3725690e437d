"""The plugin on a GPU: sglang.Engine on CUDA runs the Triton MSA kernels and the Triton KV store.

fp32 model and KV, so the kernels use IEEE fp32 dots: prompt log-probs must match
transformers (run on the same GPU) to 1e-3 and greedy output token for token; the
quantised layouts must run and stay within the CPU-measured bounds.
"""

from __future__ import annotations

import pytest
import torch

from .conftest import prompts_from
from .hf_reference import greedy, load_hf, prompt_logprobs
from .parity_helpers import KV_ERROR_BOUNDS, NEW_TOKENS, run_per_kv_dtype

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
GPU_ARGS = dict(
    device="cuda",
    dtype="float32",
    disable_cuda_graph=True,
    log_level="error",
    max_total_tokens=8192,
    mem_fraction_static=0.5,
)
FP8_WEIGHT_ERROR_BOUND = 0.5  # mean |d log-prob| of FP8 weights vs BF16 on the tiny M3 (H100: 0.303)


@pytest.fixture(scope="module")
def results(tiny_vl, corpus_ids):
    prompts = prompts_from(corpus_ids)
    return prompts, run_per_kv_dtype(tiny_vl, ("auto", "fp8_e4m3", "nvfp4"), prompts, GPU_ARGS)


def test_cuda_engine_matches_transformers(results, tiny_vl):
    prompts, out = results
    model = load_hf(tiny_vl, "vl")[0].cuda()
    lps, outs = out["auto"]
    for ids, lp, got in zip(prompts, lps, outs):
        ref = prompt_logprobs(model, ids)
        print(f"{len(ids)} tokens: max |dlogprob| {(lp - ref).abs().max().item():.2e}")
        torch.testing.assert_close(lp, ref, atol=1e-3, rtol=0)
        assert got == greedy(model, ids, NEW_TOKENS)


def test_cuda_quantised_layouts_run_within_bounds(results):
    _, out = results
    ref = torch.cat(out["auto"][0])
    for kv_dtype, bound in KV_ERROR_BOUNDS.items():
        err = (torch.cat(out[kv_dtype][0]) - ref).abs().mean().item()
        print(f"{kv_dtype}: mean |dlogprob| {err:.3f}")
        assert 0 < err < bound


@pytest.fixture(scope="module")
def bf16_run(tiny_vl, corpus_ids):
    """The tiny M3 in BF16 on CUDA: (prompt log-probs, greedy outputs), the FP8 tests' reference."""
    return run_per_kv_dtype(tiny_vl, ("auto",), prompts_from(corpus_ids), dict(GPU_ARGS, dtype="bfloat16"))["auto"]


def _compare_to_bf16(label: str, run, bf16_run) -> float:
    """Mean |d log-prob| of ``run`` against BF16, printed with the greedy agreement."""
    (lp_fp8, out_fp8), (lp_bf16, out_bf16) = run, bf16_run
    err = torch.cat([(a - b).abs() for a, b in zip(lp_fp8, lp_bf16)])
    same = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(out_fp8, out_bf16)]
    print(
        f"{label} vs bf16: mean |dlogprob| {err.mean():.4f} (max {err.max():.3f}); greedy tokens equal before "
        f"the first difference: {same} of {NEW_TOKENS}"
    )
    return err.mean().item()


def test_fp8_weights_stay_close_to_bf16(tiny_vl, corpus_ids, bf16_run):
    """``--quantization fp8`` (SGLang's FP8 linear and MoE methods, weights quantised at load) against
    the same model in BF16: prompt log-probs and greedy agreement, printed and bounded."""
    args = dict(GPU_ARGS, dtype="bfloat16", quantization="fp8")
    run = run_per_kv_dtype(tiny_vl, ("auto",), prompts_from(corpus_ids), args)["auto"]
    assert 0 < _compare_to_bf16("fp8 weights", run, bf16_run) < FP8_WEIGHT_ERROR_BOUND


def test_block_fp8_checkpoint_stays_close_to_bf16(corpus_ids, bf16_run):
    """A checkpoint carrying a block-FP8 ``quantization_config`` (``sglang-m3 tiny-path --fp8-block``: fp8
    weights, 32 x 32 ``weight_scale_inv``) loads through SGLang's Fp8LinearMethod / Fp8MoEMethod with block
    quant (Triton block GEMMs, Triton fused MoE) and stays within the per-tensor bound of the BF16 original.

    The same bound as ``--quantization fp8`` (H100: mean 0.30, max 2.50): the same layers quantised, every
    weight and activation rounded to e4m3's 3 mantissa bits (2**-4 relative) either way; the scales' grain
    (here one per 32 x 32 weight block and per 32 activations of a token, there one per channel / expert and
    per token) only decides which values fall below e4m3's normal range, a tiny fraction of them."""
    from sglang_m3.tiny.fp8 import default_fp8_checkpoint

    args = dict(GPU_ARGS, dtype="bfloat16")
    run = run_per_kv_dtype(default_fp8_checkpoint("m3-tiny", "vl"), ("auto",), prompts_from(corpus_ids), args)["auto"]
    assert 0 < _compare_to_bf16("block-fp8 checkpoint", run, bf16_run) < FP8_WEIGHT_ERROR_BOUND
