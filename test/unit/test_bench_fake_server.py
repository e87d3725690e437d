"""The benchmarks end to end against a fake OpenAI-compatible server.

The fake server answers from labels the test controls, so the scores are
checked against known truth: gold labels must give exactly 100%, shuffled
labels exactly the (near-chance) agreement of the permutation, and injected
timeouts / 5xx / dropped connections must be retried or counted, never
silently dropped.  Datasets are small synthetic copies written to tmp_path,
plus real copies of the data sets where ``$SGLANG_M3_DATA`` names them.
"""

import csv
import json
import os
import pkgutil
import random
import socket
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fake_openai_server import FakeOpenAIServer
from sglang_m3.bench import acceptance, datasets, gsm8k, mmlu, serving
from sglang_m3.bench.extract import gsm8k_gold
from sglang_m3.bench.mmlu import format_question

REPO = Path(__file__).resolve().parents[2]
# Offline copies of the real data sets, where the environment names them (.ci/run does).
SHARED = Path(os.environ.get("SGLANG_M3_DATA", "/nonexistent"))

GSM8K_STYLES = [
    lambda g: f"Selling leaves fewer pens: 12 + 7 = 19 is a distractor.\n#### {g}",
    lambda g: f"<think>Maybe it is {int(g) + 1}? No.</think>The shop has \\boxed{{{int(g):,}}} pens left.",
    lambda g: f"We subtract the sold pens from the stock. The answer is ${int(g):,}.",
]
MMLU_STYLES = [
    lambda x: x,
    lambda x: f"The answer is ({x}).",
    lambda x: f"<think>A seems plausible, but</think>**{x}**",
    lambda x: f"Option A is a common mistake and D is irrelevant.\n\nAnswer: {x}",
]


def common(url: str, tmp_path: Path, *extra: str) -> list[str]:
    return ["--base-url", url, "--output", str(tmp_path / "out.json"), "--retry-delay", "0.01", *extra]


@pytest.fixture
def gsm8k_dir(tmp_path: Path) -> Path:
    rng = random.Random(1)
    root = tmp_path / "gsm8k"
    root.mkdir()
    for split, n in (("train", 12), ("test", 30)):
        with open(root / f"{split}.jsonl", "w") as f:
            for i in range(n):
                a, b = rng.randint(1000, 99999), rng.randint(1, 999)
                question = f"[{split} {i}] A shop has {a} pens and sells {b}. How many pens are left?"
                f.write(
                    json.dumps(
                        {"question": question, "answer": f"{a} - {b} = <<{a}-{b}={a - b}>>{a - b}\n#### {a - b}"}
                    )
                    + "\n"
                )
    return root


def gsm8k_labels(root: Path, shuffle: bool = False) -> dict[str, str]:
    rows = [json.loads(line) for line in (root / "test.jsonl").read_text().splitlines()]
    golds = [gsm8k_gold(r["answer"]) for r in rows]
    if shuffle:
        random.Random(7).shuffle(golds)
    return {r["question"]: g for r, g in zip(rows, golds)}


def gsm8k_answer_fn(labels: dict[str, str]):
    index = {q: i for i, q in enumerate(labels)}

    def answer(prompt: str) -> str:
        question = prompt.rsplit("Question: ", 1)[-1]
        return GSM8K_STYLES[index[question] % len(GSM8K_STYLES)](labels[question])

    return answer


@pytest.fixture
def mmlu_dir(tmp_path: Path) -> Path:
    rng = random.Random(2)
    root = tmp_path / "mmlu"
    for split, n in (("dev", 5), ("test", 20)):
        (root / split).mkdir(parents=True)
        for subject in ("alpha_studies", "beta_studies", "gamma_studies"):
            with open(root / split / f"{subject}_{split}.csv", "w", newline="") as f:
                writer = csv.writer(f)
                for i in range(n):
                    options = [f"option {rng.randint(0, 10**6)}" for _ in range(4)]
                    writer.writerow(
                        [f'{subject} {split} q{i}: which, of these, is "right"?', *options, rng.choice("ABCD")]
                    )
    return root


