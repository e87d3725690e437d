"""Each benchmark script, end to end, against the tiny model served by our plugin (small subsets)."""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys

import pytest
from sglang_m3.bench import acceptance, gsm8k, mmlu, serving

pytestmark = pytest.mark.slow


def test_gsm8k(server_url, tmp_path):
    out = tmp_path / "gsm8k.json"
    summary = gsm8k.main(
        [
            "--base-url",
            server_url,
            "--num-questions",
            "4",
            "--parallel",
            "4",
            "--max-tokens",
            "16",
            "--num-shots",
            "2",
            "--output",
            str(out),
        ]
    )
    assert summary["num_total"] == 4 and summary["num_errors"] == 0
    assert 0.0 <= summary["accuracy"] <= 1.0 and out.exists()


def test_mmlu(server_url, tmp_path):
    summary = mmlu.main(
        [
            "--base-url",
            server_url,
            "--num-questions",
            "1",
            "--parallel",
            "8",
            "--max-tokens",
            "4",
            "--output",
            str(tmp_path / "mmlu.json"),
        ]
    )
    assert summary["num_errors"] == 0 and len(summary["per_subject"]) == 57


def test_serving(server_url, tmp_path):
    summary = serving.main(
        [
            "--base-url",
            server_url,
            "--concurrency",
            "1,2",
            "--num-questions",
            "2",
            "--input-len",
            "32",
            "--output-len",
            "8",
            "--output",
            str(tmp_path / "serving.json"),
        ]
    )
    assert summary["output_throughput"] > 0
    assert (tmp_path / "serving.png").exists()
    # Token-id prompts (tokenizer from the server's /model_info): the server saw exactly --input-len tokens.
    assert summary["prompt_format"] == "token_ids" and summary["mean_prompt_tokens"] == 32


def test_acceptance_refuses_a_non_speculative_server(server_url, tmp_path):
    with pytest.raises(SystemExit) as err:
        acceptance.main(["--base-url", server_url, "--num-questions", "2", "--output", str(tmp_path / "a.json")])
    assert err.value.code not in (0, None)


def test_acceptance_against_our_eagle3_server(spec_server_url, tmp_path):
    out = tmp_path / "acceptance.json"
    summary = acceptance.main(
        ["--base-url", spec_server_url, "--num-questions", "4", "--parallel", "2", "--max-tokens", "48"]
        + ["--output", str(out)]
    )
    assert summary["num_errors"] == 0 and summary["num_without_stats"] == 0
    assert summary["num_draft_tokens"] == 3  # read from the server's speculative_num_steps
    hist = summary["accepted_drafts_histogram"]
    assert len(hist) == 4 and sum(hist) == summary["total_verify_steps"]
    # The first GSM8K test questions are among the prompts the tiny draft memorised.
    assert summary["mean_acceptance_length"] > 3.0 and hist[3] > 0
    assert summary["per_position_acceptance"] == sorted(summary["per_position_acceptance"], reverse=True)
    assert out.exists() and (tmp_path / "acceptance.png").exists()


def _run_script(name: str, argv: list[str], out: pathlib.Path, env: dict | None = None) -> dict:
    script = pathlib.Path(__file__).resolve().parents[2] / "scripts" / name
    cmd = [sys.executable, str(script), *argv, "--out", str(out)]
    subprocess.run(cmd, check=True, timeout=600, cwd=out.parent, env=env and {**os.environ, **env})
    return json.loads(out.read_text())


