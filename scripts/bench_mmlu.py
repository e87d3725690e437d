#!/usr/bin/env python3
"""MMLU accuracy of a running server; see `--help` and sglang_m3/bench/mmlu.py."""

from _bench import run

if __name__ == "__main__":
    run("mmlu")