def mmlu_labels(root: Path, shuffle: bool = False) -> tuple[dict[str, str], list[str], list[str]]:
    """(prompt tail -> label, gold letters, label letters) over all test questions."""
    rows = [row for subject in datasets.load_mmlu(str(root), "test").values() for row in subject]
    golds = [r["answer"] for r in rows]
    labels = list(golds)
    if shuffle:
        random.Random(3).shuffle(labels)
    return {format_question(r, False): label for r, label in zip(rows, labels)}, golds, labels


def mmlu_answer_fn(labels: dict[str, str]):
    def answer(prompt: str) -> str:
        tail = next(t for t in labels if prompt.endswith(t))
        return MMLU_STYLES[len(tail) % len(MMLU_STYLES)](labels[tail])

    return answer


# ---------------------------------------------------------------- GSM8K


def test_gsm8k_gold_labels_score_100(gsm8k_dir, tmp_path):
    with FakeOpenAIServer(gsm8k_answer_fn(gsm8k_labels(gsm8k_dir))) as server:
        summary = gsm8k.main(common(server.url, tmp_path, "--data-path", str(gsm8k_dir), "--thinking", "off"))
    assert summary["accuracy"] == 1.0 and summary["num_total"] == 30 and summary["num_errors"] == 0
    assert summary["ci95_low"] < 1.0 == summary["ci95_high"]
    written = json.loads((tmp_path / "out.json").read_text())
    assert written["accuracy"] == 1.0 and len(written["records"]) == 30
    assert all(r["correct"] and r["pred"] == r["gold"] for r in written["records"])
    # Request shape: 5 train shots as user/assistant turns, thinking switch forwarded.
    path, body = server.requests[0]
    assert path == "/v1/chat/completions" and body["model"] == "fake-model"
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    assert [m["role"] for m in body["messages"]] == ["user", "assistant"] * 5 + ["user"]
    assert all("[train " in m["content"] for m in body["messages"][:-1:2])
    assert "<<" not in body["messages"][1]["content"]


def test_gsm8k_shuffled_labels_score_near_zero(gsm8k_dir, tmp_path):
    labels = gsm8k_labels(gsm8k_dir, shuffle=True)
    golds = gsm8k_labels(gsm8k_dir)
    expected = sum(labels[q] == golds[q] for q in golds) / len(golds)
    with FakeOpenAIServer(gsm8k_answer_fn(labels)) as server:
        summary = gsm8k.main(common(server.url, tmp_path, "--data-path", str(gsm8k_dir), "--num-shots", "0"))
    assert summary["accuracy"] == expected < 0.1
    body = server.requests[0][1]
    assert len(body["messages"]) == 1 and "chat_template_kwargs" not in body


def test_gsm8k_transient_failures_are_retried(gsm8k_dir, tmp_path):
    labels = gsm8k_labels(gsm8k_dir)
    index = {q: i for i, q in enumerate(labels)}
    kinds = {0: "500", 1: "timeout", 2: "close", 3: "429"}

    def fail(path, prompt, attempt):
        i = index[prompt.rsplit("Question: ", 1)[-1]]
        return kinds.get(i % 6) if attempt == 1 else None

    with FakeOpenAIServer(gsm8k_answer_fn(labels), fail_fn=fail, hang_s=1.0) as server:
        summary = gsm8k.main(common(server.url, tmp_path, "--data-path", str(gsm8k_dir), "--timeout", "0.5"))
    assert summary["accuracy"] == 1.0 and summary["num_errors"] == 0
    assert summary["num_retried"] == sum(1 for i in range(30) if i % 6 in kinds) == 20
    records = json.loads((tmp_path / "out.json").read_text())["records"]
    assert [r["attempts"] for r in records] == [2 if i % 6 in kinds else 1 for i in range(30)]


