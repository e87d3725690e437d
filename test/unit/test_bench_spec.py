"""scripts/bench_spec.py's pure parts: the real-width draft config, trace grouping, projection arithmetic."""

from __future__ import annotations

import pathlib
import runpy

import pytest
from sglang_m3.config import DraftConfig, M3Config
from sglang_m3.sizing import draft_weight_bytes

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    return runpy.run_path(str(REPO / "scripts" / "bench_spec.py"), run_name="bench_spec")


@pytest.mark.parametrize("sparse,kv,params", [(3, 4, 2.96e9), (7, 64, 3.15e9)])
def test_draft_fits_the_cut(bench, sparse, kv, params):
    target = bench["scaled"].cut_config(1, sparse)
    d = DraftConfig.from_dict(bench["real_width_draft_config"](target, kv_heads=kv))
    d.check_fits(M3Config.from_hf(target))
    assert (d.hidden_size, d.num_heads, d.num_kv_heads, d.draft_vocab_size) == (6144, 64, kv, 200064)
    assert sum(draft_weight_bytes(d, own_embed=True).values()) / 2 == pytest.approx(params, rel=0.01)


def test_reduced_vocabulary_draft(bench):
    """``--draft-vocab``: the draft's head shrinks to the pruned vocabulary (as the draft's floor counts it);
    a size outside the target's vocabulary is refused naming the flag."""
    target = bench["scaled"].cut_config(1, 3)
    d = DraftConfig.from_dict(bench["real_width_draft_config"](target, vocab=32000))
    assert (d.vocab_size, d.draft_vocab_size) == (200064, 32000)
    assert draft_weight_bytes(d)["head"] == 32000 * 6144 * 2
    for bad in (0, 200065):
        with pytest.raises(ValueError, match=f"--draft-vocab={bad}"):
            bench["real_width_draft_config"](target, vocab=bad)


def _events(counts, steps, kernel_names=None, start=0):
    """Graph launches of ``counts`` kernels each (``kernel_names``: the kernel name per launch), repeated
    ``steps`` times, from launch ``start`` of the pattern on."""
    ev, ts, corr = [], 0, 0
    names = kernel_names or ["gemm"] * len(counts)
    order = [(c, k) for _ in range(steps) for c, k in zip(counts, names)][start:]
    for c, name in order:
        corr += 1
        ev.append({"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": ts, "args": {"correlation": corr}})
        for _ in range(c):
            ev.append({"cat": "kernel", "name": name, "ts": ts, "dur": 10, "args": {"correlation": corr}})
            ts += 10
    return ev


def test_trace_grouping(bench):
    launches, eager = bench["graph_launches"](_events((2, 5, 1), 3))
    out = bench["step_phases"](launches, eager)
    assert out["steps"] == 3 and out["verify"] == pytest.approx(0.05) and out["draft_chain"] == pytest.approx(0.02)
    with pytest.raises(ValueError):
        bench["step_phases"](bench["graph_launches"](_events((2, 5), 3))[0])


def test_verify_is_the_launch_with_moe_kernels(bench):
    """At real width the chain's two draft decodes launch more kernels than a 4-layer target's verify
    (H200: 125 vs 119, catch-up 68): the verify is told by its MoE kernels, wherever the trace starts."""
    names = ["gemm", "fused_moe_kernel", "gemm"]
    for start in range(3):
        launches, eager = bench["graph_launches"](_events((125, 119, 68), 4, names, start))
        out = bench["step_phases"](launches, eager)
        assert out["kernels"] == {"draft_chain": 125, "verify": 119, "draft_catch_up": 68}, start
        assert out["verify_parts"]["moe"] > 0 and "moe" not in out["draft_chain_parts"]
    with pytest.raises(ValueError):  # two launches with MoE work in a step: no verify to tell
        bench["step_phases"](bench["graph_launches"](_events((125, 119, 68), 3, ["fused_moe", "fused_moe", "g"]))[0])


