#!/usr/bin/env python3
"""GSM8K accuracy of a running server; see `--help` and sglang_m3/bench/gsm8k.py."""

from sglang_m3.bench.gsm8k import main

if __name__ == "__main__":
    raise SystemExit(0 if main() else 1)
