#!/usr/bin/env python3
"""MMLU accuracy of a running server; see `--help` and sglang_m3/bench/mmlu.py."""

from sglang_m3.bench.mmlu import main

if __name__ == "__main__":
    raise SystemExit(0 if main() else 1)