def test_gsm8k_permanent_failures_are_counted_not_dropped(gsm8k_dir, tmp_path):
    labels = gsm8k_labels(gsm8k_dir)
    broken = set(list(labels)[:4])
    bad_request = list(labels)[4]

    def fail(path, prompt, attempt):
        question = prompt.rsplit("Question: ", 1)[-1]
        return "503" if question in broken else "400" if question == bad_request else None

    with FakeOpenAIServer(gsm8k_answer_fn(labels), fail_fn=fail) as server:
        summary = gsm8k.main(common(server.url, tmp_path, "--data-path", str(gsm8k_dir), "--max-retries", "2"))
    assert summary["num_total"] == 30 and summary["num_errors"] == 5
    assert summary["accuracy"] == 25 / 30 and summary["num_correct"] == 25
    records = json.loads((tmp_path / "out.json").read_text())["records"]
    failed = [r for r in records if "error" in r]
    assert len(records) == 30 and len(failed) == 5 and not any(r["correct"] for r in failed)
    assert sorted(r["attempts"] for r in failed) == [1, 3, 3, 3, 3]  # 400 is not retried
    assert any("HTTP 503" in r["error"] for r in failed) and any("HTTP 400" in r["error"] for r in failed)
    assert max(server.attempts.values()) == 3


def test_all_requests_failing_is_an_error(gsm8k_dir, tmp_path):
    with FakeOpenAIServer(fail_fn=lambda *a: "500") as server, pytest.raises(SystemExit) as exc:
        gsm8k.main(common(server.url, tmp_path, "--data-path", str(gsm8k_dir), "--max-retries", "0"))
    assert "all 30 requests failed" in str(exc.value.code) and "HTTP 500" in str(exc.value.code)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "module, data", [(gsm8k, "gsm8k_dir"), (mmlu, "mmlu_dir"), (acceptance, "gsm8k_dir"), (serving, "gsm8k_dir")]
)
def test_connection_failure_is_a_clear_error(module, data, tmp_path, request):
    url = f"http://127.0.0.1:{free_port()}/v1"
    data_path = str(request.getfixturevalue(data))
    with pytest.raises(SystemExit) as exc:
        module.main(common(url, tmp_path, "--num-questions", "2", "--data-path", data_path))
    assert f"cannot connect to an OpenAI-compatible server at {url}" in str(exc.value.code)
    assert not (tmp_path / "out.json").exists()


def test_script_exits_nonzero_on_connection_failure(gsm8k_dir):
    url = f"http://127.0.0.1:{free_port()}/v1"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_gsm8k.py"), "--base-url", url, "--data-path", str(gsm8k_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode != 0 and "cannot connect" in proc.stderr


