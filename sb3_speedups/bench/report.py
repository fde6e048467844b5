"""Tables and plots of benchmark results."""

from __future__ import annotations

from pathlib import Path
from typing import Any

_SPARE_COLORS = ("tab:blue", "tab:purple", "tab:brown", "tab:pink", "tab:gray", "tab:olive", "tab:cyan")


def format_table(summary: dict[str, Any], target: bool = False) -> str:
    """
    :param summary: :func:`~sb3_speedups.bench.core.summarize` output
    :param target: time-to-target mode
    :return: a Markdown table, one row per variant
    """
    time_key, time_name = ("median_time_to_target", "median time to target (s)") if target else (
        "median_learn_seconds", "median learn() (s)")  # fmt: skip
    reference = summary.get("reference") or "ours"
    # named after the reference so that no row reads as its own speed-up
    header = (
        f"| variant | class | threads | {time_name} | {reference} is faster by | steps/s | final returns | peak PSS (MB) |"
    )
    if target:
        header += " success |"
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for variant, stats in summary["variants"].items():
        speedup = "-" if variant == reference else f"{summary['speedup'].get(variant, float('nan')):.2f}x"
        returns = ", ".join(f"{r:.0f}" for r in stats["final_returns"])
        name = stats["class"].rsplit(".", 1)[-1]
        row = (
            f"| {variant} | {name} | {stats['num_threads']} | {stats[time_key]:.2f} | {speedup} | "
            f"{stats['median_steps_per_second']:.0f} | {returns} | {stats['median_peak_memory_mb']:.0f} |"
        )
        if target:
            row += f" {stats['success_rate']:.0%} |"
        lines.append(row)
    return "\n".join(lines)


def plot_curves(records: list[dict[str, Any]], path: str | Path, title: str = "") -> Path | None:
    """
    Evaluation return against wall-clock seconds of ``learn()`` (evaluation time excluded), one line per run.

    :param records: worker results with their ``curve``
    :param path: PNG path
    :param title: plot title
    :return: the path, or ``None`` when matplotlib is not installed
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    colors: dict[str, str] = {"ours": "tab:green", "stock": "tab:red", "stock-1t": "tab:orange"}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    seen: set[str] = set()
    for record in records:
        if not record["curve"]:
            continue
        seconds, _, returns = zip(*record["curve"], strict=True)
        variant = record["variant"]
        label = None if variant in seen else variant
        if variant not in colors:  # e.g. ``ours@batched``: the next colour not taken yet
            colors[variant] = next(c for c in _SPARE_COLORS if c not in colors.values())
        ax.plot(seconds, returns, marker="o", color=colors[variant], alpha=0.8, label=label)
        seen.add(variant)
    ax.set_xlabel("wall-clock seconds in learn() (evaluation excluded)")
    ax.set_ylabel("mean evaluation return (deterministic)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if seen:  # without learning curves (--curve-points 0) there is nothing to label
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
