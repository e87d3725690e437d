"""``scripts/bench_e2e.py``: each mode's engine arguments, the decode rate past the prefill, the ratios."""

from __future__ import annotations

import argparse
import pathlib
import runpy

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    return runpy.run_path(str(REPO / "scripts" / "bench_e2e.py"), run_name="bench_e2e")


@pytest.fixture
def args():
    return argparse.Namespace(
        model_path="m", draft_path="d", device="cuda", dtype="float32", max_total_tokens=4096, num_steps=3
    )


def test_modes_set_graphs_speculation_and_overlap(bench, args):
    plain, graphs = bench["engine_args"]("eager", args, [1, 8]), bench["engine_args"]("graphs", args, [1, 8])
    assert plain["disable_cuda_graph"] and not graphs["disable_cuda_graph"] and graphs["cuda_graph_max_bs_decode"] == 8
    assert "speculative_algorithm" not in graphs
    spec = bench["engine_args"]("eagle3_graphs", args, [1])
    assert spec["speculative_algorithm"] == "EAGLE3" and spec["speculative_draft_model_path"] == "d"
    assert (spec["speculative_num_steps"], spec["speculative_num_draft_tokens"], spec["speculative_eagle_topk"]) == (
        3,
        4,
        1,
    )
    assert not spec["disable_cuda_graph"] and "disable_overlap_schedule" not in spec  # SGLang's default: overlap on
    sync = bench["engine_args"]("eagle3_graphs_sync", args, [1])
    assert sync == {**spec, "disable_overlap_schedule": True}
    assert bench["engine_args"]("eagle3_eager", args, [1])["disable_cuda_graph"]


def test_an_unknown_mode_and_no_drafts_are_refused_by_name(bench, args):
    with pytest.raises(SystemExit, match="--modes: unknown mode 'eagle3'"):
        bench["engine_args"]("eagle3", args, [1])
    args.num_steps = 0
    assert bench["engine_args"]("graphs", args, [1])  # plain modes draft nothing
    with pytest.raises(SystemExit, match="--num-steps=0"):
        bench["engine_args"]("eagle3_graphs", args, [1])


def test_decode_rate_counts_the_tokens_after_the_first_over_the_time_past_prefill(bench):
    r = bench["rates"](tokens=64 * 8, batch=8, elapsed=0.110, prefill=0.010)
    assert r["output_tokens_per_s"] == pytest.approx(512 / 0.110)
    assert r["decode_tokens_per_s"] == pytest.approx(504 / 0.100)
    assert bench["rates"](tokens=8, batch=8, elapsed=0.01, prefill=0.02)["decode_tokens_per_s"] is None


def test_ratios_against_the_eager_and_graph_modes_at_the_same_batch(bench):
    def rec(mode, batch, out, dec):
        return dict(mode=mode, batch=batch, output_tokens_per_s=out, decode_tokens_per_s=dec)

    records = [
        rec("graphs", 1, 700.0, 800.0),
        rec("graphs", 8, 4000.0, 5000.0),
        rec("eagle3_graphs", 1, 1400.0, 2000.0),
    ]
    r = bench["ratios"](records[2], records)
    assert r["vs_graphs"] == pytest.approx(2.0) and r["decode_vs_graphs"] == pytest.approx(2.5)
    assert r["vs_eager"] is None and r["decode_vs_eager"] is None  # no eager mode ran
    assert bench["ratios"](rec("eagle3_graphs", 2, 1.0, 1.0), records)["vs_graphs"] is None  # no batch-2 base


def test_a_timed_round_is_the_median_of_its_repeats_each_from_a_flushed_cache(bench):
    ticks = iter([0.0, 1.0, 10.0, 13.0, 20.0, 22.0])  # rounds of 1 s, 3 s and 2 s
    calls = []
    seconds, result = bench["median_round"](
        lambda: calls.append("run") or len(calls), lambda: calls.append("flush"), 3, clock=lambda: next(ticks)
    )
    assert seconds == 2.0 and calls == ["flush", "run"] * 3 and result == 6  # the last round's result


def test_fewer_than_one_timed_round_is_refused_by_name(bench, capsys):
    with pytest.raises(SystemExit):
        bench["parse_args"](["--repeats", "0"])
    assert "--repeats=0" in capsys.readouterr().err