def test_script_runs_from_any_folder(gsm8k_dir, tmp_path):
    """scripts/bench_*.py run the installed package from any working directory (no sys.path edits)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with FakeOpenAIServer(gsm8k_answer_fn(gsm8k_labels(gsm8k_dir))) as server:
        argv = common(server.url, tmp_path, "--data-path", str(gsm8k_dir), "--num-questions", "5")
        proc = subprocess.run(
            [sys.executable, str(REPO / "scripts" / "bench_gsm8k.py"), *argv],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env=env,
            cwd=tmp_path,
        )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["accuracy"] == 1.0
    assert json.loads((tmp_path / "out.json").read_text())["num_total"] == 5


def test_scripts_edit_no_sys_path():
    for script in sorted((REPO / "scripts").glob("*.py")):
        assert "sys.path" not in script.read_text(), script


@pytest.mark.parametrize("module", [gsm8k, mmlu, acceptance, serving])
def test_help_documents_common_options(module, capsys):
    with pytest.raises(SystemExit) as exc:
        module.main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for option in ("--base-url", "--model", "--data-path", "--num-questions", "--parallel", "--output", "--timeout"):
        assert option in text
    assert "http://127.0.0.1:30000/v1" in text


BENCH_MODULES = sorted(f"sglang_m3.bench.{m.name}" for m in pkgutil.iter_modules([str(Path(datasets.__file__).parent)]))


def test_bench_package_imports_neither_sglang_nor_torch():
    assert {"sglang_m3.bench.serving", "sglang_m3.bench.vocab"} <= set(BENCH_MODULES)
    code = (
        f"import importlib, sys\nfor m in {BENCH_MODULES!r}: importlib.import_module(m)\n"
        "bad = {'sglang', 'torch', 'transformers'} & set(sys.modules)\nassert not bad, bad"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)


# Imports of the bench extra's packages fail, as where it is not installed.
_NO_EXTRA = (
    "import sys\n"
    "class Block:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name.split('.')[0] in ('aiohttp', 'tqdm', 'matplotlib'):\n"
    "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
    "sys.meta_path.insert(0, Block())\n"
)


def test_bench_modules_import_without_the_extra_and_say_how_to_install_it(tmp_path, gsm8k_dir):
    code = _NO_EXTRA + (
        f"import importlib\nfor m in {BENCH_MODULES!r}: importlib.import_module(m)\n"
        "from sglang_m3.bench import gsm8k, serving, plot\n"
        "from sglang_m3.bench.client import BenchError\n"
        "assert gsm8k.build_messages('q', [])[-1]['role'] == 'user'\n"
        "try:\n    plot.require()\nexcept BenchError as e:\n    print('PLOT', e)\n"
        f"gsm8k.main(['--data-path', {str(gsm8k_dir)!r}, '--output', ''])\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, timeout=60, capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr
    assert "PLOT the benchmarks need 'matplotlib'" in proc.stdout and "sglang-m3[bench]" in proc.stdout
    assert "error: the benchmarks need 'aiohttp'" in proc.stderr and "pip install 'sglang-m3[bench]'" in proc.stderr


def test_missing_dataset_names_both_options(tmp_path, monkeypatch):
    with pytest.raises(SystemExit) as exc:
        gsm8k.main(["--data-path", str(tmp_path / "nowhere")])
    assert "--data-path" in str(exc.value.code) and "openai/grade-school-math" in str(exc.value.code)
    # Without --data-path and without a local copy it downloads; a failed download says the same.
    monkeypatch.delenv(datasets.DATA_ENV, raising=False)
    monkeypatch.setenv("SGLANG_M3_BENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(datasets, "MMLU_URL", (tmp_path / "missing.tar").as_uri())
    with pytest.raises(SystemExit) as exc:
        mmlu.main([])
    assert "download failed" in str(exc.value.code) and "--data-path" in str(exc.value.code)


def test_download_from_canonical_layout(tmp_path, monkeypatch, gsm8k_dir, mmlu_dir):
    """The download path, fed from file:// URLs laid out like the canonical sources."""
    monkeypatch.delenv(datasets.DATA_ENV, raising=False)
    monkeypatch.setenv("SGLANG_M3_BENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(datasets, "GSM8K_URL", gsm8k_dir.as_uri() + "/{split}.jsonl")
    with tarfile.open(tmp_path / "data.tar", "w") as tar:
        tar.add(mmlu_dir / "dev", "data/dev")
        tar.add(mmlu_dir / "test", "data/test")
    monkeypatch.setattr(datasets, "MMLU_URL", (tmp_path / "data.tar").as_uri())
    assert len(datasets.load_gsm8k(None, "test")) == 30
    assert [p.name for p in (tmp_path / "cache" / "gsm8k").iterdir()] == ["test.jsonl"]
    test = datasets.load_mmlu(None, "test")
    assert sorted(test) == ["alpha_studies", "beta_studies", "gamma_studies"] and len(test["beta_studies"]) == 20
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["gsm8k", "mmlu"]  # no temporary leftovers


def test_gsm8k_data_path_takes_test_jsonl_or_its_folder(gsm8k_dir, tmp_path):
    """As SGLang's own GSM8K script: --data-path test.jsonl (train.jsonl beside it for the shots)."""
    with FakeOpenAIServer(gsm8k_answer_fn(gsm8k_labels(gsm8k_dir))) as server:
        for data_path in (gsm8k_dir, gsm8k_dir / "test.jsonl"):
            summary = gsm8k.main(common(server.url, tmp_path, "--data-path", str(data_path), "--num-questions", "6"))
            assert summary["accuracy"] == 1.0 and summary["num_total"] == 6
        shots = [m["content"] for m in server.requests[-1][1]["messages"][:-1] if m["role"] == "user"]
        assert len(shots) == 5 and all("[train " in s for s in shots)
        lone = tmp_path / "lone" / "gsm8k_test.jsonl"  # any file name: it is the test split
        lone.parent.mkdir()
        lone.write_text((gsm8k_dir / "test.jsonl").read_text())
        summary = gsm8k.main(common(server.url, tmp_path, "--data-path", str(lone), "--num-shots", "0"))
        assert summary["num_total"] == 30 and summary["accuracy"] == 1.0
        with pytest.raises(SystemExit) as exc:  # few-shot needs train.jsonl beside the file
            gsm8k.main(common(server.url, tmp_path, "--data-path", str(lone)))
    assert str(lone.parent / "train.jsonl") in str(exc.value.code) and "--num-shots 0" in str(exc.value.code)
    missing = ((tmp_path / "nowhere.jsonl", "neither a file nor a folder"), (tmp_path / "lone", "no test.jsonl"))
    for bad, says in missing:
        with pytest.raises(SystemExit) as exc:
            gsm8k.main(["--data-path", str(bad)])
        assert str(bad) in str(exc.value.code) and says in str(exc.value.code)


# ---------------------------------------------------------------- MMLU


def test_mmlu_gold_labels_score_100(mmlu_dir, tmp_path):
    labels, _, _ = mmlu_labels(mmlu_dir)
    with FakeOpenAIServer(mmlu_answer_fn(labels)) as server:
        summary = mmlu.main(common(server.url, tmp_path, "--data-path", str(mmlu_dir)))
    assert summary["accuracy"] == summary["macro_accuracy"] == 1.0
    assert summary["num_total"] == 60 and summary["num_subjects"] == 3
    assert set(summary["per_subject"]) == {"alpha_studies", "beta_studies", "gamma_studies"}
    # requests arrive in any order under concurrency: check every prompt, not the first to land
    prompts = [body["messages"][0]["content"] for path, body in server.requests if path.endswith("/chat/completions")]
    assert all(p.count("\nAnswer: ") == 5 and p.endswith("\nAnswer:") for p in prompts)
    assert sum("about alpha studies" in p for p in prompts) == 20


def test_mmlu_shuffled_labels_score_near_chance(mmlu_dir, tmp_path):
    labels, golds, shuffled = mmlu_labels(mmlu_dir, shuffle=True)
    with FakeOpenAIServer(mmlu_answer_fn(labels)) as server:
        summary = mmlu.main(common(server.url, tmp_path, "--data-path", str(mmlu_dir), "--num-questions", "15"))
    # --num-questions is per subject: the first 15 of each 20.
    kept = [i for i in range(60) if i % 20 < 15]
    expected = sum(golds[i] == shuffled[i] for i in kept)
    assert summary["num_total"] == 45 and summary["num_correct"] == expected
    assert 0.1 < summary["accuracy"] < 0.45
    per = summary["per_subject"]
    assert summary["macro_accuracy"] == pytest.approx(sum(s["accuracy"] for s in per.values()) / 3)


def test_mmlu_subject_subset_and_unknown_subject(mmlu_dir, tmp_path):
    labels, _, _ = mmlu_labels(mmlu_dir)
    with FakeOpenAIServer(mmlu_answer_fn(labels)) as server:
        summary = mmlu.main(common(server.url, tmp_path, "--data-path", str(mmlu_dir), "--subjects", "beta_studies"))
        assert list(summary["per_subject"]) == ["beta_studies"] and summary["num_total"] == 20
        with pytest.raises(SystemExit) as exc:
            mmlu.main(common(server.url, tmp_path, "--data-path", str(mmlu_dir), "--subjects", "astrology"))
    assert "unknown MMLU subject" in str(exc.value.code)


@pytest.mark.skipif(not (SHARED / "mmlu").is_dir(), reason="$SGLANG_M3_DATA/mmlu not present")
def test_mmlu_real_data_all_57_subjects(tmp_path):
    labels, _, _ = mmlu_labels(SHARED / "mmlu")
    with FakeOpenAIServer(mmlu_answer_fn(labels)) as server:
        summary = mmlu.main(common(server.url, tmp_path, "--num-questions", "1"))  # default data path
    assert summary["num_subjects"] == 57 and summary["num_total"] == 57 and summary["accuracy"] == 1.0


@pytest.mark.skipif(not (SHARED / "gsm8k").is_dir(), reason="$SGLANG_M3_DATA/gsm8k not present")
def test_gsm8k_real_data_default_path(tmp_path):
    with FakeOpenAIServer(gsm8k_answer_fn(gsm8k_labels(SHARED / "gsm8k"))) as server:
        summary = gsm8k.main(common(server.url, tmp_path, "--num-questions", "40"))
    assert summary["accuracy"] == 1.0 and summary["num_total"] == 40


# ---------------------------------------------------------------- acceptance


def test_acceptance_statistics_from_generate_meta_info(gsm8k_dir, tmp_path):
    labels = gsm8k_labels(gsm8k_dir)
    index = {q: i for i, q in enumerate(labels)}
    patterns = [[3, 3, 1, 0], [2, 2, 2], [0, 0, 3]]  # accepted drafts per verify step

    def steps(prompt):
        return patterns[index[prompt.rsplit("Question: ", 1)[-1]] % 3]

    with FakeOpenAIServer(gsm8k_answer_fn(labels), spec_steps_fn=steps, num_steps=3) as server:
        summary = acceptance.main(common(server.url, tmp_path, "--data-path", str(gsm8k_dir), "--thinking", "on"))
    # 10 requests of each pattern: tokens = sum(k + 1), steps = len(pattern).
    tokens = 10 * sum(sum(k + 1 for k in p) for p in patterns)
    verify = 10 * sum(len(p) for p in patterns)
    assert summary["mean_acceptance_length"] == pytest.approx(tokens / verify)
    assert summary["acceptance_rate"] == pytest.approx((tokens / verify - 1) / 3)
    assert summary["server_acceptance_rate"] == pytest.approx(10 * 16 / (verify * 3))
    assert summary["accepted_drafts_histogram"] == [30, 10, 30, 30]
    assert summary["per_position_acceptance"] == pytest.approx([70 / 100, 60 / 100, 30 / 100])
    per_req = summary["per_request_acceptance_length"]
    assert per_req["p50"] == pytest.approx(2.75) and per_req["mean"] == pytest.approx((2.75 + 3 + 2) / 3)
    assert summary["accuracy"] == 1.0 and summary["num_errors"] == 0
    assert summary["server_speculative_settings"]["speculative_num_steps"] == 3
    assert Path(summary["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Prompts go through the chat template (/v1/tokenize) with the thinking switch, then /generate.
    paths = [p for p, _ in server.requests]
    assert paths.count("/v1/tokenize") == paths.count("/generate") == 30
    tok_body = next(b for p, b in server.requests if p == "/v1/tokenize")
    assert tok_body["chat_template_kwargs"] == {"enable_thinking": True}


def test_acceptance_draft_tokens_override_and_missing_server_info(gsm8k_dir, tmp_path):
    with FakeOpenAIServer(spec_steps_fn=lambda p: [1, 1], server_info=False) as server:
        summary = acceptance.main(
            common(
                server.url, tmp_path, "--data-path", str(gsm8k_dir), "--num-questions", "4", "--num-draft-tokens", "4"
            )
        )
    assert summary["mean_acceptance_length"] == 2.0 and summary["acceptance_rate"] == 0.25
    assert summary["accuracy"] == 0.0  # the replies ("ok") hold no answers


def test_acceptance_custom_prompts_file(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    lines = [json.dumps({"messages": [{"role": "user", "content": f"p{i + 1}"}]}) for i in range(3)]
    prompts.write_text("\n".join(lines) + "\n")
    with FakeOpenAIServer(spec_steps_fn=lambda p: [int(p[1])] * 5) as server:
        summary = acceptance.main(common(server.url, tmp_path, "--prompts-file", str(prompts)))
    assert summary["num_requests"] == 3 and "accuracy" not in summary
    assert summary["mean_acceptance_length"] == pytest.approx((10 + 15 + 20) / 15)
    assert summary["accepted_drafts_histogram"] == [0, 5, 5, 5]
    prompts.write_text('{"prompt": "no messages"}\n')
    with pytest.raises(SystemExit) as exc:
        acceptance.main(common("http://127.0.0.1:1/v1", tmp_path, "--prompts-file", str(prompts)))
    assert "'messages' list" in str(exc.value.code)


@pytest.mark.parametrize("server_info", [True, False])
def test_acceptance_without_speculative_decoding_fails(gsm8k_dir, tmp_path, server_info):
    with FakeOpenAIServer(server_info=server_info) as server, pytest.raises(SystemExit) as exc:
        acceptance.main(common(server.url, tmp_path, "--data-path", str(gsm8k_dir), "--num-questions", "3"))
    expected = "without speculative decoding" if server_info else "no speculative statistics"
    assert expected in str(exc.value.code)


# ---------------------------------------------------------------- serving


SPECIAL = (500, 501, 502)


@pytest.fixture
def tokenizer_json(tmp_path: Path) -> Path:
    """A tokenizer.json of 503 ids; the last three are added (special) tokens."""
    vocab = {f"t{i}": i for i in range(500)}
    added = [{"id": i, "content": f"<|s{i}|>", "special": True} for i in SPECIAL]
    path = tmp_path / "tok" / "tokenizer.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"model": {"type": "BPE", "vocab": vocab}, "added_tokens": added}))
    return path


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_serving_sweep_measures_known_latencies(tmp_path, api, tokenizer_json):
    with FakeOpenAIServer(
        first_token_delay=0.05, token_delay=0.01, tokenizer_path=str(tokenizer_json.parent)
    ) as server:
        summary = serving.main(
            common(
                server.url,
                tmp_path,
                "--concurrency",
                "1,4",
                "--input-len",
                "32",
                "--output-len",
                "6",
                "--num-questions",
                "8",
                "--api",
                api,
            )
        )
    levels = {lv["concurrency"]: lv for lv in summary["levels"]}
    assert set(levels) == {1, 4} and summary["num_failed"] == 0
    assert summary["output_throughput"] == levels[4]["output_throughput"]
    for lv in levels.values():
        assert lv["num_requests"] == 8 and lv["total_output_tokens"] == 8 * 6  # ignore_eos honoured
        assert 50 <= lv["ttft_ms"]["p50"] < 150 and lv["ttft_ms"]["p99"] >= lv["ttft_ms"]["p50"]
        assert 9 <= lv["tpot_ms"]["p50"] < 30
        assert lv["mean_prompt_tokens"] == 32
    assert summary["mean_prompt_tokens"] == 32
    assert levels[4]["output_throughput"] > 1.5 * levels[1]["output_throughput"]
    written = json.loads((tmp_path / "out.json").read_text())
    assert len(written["records"]) == 16 and written["output_throughput"] == summary["output_throughput"]
    assert Path(summary["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    body = server.requests[-1][1]
    assert body["stream"] and body["ignore_eos"] and body["max_tokens"] == 6
    assert body["stream_options"] == {"include_usage": True}
    assert ("messages" in body) == (api == "chat")
    if api == "completions":  # token ids, drawn from the vocabulary less the special tokens
        assert summary["prompt_format"] == "token_ids" and summary["tokenizer"] == str(tokenizer_json)
        sent = [b["prompt"] for path, b in server.requests if path == "/v1/completions"]
        assert all(len(s) == 32 and all(isinstance(t, int) and 0 <= t < 500 for t in s) for s in sent[2:])
        assert len({tuple(s) for s in sent}) == len(sent)  # distinct: no prefix-cache hits
    else:
        assert summary["prompt_format"] == "text" and "tokenizer" not in summary


def test_serving_token_prompts_are_seeded_and_need_a_tokenizer(tmp_path, tokenizer_json):
    def sent(server):
        return [b["prompt"] for path, b in server.requests if path == "/v1/completions"]

    argv = ["--parallel", "2", "--num-questions", "4", "--input-len", "7", "--output-len", "2", "--plot", ""]
    runs = []
    for seed in ("0", "0", "1"):
        with FakeOpenAIServer() as server:  # no /model_info: --tokenizer names the file
            serving.main(common(server.url, tmp_path, *argv, "--seed", seed, "--tokenizer", str(tokenizer_json)))
        runs.append(sorted(sent(server)))
    assert runs[0] == runs[1] != runs[2]
    assert not set(SPECIAL) & {t for p in runs[0] for t in p}
    with FakeOpenAIServer() as server, pytest.raises(SystemExit) as exc:
        serving.main(common(server.url, tmp_path, *argv))
    assert "--tokenizer" in str(exc.value.code) and "--api chat" in str(exc.value.code)
    assert not sent(server)  # refused before any request was timed
    with FakeOpenAIServer() as server, pytest.raises(SystemExit) as exc:
        serving.main(common(server.url, tmp_path, *argv, "--tokenizer", str(tmp_path / "none")))
    assert f"--tokenizer {tmp_path / 'none'}: no tokenizer.json" in str(exc.value.code)


def test_serving_counts_failed_streams(tmp_path, gsm8k_dir):
    failing = set()

    def fail(path, prompt, attempt):  # the first three prompts, always
        if path == "/v1/tokenize":  # the questions, tokenized once for token-id windows
            return None
        if len(failing) < 3:
            failing.add(prompt)
        return "500" if prompt in failing else None

    with FakeOpenAIServer(fail_fn=fail) as server:
        summary = serving.main(
            common(
                server.url,
                tmp_path,
                "--parallel",
                "2",
                "--num-questions",
                "10",
                "--dataset",
                "gsm8k",
                "--data-path",
                str(gsm8k_dir),
                "--input-len",
                "40",
                "--output-len",
                "4",
                "--warmup",
                "0",
            )
        )
    assert summary["max_concurrency"] == 2 and summary["num_failed"] == 3
    level = summary["levels"][0]
    assert level["num_requests"] == 10 and level["total_output_tokens"] == 7 * 4
    assert level["mean_prompt_tokens"] == 40 and summary["tokenizer"] == "server /v1/tokenize"
    text = " ".join(json.loads(line)["question"] for line in (gsm8k_dir / "test.jsonl").read_text().splitlines())
    ids = list(text.encode())  # the fake tokenizer: UTF-8 bytes
    windows = [b["prompt"] for path, b in server.requests if path == "/v1/completions"]
    assert all(any(ids[i : i + 40] == w for i in range(len(ids) - 39)) for w in windows)
    records = json.loads((tmp_path / "out.json").read_text())["records"]
    assert sum("HTTP 500" in r.get("error", "") for r in records) == 3
