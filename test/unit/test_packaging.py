"""The wheel holds every source package: built offline, installed alone into an empty folder, imported from there.

pyproject.toml lists its packages by hand (``kernel/`` maps to ``sglang_m3_kernels``), so a folder left off
the list used to ship a wheel without it (``sglang_m3.spec``: no EAGLE3). Here the wheel is built from a
copy of the tree (no ``build/`` left in the checkout), installed with ``--no-deps --target`` into an empty
folder, and a subprocess whose path starts there (cwd outside the repo) imports every folder that holds
``.py`` files; each must come from the installed copy, not from the editable checkout.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# source folder -> import name, as pyproject.toml's package-dir maps them
SOURCE_ROOTS = {REPO / "python" / "sglang_m3": "sglang_m3", REPO / "kernel": "sglang_m3_kernels"}
PACKAGE_DATA = {"sglang_m3": ["assets/tokenizer_corpus.txt", "assets/minimax-m3-config.json"]}


def _source_packages() -> dict[str, set[str]]:
    """Import name -> .py files (relative to the package root) of every source folder holding .py files."""
    found: dict[str, set[str]] = {}
    for root, name in SOURCE_ROOTS.items():
        for py in root.rglob("*.py"):
            rel = py.relative_to(root)
            if "__pycache__" in rel.parts:
                continue
            pkg = ".".join([name, *rel.parent.parts])
            found.setdefault(pkg, set()).add(rel.as_posix())
    return found


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for item in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / item, src / item)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc")
    for folder in ("python", "kernel"):
        shutil.copytree(REPO / folder, src / folder, ignore=ignore)
    wheels, target = tmp_path_factory.mktemp("wheels"), tmp_path_factory.mktemp("target")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    build = subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(wheels), str(src)],
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, f"pip wheel failed (needs setuptools>=68 and wheel, the test extra):\n{build.stderr}"
    (wheel,) = wheels.glob("sglang_m3-*.whl")
    inst = subprocess.run(
        [*pip, "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
    )
    assert inst.returncode == 0, inst.stderr
    return target


def test_every_source_module_is_in_the_wheel(installed):
    for pkg, files in _source_packages().items():
        top, *sub = pkg.split(".")
        root = installed.joinpath(top, *sub)
        shipped = {p.relative_to(installed / top).as_posix() for p in root.glob("*.py")} if root.is_dir() else set()
        assert files <= shipped, f"{pkg}: missing from the wheel: {sorted(files - shipped)} (pyproject packages?)"
    for pkg, data in PACKAGE_DATA.items():
        for rel in data:
            assert (installed / pkg / rel).is_file(), f"package data {pkg}/{rel} missing from the wheel"


def test_every_package_imports_from_the_wheel(installed, tmp_path):
    packages = sorted(_source_packages())
    probe = (
        "import importlib, json, sys\n"
        f"print(json.dumps({{n: importlib.import_module(n).__file__ for n in {packages!r}}}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(installed)
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    files = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(files) == set(packages)
    for name, file in files.items():
        assert file and Path(file).resolve().is_relative_to(installed.resolve()), f"{name} imported from {file}"


def test_entry_point_is_in_the_wheel(installed):
    (dist_info,) = installed.glob("sglang_m3-*.dist-info")
    text = (dist_info / "entry_points.txt").read_text()
    section = text.split("[sglang.srt.plugins]", 1)[1].split("[", 1)[0]
    assert "m3 = sglang_m3.plugin:register" in section
