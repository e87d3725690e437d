"""GSM8K and MMLU loaders: local copy first, canonical public download second.

The benchmarks must run offline (CI, air-gapped GPU hosts) and on a fresh
machine alike.  So: an explicit ``--data-path`` is used as given (for GSM8K
the ``test.jsonl`` file, as SGLang's own script takes it, or its folder);
otherwise ``$SGLANG_M3_DATA/<name>`` (an offline copy of the data sets) is used when
that variable is set and the folder exists; otherwise the canonical public files are downloaded once into
``~/.cache/sglang_m3/bench/<name>`` (``$SGLANG_M3_BENCH_CACHE`` overrides).
Any miss raises BenchError naming both ways to fix it.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import tarfile
import tempfile
import urllib.request
from pathlib import Path

from .client import BenchError

GSM8K_URL = "https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data/{split}.jsonl"
MMLU_URL = "https://people.eecs.berkeley.edu/~hendrycks/data.tar"


def _cache_dir(name: str) -> Path:
    base = os.environ.get("SGLANG_M3_BENCH_CACHE") or Path.home() / ".cache" / "sglang_m3" / "bench"
    return Path(base) / name


def _missing(name: str, where: Path, detail: str, url: str) -> BenchError:
    return BenchError(
        f"{name} dataset not found at {where} ({detail}). Either pass --data-path pointing to a local "
        f"copy, or allow the download from {url} (it is fetched automatically when --data-path is not given)."
    )


def _download(url: str, dest: Path) -> None:
    """Fetch ``url`` to ``dest`` atomically: a failed download leaves no partial file."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".part")
    try:
        with urllib.request.urlopen(url, timeout=120) as resp, open(tmp, "wb") as f:
            shutil.copyfileobj(resp, f)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


DATA_ENV = "SGLANG_M3_DATA"  # a folder holding gsm8k/ and mmlu/ offline copies


def resolve_data_path(name: str, data_path: str | None) -> Path | None:
    """The directory to read ``name`` from, or None when it must be downloaded."""
    if data_path:
        return Path(data_path)
    root = os.environ.get(DATA_ENV)
    local = Path(root) / name if root else None
    return local if local is not None and local.is_dir() else None


def _gsm8k_file(data_path: str | None, split: str) -> Path:
    """The ``{split}.jsonl`` to read. ``--data-path`` is a folder holding it, or (as in SGLang's own GSM8K
    script) the ``test.jsonl`` file itself, whose folder then holds ``train.jsonl`` for few-shot examples."""
    url = GSM8K_URL.format(split=split)
    if data_path and Path(data_path).is_file():
        given = Path(data_path)
        path = given if split == "test" else given.with_name(f"{split}.jsonl")
        if not path.is_file():
            raise BenchError(
                f"GSM8K --data-path {given} is a file, taken as the test split; the {split} split is read from "
                f"{path}, which does not exist (few-shot examples come from it: add it, or pass --num-shots 0)"
            )
        return path
    root = resolve_data_path("gsm8k", data_path)
    if root is not None:
        path = root / f"{split}.jsonl"
        if not path.is_file():
            detail = f"no {split}.jsonl in folder {root}" if root.is_dir() else f"{root} is neither a file nor a folder"
            raise _missing("GSM8K", root, f"{detail}; --data-path takes test.jsonl or a folder holding it", url)
        return path
    path = _cache_dir("gsm8k") / f"{split}.jsonl"
    if not path.is_file():
        try:
            _download(url, path)
        except OSError as exc:
            raise _missing("GSM8K", path.parent, f"download failed: {exc}", url) from exc
    return path


def load_gsm8k(data_path: str | None, split: str) -> list[dict]:
    """Records ``{"question", "answer"}`` of a GSM8K split ("train" or "test")."""
    path = _gsm8k_file(data_path, split)
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    for i, row in enumerate(rows):
        if not {"question", "answer"} <= row.keys():
            raise BenchError(f"{path}:{i + 1}: expected keys 'question' and 'answer'")
    return rows


def _mmlu_root(data_path: str | None) -> Path:
    root = resolve_data_path("mmlu", data_path)
    if root is not None:
        if not (root / "dev").is_dir() or not (root / "test").is_dir():
            raise _missing("MMLU", root, "expected dev/ and test/ folders of <subject>_<split>.csv", MMLU_URL)
        return root
    cache = _cache_dir("mmlu")
    if not (cache / "test").is_dir():
        cache.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache.parent) as tmp:
            try:
                _download(MMLU_URL, Path(tmp) / "data.tar")
                with tarfile.open(Path(tmp) / "data.tar") as tar:
                    tar.extractall(tmp, filter="data")
            except (OSError, tarfile.TarError) as exc:
                raise _missing("MMLU", cache, f"download failed: {exc}", MMLU_URL) from exc
            shutil.rmtree(cache, ignore_errors=True)
            os.replace(Path(tmp) / "data", cache)  # the tarball holds data/{dev,val,test}/
    return cache


def _read_mmlu_csv(path: Path) -> list[dict]:
    rows = []
    with open(path, newline="", encoding="utf-8") as f:
        for i, fields in enumerate(csv.reader(f)):
            if len(fields) != 6 or fields[5].strip() not in ("A", "B", "C", "D"):
                raise BenchError(f"{path}: row {i + 1} is not 'question,A,B,C,D,answer-letter'")
            rows.append({"question": fields[0], "choices": fields[1:5], "answer": fields[5].strip()})
    return rows


def load_mmlu(data_path: str | None, split: str, subjects: list[str] | None = None) -> dict[str, list[dict]]:
    """``{subject: [{"question", "choices", "answer"}]}`` for a split ("dev", "test").

    Subjects are discovered from the file names ``<subject>_<split>.csv`` so a
    partial copy works; ``subjects`` restricts the set and must all exist.
    """
    folder = _mmlu_root(data_path) / split
    found = {p.name[: -len(f"_{split}.csv")]: p for p in sorted(folder.glob(f"*_{split}.csv"))}
    if not found:
        raise _missing("MMLU", folder, f"no *_{split}.csv files", MMLU_URL)
    wanted = subjects or list(found)
    unknown = [s for s in wanted if s not in found]
    if unknown:
        raise BenchError(f"unknown MMLU subject(s) {unknown}; available: {sorted(found)}")
    return {s: _read_mmlu_csv(found[s]) for s in wanted}
