"""Shared launcher of the bench_*.py scripts.

Works from an installed package (`pip install -e .`) or straight from a clone: the
clone's python/ folder is put on the path when the package is not importable.
"""

import importlib
import sys
from pathlib import Path


def run(name: str) -> None:
    try:
        module = importlib.import_module(f"sglang_m3.bench.{name}")
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
        module = importlib.import_module(f"sglang_m3.bench.{name}")
    raise SystemExit(0 if module.main() else 1)