def test_overlapping_kernels_count_once(bench):
    """A verify's shared expert on a side stream overlaps its MoE kernels: the launch's busy time and
    parts count each instant once (to the kernel that started first), and a MoE kernel wholly under an
    earlier one still marks the launch as the verify."""
    ev, step = [], [[("gemm", 0, 10)], [("gemm", 20, 30), ("fused_moe_kernel", 25, 5)], [("g", 60, 5)]]
    for corr, kernels in enumerate(step):
        args = {"correlation": corr}
        ev.append({"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": kernels[0][1], "args": args})
        ev += [{"cat": "kernel", "name": n, "ts": ts, "dur": d, "args": args} for n, ts, d in kernels]
    ev.append({"cat": "kernel", "name": "sampling", "ts": 62, "dur": 8, "args": {}})  # eager, overlaps the last
    ev.append({"cat": "kernel", "name": "sampling", "ts": 64, "dur": 2, "args": {}})
    launches, eager = bench["graph_launches"](ev)
    assert [x["busy"] for x in launches] == [10, 30, 5] and launches[1]["span"] == 30
    assert launches[1]["parts"] == {"gemm": 30, "moe": 0}
    out = bench["step_phases"](launches, eager)
    assert out["kernels"]["verify"] == 2 and out["verify_busy"] == pytest.approx(0.03)
    assert out["eager_gpu"] == pytest.approx(0.008) and out["eager_kernels"] == 2


def test_projection(bench):
    costs = bench["layer_costs"]([(1, 3, 10.0), (1, 7, 18.0)], 0.5)
    assert costs["per_sparse"] == pytest.approx(2.0) and costs["per_dense"] == pytest.approx(1.0)
    assert bench["project"](costs, 3, 57) == pytest.approx(10.0 - 1 - 6 + 3 + 114)


def test_first_cut_projection(bench):
    """A cut of 1 dense + 3 sparse layers measured at 10 ms, 3 of them MoE time: each MoE layer costs its
    measured 1 ms, the other 7 ms scale with the non-expert bytes (fixed 50 + dense 20 + 10 per sparse layer
    = 100 units, experts apart). Without a trace, the experts' floor bytes scale too."""
    f0 = {"all": 130.0, "experts": 30.0}
    fd = {"all": 150.0, "experts": 30.0}  # one more dense layer: +20 non-expert units
    fs = {"all": 150.0, "experts": 40.0}  # one more sparse layer: +10 non-expert units, +10 expert units
    p = bench["first_cut_projection"](10.0, 3.0, f0, fd, fs, (1, 3), [(3, 57), (1, 7)])
    assert p["per_sparse_moe"] == pytest.approx(1.0) and p["per_sparse"] == pytest.approx(1.0 + 0.7)
    assert p["per_dense"] == pytest.approx(1.4) and p["fixed"] == pytest.approx(10.0 - 1.4 - 3 * 1.7)
    assert p["at"]["1+7"] == pytest.approx(10.0 + 4 * 1.7)
    assert p["at"]["3+57"] == pytest.approx(10.0 + 2 * 1.4 + 54 * 1.7)
    bytes_only = bench["first_cut_projection"](10.0, None, f0, fd, fs, (1, 3), [(1, 7)])
    assert bytes_only["at"]["1+7"] == pytest.approx(10.0 * (130.0 + 4 * 20.0) / 130.0)


def test_projections_with_random_routing(bench):
    """Batch 1: one decode row reads exactly top-k experts, so the random-routing decode projection is the
    measured one; the verify's 4 rows touch ~15 experts at random, more than a measured 2.5x of one row's."""
    import argparse
    import json

    released = M3Config.from_hf(json.loads(bench["scaled"].RELEASED.read_text()))
    draft = DraftConfig.from_dict(bench["real_width_draft_config"](bench["scaled"].cut_config(1, 3)))
    keys = ("cut", "dense", "sparse", "batch", "t_decode", "t_step", "t_verify", "moe_decode", "moe_verify")
    rows = [
        dict(zip(keys, ("1+3", 1, 3, 1, 1.8, 5.4, 2.3, 0.36, 0.9))),
        dict(zip(keys, ("1+7", 1, 7, 1, 2.8, 6.9, 4.0, 0.84, 1.8))),
    ]
    args = argparse.Namespace(input_len=8192, kv_cache_dtype="auto", num_steps=3, hbm_tbps=4.3, tp_size=1, ep_size=1)
    out = bench["projections"](rows, args, released, {"1+3": draft}, [3.0])["1"]
    dec, step = out["t_decode"], out["t_step"]
    assert dec["random_routing"]["released"] == pytest.approx(dec["from_first_cut"]["released"])
    assert dec["random_routing"]["per_expert"] == pytest.approx(0.36 / 12)
    per_layer = 0.36 / 12 * 128 * (1 - (1 - 4 / 128) ** 4)  # random routing: ~15.1 experts a layer
    grow = 57 * (per_layer - 0.9 / 3)  # 57 MoE layers, each dearer than measured
    assert step["random_routing"]["released"] == pytest.approx(step["from_first_cut"]["released"] + grow, rel=1e-6)
    assert out["speedup_projected_released_random_routing"]["3"] < out["speedup_projected_released"]["3"]
    assert dec["check"][0]["cut"] == "1+7" and abs(dec["check"][0]["error"]) < 0.1