def test_bench_scaled_on_the_tiny_model(tiny_vl, tmp_path):
    """scripts/bench_scaled.py end to end on CPU (the H200 runs it on the cut release) at ``--tp-size 2``
    (two ranks on gloo, each bound to a core): the streamed full-batch TPOT, its floor, a decode-step trace
    started while the batch decodes, and both ranks' start-up lines."""
    argv = ["--model-path", str(tiny_vl), "--impls", "ours", "--device", "cpu", "--dtype", "float32"]
    argv += ["--batches", "2", "--long-batches", "", "--input-len", "96", "--prefill-lens", "96"]
    argv += ["--output-len", "12", "--profile-batches", "2", "--tp-size", "2", "--keep-traces", "--repeats", "2"]
    result = _run_script("bench_scaled.py", argv, tmp_path / "scaled.json", {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"})
    assert (tmp_path / "scaled.ours-b2.trace.json.gz").stat().st_size > 0  # the raw trace, kept
    per_rank = [line for line in result["startup_lines"]["ours"] if "sglang-m3 per rank of TP 2" in line]
    assert len(per_rank) == 2 and result["tp_size"] == 2 and result["routing"] == "model"
    records = {r["kind"]: r for r in result["records"]}
    assert set(records) == {"startup", "tpot", "prefill", "profile"}
    assert records["tpot"]["ms"] > 0 and records["tpot"]["floor_ms"] > 0 and records["prefill"]["ms"] > 0
    for row in records["tpot"], records["prefill"]:  # the median of --repeats rounds, each kept
        assert len(row["ms_repeats"]) == 2 and row["ms"] == statistics.median_low(row["ms_repeats"])
    assert "ms_per_step" in records["profile"]  # on CPU the trace holds no GPU kernels to split


def test_bench_e2e_on_the_tiny_pair(tiny_vl, tiny_draft, tmp_path):
    """scripts/bench_e2e.py end to end on CPU (the GPU runs its graph modes): plain and EAGLE3 engines on
    the probe prompts, whose continuations the tiny draft memorised, so nearly every draft is accepted."""
    argv = ["--model-path", str(tiny_vl), "--draft-path", str(tiny_draft), "--device", "cpu", "--dtype", "float32"]
    argv += ["--modes", "eager,eagle3_eager", "--batches", "1", "--prompts", "probe", "--output-len", "16"]
    result = _run_script("bench_e2e.py", argv, tmp_path / "e2e.json")
    plain, spec = result["records"]
    assert result["repeats"] == 3  # each timed round's median of three
    assert (plain["mode"], spec["mode"]) == ("eager", "eagle3_eager")
    assert plain["output_tokens"] == spec["output_tokens"] == 16 and plain["mean_acceptance_length"] is None
    # of 4 (3 drafts + the bonus token a step): 15 tokens after the prefill's in 4 steps, or 5 if one
    # step ran short; the draft accepts ~nothing on other prompts (AL ~1)
    assert spec["mean_acceptance_length"] >= 3.0
    for r in (plain, spec):  # no timing comparison: a busy CI core can stretch either round
        assert r["prefill_s"] > 0 and r["elapsed_s"] > 0 and "decode_tokens_per_s" in r
    assert spec["vs_eager"] == spec["output_tokens_per_s"] / plain["output_tokens_per_s"]


def test_bench_spec_on_the_tiny_pair(tiny_vl, tiny_draft, tmp_path):
    """scripts/bench_spec.py end to end on CPU (the H200 runs it on the cut release with a real-width
    draft): a plain decode engine and an EAGLE3 engine, t_decode and t_step from streamed steps."""
    argv = ["--model-path", str(tiny_vl), "--draft-path", str(tiny_draft), "--device", "cpu", "--dtype", "float32"]
    argv += ["--batches", "2", "--input-len", "96", "--output-len", "24", "--repeats", "2"]
    result = _run_script("bench_spec.py", argv, tmp_path / "spec.json")
    assert result["errors"] == [] and result["spec"]["num_steps"] == 3 and result["repeats"] == 2
    assert (result["temperature"], result["top_p"], result["routing"]) == (0.0, 1.0, "model")  # the defaults
    for raw in (r for r in result["raw"] if r["kind"] == "time"):  # each engine's row: the lower median of 2
        assert len(raw["ms_repeats"]) == 2 and raw["ms"] == min(raw["ms_repeats"])
    (row,) = result["records"]
    assert row["batch"] == 2 and row["t_decode"] > 0 and row["t_step"] > 0
    # Random prompts: the tiny draft accepts little, but every step commits at least its bonus token.
    assert 1.0 <= row["accept_length_measured"] <= 4.0
    assert row["t_verify"] is None  # phases come from a GPU trace only
    # --resume: batch 2 of both engines is kept from the first run, only batch 1 runs.
    argv[argv.index("--batches") + 1] = "1,2"
    again = _run_script("bench_spec.py", [*argv, "--resume", str(tmp_path / "spec.json")], tmp_path / "spec2.json")
    assert [r["batch"] for r in again["records"]] == [1, 2] and again["records"][1] == row
    assert again["resumed_from"]["command"] == result["command"]
    # Rows sampled at another temperature do not join a greedy file: refused before any engine starts.
    script = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "bench_spec.py"
    cmd = [sys.executable, str(script), *argv, "--temperature", "1", "--resume", str(tmp_path / "spec.json")]
    refused = subprocess.run([*cmd, "--out", str(tmp_path / "spec3.json")], capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "--temperature=1.0 --top-p=1.0 --routing=model: " in refused.stderr
    assert "measured with {'temperature': 0.0, 'top_p': 1.0, 'routing': 'model'}" in refused.stderr
