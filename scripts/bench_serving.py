#!/usr/bin/env python3
"""Serving TTFT / TPOT / throughput sweep of a running server; see `--help` and sglang_m3/bench/serving.py."""

from sglang_m3.bench.serving import main

if __name__ == "__main__":
    raise SystemExit(0 if main() else 1)
