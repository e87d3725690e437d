#!/usr/bin/env python3
"""MMLU accuracy of a running server; see `--help` and sglang_m3/bench/mmlu.py.

Works from an installed package (`pip install -e .`) or straight from a
clone: the clone's python/ folder is put on the path when the package is not
importable.
"""

import sys
from pathlib import Path

try:
    from sglang_m3.bench.mmlu import main
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
    from sglang_m3.bench.mmlu import main

if __name__ == "__main__":
    raise SystemExit(0 if main() else 1)
