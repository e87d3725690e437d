"""``scripts/bench_scaled.py``: the cut config, the HBM floors beside each TPOT, the trace reduction."""

from __future__ import annotations

import argparse
import gzip
import json
import pathlib
import runpy

import pytest
from sglang_m3.config import M3Config

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    return runpy.run_path(str(REPO / "scripts" / "bench_scaled.py"), run_name="bench_scaled")


@pytest.mark.parametrize("dense,sparse", [(1, 3), (1, 7), (3, 0)])
def test_cut_config_keeps_the_released_layer_kinds(bench, dense, sparse):
    cfg = M3Config.from_hf(bench["cut_config"](dense, sparse))
    assert cfg.num_layers == dense + sparse
    assert cfg.sparse_layers == (False,) * dense + (True,) * sparse
    assert cfg.moe_layers == cfg.sparse_layers  # in the release the sparse layers are the MoE ones
    assert (cfg.hidden_size, cfg.num_experts, cfg.vocab_size) == (6144, 128, 200064)


def test_fill_takes_the_most_sparse_layers_within_the_fraction(bench):
    """``--fill``: one more layer than chosen would pass the budget; the heaviest format decides; more
    ranks hold more layers; a budget below the dense layers alone is refused naming the flag."""
    from sglang_m3.sizing import rank_weights

    fill, gib = bench["fill_sparse_layers"], 1 << 30

    def weights(sparse, tp, quant):
        return rank_weights(M3Config.from_hf(bench["cut_config"](1, sparse)), tp, tp, quantization=quant).total

    for tp, quants in ((1, {None}), (1, {"fp8"}), (4, {None, "fp8"}), (8, {None})):
        n = fill(1, 0.7, 80 * gib, tp, tp, quants)
        heaviest = None if None in quants else "fp8"
        assert weights(n, tp, heaviest) <= 0.7 * 80 * gib < weights(n + 1, tp, heaviest)
    assert fill(1, 0.7, 80 * gib, 1, 1, {None}) == 3  # the 1 + 3 cut of the single-GPU tables
    assert fill(1, 0.7, 80 * gib, 1, 1, {None, "fp8"}) == 3 < fill(1, 0.7, 80 * gib, 1, 1, {"fp8"})
    assert fill(1, 0.7, 141 * gib, 8, 8, {None}) == 56  # 8 x H200: all but one of the release's 57
    with pytest.raises(SystemExit, match="--fill=0.01"):
        fill(1, 0.01, 80 * gib, 1, 1, {None})


def test_floors_of_the_four_layer_cut(bench, tmp_path):
    """The issue's arithmetic: ~1.29 / 3.3 / 7.7 ms at batch 1 / 8 / 32 with 8K contexts."""
    (tmp_path / "config.json").write_text(json.dumps(bench["cut_config"](1, 3)))
    records = [dict(impl="ours", kind="tpot", batch=b, context=8192, ms=10.0) for b in (1, 8, 32)]
    records.append(dict(impl="ours:fp8", kind="tpot", batch=1, context=8192, ms=1.0))
    bench["floors"](argparse.Namespace(kv_cache_dtype="auto", hbm_tbps=4.3, tp_size=1, ep_size=1), tmp_path, records)
    floors = [r["floor_ms"] for r in records]
    assert floors[:3] == pytest.approx([1.29, 3.30, 7.68], rel=0.02)
    assert floors[1] < floors[2] and records[0]["vs_floor"] == pytest.approx(10.0 / floors[0])
    assert 0.6 < floors[3] / floors[0] < 0.8  # fp8 halves the projections, not the head


def test_floors_per_rank_under_tp_and_ep(bench, tmp_path):
    """At TP8 a rank moves an eighth of the weights (its KV head, the shared index-K and the fp32 router
    whole), so its batch-1 floor is a little over an eighth of TP1's; EP splits the same experts otherwise."""
    (tmp_path / "config.json").write_text(json.dumps(bench["cut_config"](1, 3)))

    def floor(tp, ep):
        records = [dict(impl="ours", kind="tpot", batch=1, context=8192, ms=1.0)]
        args = argparse.Namespace(kv_cache_dtype="auto", hbm_tbps=4.3, tp_size=tp, ep_size=ep)
        bench["floors"](args, tmp_path, records)
        return records[0]["floor_ms"]

    assert 1 / 8 < floor(8, 1) / floor(1, 1) < 1 / 7
    assert floor(8, 8) == pytest.approx(floor(8, 1), rel=0.01)  # expected experts touched per rank alike


