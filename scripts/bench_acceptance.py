#!/usr/bin/env python3
"""Speculative decoding acceptance statistics of a running server; see `--help` and sglang_m3/bench/acceptance.py."""

from _bench import run

if __name__ == "__main__":
    run("acceptance")
