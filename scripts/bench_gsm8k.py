#!/usr/bin/env python3
"""GSM8K accuracy of a running server; see `--help` and sglang_m3/bench/gsm8k.py."""

from _bench import run

if __name__ == "__main__":
    run("gsm8k")