def test_trace_reduction(bench, tmp_path):
    kernels = [
        ("fused_moe_kernel", 0, 100),
        ("nvjet_tst_gemm", 150, 50),  # 50 us gap before it
        ("_msa_sparse_attn_kernel", 200, 20),
        ("_fwd_grouped_kernel_stage1", 220, 10),  # stock's dense-layer decode attention
        ("void flashinfer::norm::FusedAddRMSNormKernel<8u, __nv_bfloat16>(__nv_bfloat16*", 230, 10),
        ("elementwise_add", 240, 10),
        ("elementwise_add", 250, 10),
    ]
    events = [{"cat": "kernel", "name": n, "ts": ts, "dur": d, "ph": "X"} for n, ts, d in kernels]
    events.append({"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 400, "ph": "X"})
    path = tmp_path / "t.trace.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    out = bench["summarise_trace"](path, steps=2)
    assert out["moe"] == pytest.approx(0.05) and out["gemm"] == pytest.approx(0.025)
    assert out["attention"] == pytest.approx(0.015) and out["norm"] == pytest.approx(0.005)
    assert out["other"] == pytest.approx(0.01)
    assert out["host_gaps"] == pytest.approx(0.025) and out["step"] == pytest.approx(0.13)
    assert out["launches_per_step"] == dict.fromkeys(("moe", "gemm", "norm"), 0.5) | {
        "indexer": 0.0,
        "attention": 1.0,
        "sampling": 0.0,
        "other": 1.0,
        "total": 3.5,
    }
    assert out["kernels"][:3] == [
        ["fused_moe_kernel", 0.5, 50.0],
        ["nvjet_tst_gemm", 0.5, 25.0],
        ["_msa_sparse_attn_kernel", 0.5, 10.0],
    ]
    assert ["elementwise_add", 1.0, 10.0] in out["kernels"] and len(out["kernels"]) == 6


def test_trace_reduction_credits_overlap_once_and_torch_gathers_to_other(bench, tmp_path):
    kernels = [
        ("nvjet_tst_gemm", 0, 100),  # the main stream
        ("cutlass_gemm_side", 40, 100),  # a side stream: its first 60 us overlap the GEMM above
        ("_block_score_kernel", 130, 30),  # launched early (PDL): waits 10 us inside the side GEMM
        ("void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<x>>", 160, 10),
        ("void at::native::(anonymous namespace)::indexSelectSmallIndex<float>", 170, 10),
    ]
    events = [{"cat": "kernel", "name": n, "ts": ts, "dur": d, "ph": "X"} for n, ts, d in kernels]
    path = tmp_path / "t.trace.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    out = bench["summarise_trace"](path, steps=1)
    assert out["gemm"] == pytest.approx(0.14) and out["indexer"] == pytest.approx(0.02)
    assert out["other"] == pytest.approx(0.02) and out["host_gaps"] == 0
    parts = sum(out[k] for k in ("moe", "indexer", "norm", "attention", "gemm", "sampling", "other"))
    assert parts + out["host_gaps"] == pytest.approx(out["step"]) == pytest.approx(0.18)
    assert ["cutlass_gemm_side", 1.0, 100.0] in out["kernels"]  # durations stay whole there
    assert ["_block_score_kernel", 1.0, 30.0] in out["kernels"]


@pytest.mark.parametrize("impl", ["stock+fused-shared", "ours+tuned-moe", "stock+one-stream", "ours+two-streams"])
def test_unknown_impl_flags_are_refused_before_any_engine_starts(bench, impl):
    with pytest.raises(SystemExit, match=r"--impls: unknown '.*\+"):
        bench["main"](["--impls", f"ours,{impl}", "--model-path", "/nonexistent"])


def test_one_stream_switch_is_the_models(bench):
    from sglang_m3.model import mlp

    assert bench["SIDE_STREAM_ENV"] == mlp.SIDE_STREAM_ENV


def test_full_batch_window(bench):
    a, b = [(0.0, 1), (0.5, 5), (1.0, 9)], [(0.2, 1), (0.9, 8), (1.4, 12)]
    assert bench["full_batch_window"]([a, b]) == (0.2, 1.0)
    late = [(1.1, 1), (1.5, 4)]  # admitted after request a had finished
    with pytest.raises(RuntimeError, match="no full-batch window: a request's first chunk came after"):
        bench["full_batch_window"]([a, late])


def test_engine_args_let_the_largest_batch_run_at_once(bench):
    """SGLang caps an EAGLE engine at 48 running requests unless told: the batch-64 spec rows need 64."""
    args = argparse.Namespace(
        model_dir="m", device="cuda", dtype="bfloat16", tp_size=1, ep_size=1, kv_cache_dtype="auto"
    )  # fmt: skip
    engine = bench["engine_base_args"](args, "dummy", 1 << 20, [64, 1, 8], 0.85)
    assert engine["max_running_requests"] == 64 and engine["cuda_graph_bs_decode"] == [1, 8, 64]
    assert bench["engine_base_args"](args, "dummy", 8192, [], 0.85)["max_running_requests"] == 1


def test_repeats_below_one_are_refused(bench, capsys):
    with pytest.raises(SystemExit):
        bench["parse_args"](["--repeats", "0"])
    assert "--repeats=0: at least one timed round" in capsys.readouterr().err
