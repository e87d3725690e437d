#!/usr/bin/env python3
"""Speculative decoding acceptance statistics of a running server; see `--help` and sglang_m3/bench/acceptance.py."""

from sglang_m3.bench.acceptance import main

if __name__ == "__main__":
    raise SystemExit(0 if main() else 1)
