"""Small statistics helpers, pure Python so the benchmarks need no numpy.

Accuracy is reported with a Wilson score interval rather than the normal
approximation because benchmark runs are often small (``--num-questions 50``)
and accuracies near 0 or 1, where the normal interval is too narrow and can
leave [0, 1].
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence


def wilson_interval(successes: int, total: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (95% by default)."""
    if total <= 0:
        return (0.0, 1.0)
    p = successes / total
    denom = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / denom
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def accuracy_summary(correct: int, total: int) -> dict:
    """Accuracy with its 95% Wilson interval, as stored in results JSON."""
    low, high = wilson_interval(correct, total)
    return {
        "accuracy": correct / total if total else 0.0,
        "ci95_low": low,
        "ci95_high": high,
        "num_correct": correct,
        "num_total": total,
    }


def percentile(values: Sequence[float], q: float) -> float | None:
    """q-th percentile (0-100) with linear interpolation, as numpy's default."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def describe(values: Sequence[float], percentiles: Sequence[int] = (50, 90, 99)) -> dict:
    """Mean and percentiles of a metric; None entries when there is no data."""
    out: dict = {"mean": sum(values) / len(values) if values else None}
    for q in percentiles:
        out[f"p{q}"] = percentile(values, q)
    return out


def timed_rounds(text: str) -> int:
    """``argparse`` type of the GPU scripts' ``--repeats``: at least one timed round."""
    rounds = int(text)
    if rounds < 1:
        raise argparse.ArgumentTypeError(f"--repeats={rounds}: at least one timed round")
    return rounds
