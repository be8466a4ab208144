"""The report's figures (matplotlib, Agg backend: no display needed). Plain data in, one PNG out.

Kept apart from tools.report so the tables can be built and tested without drawing anything.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot: a report is written on login nodes and in CI, without a display
import matplotlib.pyplot as plt

Curve = tuple[Sequence[int], Sequence[float]]
"""(steps, values) of one run."""
Point = tuple[float, float, float]
"""(x, mean, std) of one sweep point."""


def mean_curve(curves: Sequence[Curve]) -> tuple[list[int], list[float], list[float], list[float]]:
    """Mean, min and max over runs at the steps every run has (runs of one config evaluate at the same steps)."""
    if not curves:
        return [], [], [], []
    common = sorted(set.intersection(*(set(s) for s, _ in curves)))
    tables = [dict(zip(s, v)) for s, v in curves]
    rows = [[t[step] for t in tables] for step in common]
    return common, [sum(r) / len(r) for r in rows], [min(r) for r in rows], [max(r) for r in rows]


def _grid(n: int) -> tuple[plt.Figure, list[plt.Axes]]:
    cols = min(n, 3)
    fig, axes = plt.subplots(math.ceil(n / cols), cols, figsize=(4.6 * cols, 3.4 * math.ceil(n / cols)), squeeze=False)
    flat = list(axes.flat)
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def curves_panels(panels: Mapping[str, Mapping[str, Sequence[Curve]]], path: Path, title: str, ylabel: str,
                  zero_line: bool = False) -> Path:
    """One panel per row label; per column, the mean over seeds with the min-max band."""
    fig, axes = _grid(len(panels))
    for ax, (row, columns) in zip(axes, panels.items()):
        for column, curves in columns.items():
            steps, mean, lo, hi = mean_curve(curves)
            if not steps:
                continue
            (line,) = ax.plot(steps, mean, label=f"{column} (n={len(curves)})")
            if len(curves) > 1:
                ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
        if zero_line:
            ax.axhline(0.0, color="black", linewidth=0.8)
        ax.set_title(row)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    return _save(fig, path)


def gap_vs_x(series: Mapping[str, Sequence[Point]], references: Mapping[str, tuple[float, float]], path: Path,
             title: str, xlabel: str, ylabel: str, log_x: bool = False, zero_line: bool = True) -> Path:
    """Each series: gap (mean ± std over seeds) against x; each reference: a dashed horizontal level.
    zero_line=False for a series that is not a difference (a loss against the learning rate)."""
    fig, ax = plt.subplots(figsize=(5.6, 3.8))
    for label, points in series.items():
        points = sorted(p for p in points if math.isfinite(p[1]))
        if points:
            xs, ys, es = zip(*points)
            ax.errorbar(xs, ys, yerr=[e if math.isfinite(e) else 0.0 for e in es], marker="o", capsize=3, label=label)
    for label, (level, _) in references.items():
        if math.isfinite(level):
            ax.axhline(level, linestyle="--", linewidth=1, color="gray")
            ax.annotate(label, (0.01, level), xycoords=("axes fraction", "data"), fontsize=8, color="gray",
                        va="bottom")
    if zero_line:
        ax.axhline(0.0, color="black", linewidth=0.8)
    if log_x:
        ax.set_xscale("log")
    ax.set_title(textwrap.fill(title, 60), fontsize=9)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    return _save(fig, path)


def _save(fig: plt.Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)  # a report draws a dozen figures; pyplot keeps every open one alive otherwise
    return path
