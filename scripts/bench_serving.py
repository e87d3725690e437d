#!/usr/bin/env python3
"""Serving TTFT / TPOT / throughput sweep of a running server; see `--help` and sglang_m3/bench/serving.py."""

from _bench import run

if __name__ == "__main__":
    run("serving")