def test_full_batch_steps_from_final_verify_count(bench):
    # Two requests streaming 2 tokens per step (AL 2); the counts arrive only with the final chunk,
    # and request 1's chunks coalesce (one chunk per two steps) in the middle.
    r0 = [(0.0, 1, None)] + [(0.1 * k, 1 + 2 * k, None) for k in range(1, 11)] + [(1.1, 23, 11)]
    r1 = [(0.05, 1, None)] + [(0.05 + 0.2 * k, 1 + 4 * k, None) for k in range(1, 5)] + [(1.0, 21, 10)]
    out = bench["full_batch_steps"]([r0, r1])
    # window 0.05..1.0: each request gains 21 - 1 = 20 tokens, at its own acceptance length
    assert out["steps_from"] == "spec_verify_ct"
    assert out["steps"] == pytest.approx((20 * 11 / 23 + 20 * 10 / 21) / 2)
    assert out["seconds_per_step"] == pytest.approx(0.95 / out["steps"])
    with pytest.raises(RuntimeError, match="raise --output-len"):
        bench["full_batch_steps"]([r0[:3], r1])
    late = [(1.2 + 0.1 * k, 1 + k, None) for k in range(6)]  # admitted after request 0 had finished
    with pytest.raises(RuntimeError, match="no full-batch window: a request's first chunk came after"):
        bench["full_batch_steps"]([r0, late])


def test_sampling_reaches_every_measured_request_and_bad_values_are_refused(bench, capsys):
    args = bench["parse_args"](["--temperature", "1", "--top-p", "0.9"])
    default = bench["parse_args"]([])
    assert (default.temperature, default.top_p) == (0.0, 1.0)
    sampling = bench["scaled"].stream_sampling(7, bench["sampling_shape"](args))
    assert sampling == {"max_new_tokens": 7, "temperature": 1.0, "top_p": 0.9, "ignore_eos": True}
    assert bench["scaled"].stream_sampling(7) == {"max_new_tokens": 7, "temperature": 0.0, "ignore_eos": True}
    with pytest.raises(SystemExit):
        bench["parse_args"](["--temperature", "-0.5"])
    assert "--temperature=-0.5: a sampling temperature is at least 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench["parse_args"](["--top-p", "0"])
    assert "--top-p=0.0: top-p lies in (0, 1]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench["parse_args"](["--repeats", "0"])
    assert "--repeats=0: at least one timed round" in capsys.readouterr().err


def test_uniform_routing_reaches_every_engine_and_needs_cuda_half_precision(bench, capsys, monkeypatch):
    monkeypatch.delenv("SGLANG_SIMULATE_UNIFORM_EXPERTS", raising=False)
    scaled = bench["scaled"]
    args = bench["parse_args"](["--routing", "uniform"])
    assert scaled.engine_env(args)["SGLANG_SIMULATE_UNIFORM_EXPERTS"] == "1"
    assert bench["conditions"](args) == {"temperature": 0.0, "top_p": 1.0, "routing": "uniform"}
    monkeypatch.setenv("SGLANG_PLUGINS", "x")
    plain = bench["parse_args"]([])
    assert "SGLANG_SIMULATE_UNIFORM_EXPERTS" not in scaled.engine_env(plain)
    assert scaled.engine_env(plain)["SGLANG_PLUGINS"] == "x"  # this process's environment passes through
    for bad, named in ((["--device", "cpu"], "--device=cpu"), (["--dtype", "float32"], "--dtype=float32")):
        with pytest.raises(SystemExit):
            bench["parse_args"](["--routing", "uniform", *bad])
        assert "--routing=uniform: SGLang simulates it in TopK" in (err := capsys.readouterr().err) and named in err
    with pytest.raises(SystemExit):
        scaled.parse_args(["--routing", "uniform", "--device", "cpu"])
    assert "--routing=uniform: SGLang simulates it in TopK" in capsys.readouterr().err  # bench_scaled's too
