"""PNG figures for the acceptance and serving benchmarks.

matplotlib (of the ``bench`` extra) is imported inside the functions with the
Agg backend so that the benchmarks run on headless servers and the accuracy
scripts never pay for it; :func:`require` lets a benchmark that will plot fail
before its run, not after it.
"""

from __future__ import annotations

from pathlib import Path

from .client import missing_extra


def require() -> None:
    """BenchError now if matplotlib is missing (instead of after the benchmark ran)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise missing_extra("matplotlib") from exc


def _pyplot():
    require()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_acceptance(summary: dict, lengths: list[float], path: str) -> None:
    """Per-request acceptance lengths; accepted drafts per step and per position when known."""
    plt = _pyplot()
    hist = summary.get("accepted_drafts_histogram")
    fig, axes = plt.subplots(1, 3 if hist else 1, figsize=(15 if hist else 5, 4), squeeze=False)
    ax = axes[0][0]
    ax.hist(lengths, bins=min(30, max(5, len(lengths) // 4)), color="tab:blue")
    ax.axvline(
        summary["mean_acceptance_length"],
        color="tab:red",
        linestyle="--",
        label=f"overall {summary['mean_acceptance_length']:.2f}",
    )
    ax.set(title="Acceptance length per request", xlabel="tokens per verify step", ylabel="requests")
    ax.legend()
    if hist:
        ax = axes[0][1]
        total = sum(hist)
        ax.bar(range(len(hist)), [n / total for n in hist], color="tab:green")
        ax.set_xticks(range(len(hist)))
        ax.set(title="Accepted drafts per verify step", xlabel="accepted draft tokens", ylabel="fraction of steps")
        ax = axes[0][2]
        positions = summary["per_position_acceptance"]
        ax.bar(range(1, len(positions) + 1), positions, color="tab:orange")
        ax.set_xticks(range(1, len(positions) + 1))
        ax.set(title="Acceptance by draft position", xlabel="draft position", ylabel="fraction of steps", ylim=(0, 1))
    fig.suptitle(
        f"{summary.get('model', '')}: mean acceptance length {summary['mean_acceptance_length']:.2f}, "
        f"rate {summary['acceptance_rate']:.1%}"
    )
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_serving(levels: list[dict], title: str, path: str) -> None:
    """Throughput, TTFT and TPOT against concurrency, one line per (input, output) length."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    concurrencies = sorted({lv["concurrency"] for lv in levels})
    shapes = sorted({(lv["input_len"], lv["output_len"]) for lv in levels})
    for shape in shapes:
        mine = sorted(
            (lv for lv in levels if (lv["input_len"], lv["output_len"]) == shape), key=lambda lv: lv["concurrency"]
        )
        xs = [lv["concurrency"] for lv in mine]
        label = f"in {shape[0]} / out {shape[1]}"
        axes[0].plot(xs, [lv["output_throughput"] for lv in mine], marker="o", label=label)
        for ax, metric in ((axes[1], "ttft_ms"), (axes[2], "tpot_ms")):
            line = ax.plot(xs, [lv[metric]["p50"] for lv in mine], marker="o", label=f"{label} p50")[0]
            ax.plot(
                xs,
                [lv[metric]["p99"] for lv in mine],
                marker="x",
                linestyle="--",
                color=line.get_color(),
                label=f"{label} p99",
            )
    titles = ("Output throughput", "Time to first token", "Time per output token")
    ylabels = ("tokens/s", "ms", "ms")
    for ax, name, ylabel in zip(axes, titles, ylabels):
        ax.set(title=name, xlabel="concurrency", ylabel=ylabel)
        ax.set_xscale("log", base=2)
        ax.set_xticks(concurrencies, labels=[str(c) for c in concurrencies])
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
