"""PNG plots the benchmarks write beside their JSON line (matplotlib, Agg canvas: no display).

Every plot goes to `<plot dir>/<bench>_<what>.png` and its path is printed to stderr, so the
JSON line a bench prints last on stdout stays the only thing tools read there. Figures are made
with `matplotlib.figure.Figure` and an explicit Agg canvas, never pyplot: no global figure state,
no GUI backend probed on a headless machine.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

DEFAULT_DIR = Path(__file__).resolve().parent / "out"  # git-ignored
DPI = 100


@dataclass(frozen=True)
class Series:
    """One line: y over x, named in the legend."""

    label: str
    x: Sequence[float]
    y: Sequence[float]
    dashed: bool = False  # a computed reference rather than a measurement


@dataclass(frozen=True)
class Bars:
    """One panel of grouped bars: per legend label, one value per group (x tick)."""

    title: str
    groups: Sequence[str]
    values: Mapping[str, Sequence[float]]


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--plot-dir",
        type=Path,
        default=DEFAULT_DIR,
        help=f"where PNG plots go, as <bench>_<what>.png (default {DEFAULT_DIR})",
    )


def plot_path(plot_dir: Path, bench: str, what: str) -> Path:
    plot_dir.mkdir(parents=True, exist_ok=True)
    return plot_dir / f"{bench}_{what}.png"


def line_chart(
    path: Path,
    series: Sequence[Series],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    integer_x: bool = False,
) -> Path:
    """Lines with markers, one per series; returns `path` once written."""
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.subplots()
    for s in series:  # a reference that equals a measurement is drawn on top of it, thinner
        style = {"ls": "--", "lw": 1.2, "ms": 3, "zorder": 3} if s.dashed else {"lw": 2.5, "ms": 5}
        ax.plot(s.x, s.y, marker="o", label=s.label, **style)
    if integer_x:
        ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set(title=_wrap(title, 8), xlabel=xlabel, ylabel=ylabel)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def bar_chart(
    path: Path, panels: Sequence[Bars], *, title: str, ylabel: str, ymax: float | None = None
) -> Path:
    """Grouped bars, one panel per `Bars` side by side (shared y axis); returns `path`."""
    widths = [max(len(p.groups), 1) for p in panels]
    width = min(max(4 + 1.6 * sum(widths), 7), 24)
    fig = Figure(figsize=(width, 4.8), layout="constrained")
    axes = fig.subplots(1, len(panels), sharey=True, squeeze=False, width_ratios=widths)[0]
    labels = list(dict.fromkeys(label for p in panels for label in p.values))
    colors = {label: f"C{i % 10}" for i, label in enumerate(labels)}  # same label, same colour
    for ax, panel in zip(axes, panels, strict=True):
        _bars(ax, panel, colors)
    axes[0].set_ylabel(ylabel)
    if ymax is not None:
        axes[0].set_ylim(0, ymax)
    fig.suptitle(_wrap(title, width))
    handles = {}
    for ax in axes:
        handles |= dict(zip(*reversed(ax.get_legend_handles_labels()), strict=True))
    fig.legend(
        handles.values(), handles.keys(), loc="outside lower center", ncols=min(len(labels), 6)
    )
    return _save(fig, path)


def _bars(ax, panel: Bars, colors: Mapping[str, str]) -> None:
    n = max(len(panel.values), 1)
    width = 0.8 / n
    for i, (label, values) in enumerate(panel.values.items()):
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(panel.groups))]
        drawn = ax.bar(xs, values, width, label=label, color=colors[label])
        crowded = n * len(panel.groups) > 12  # labels side by side would overlap
        ax.bar_label(drawn, fmt=_short, fontsize=7, padding=1, rotation=90 if crowded else 0)
    ax.set_xticks(range(len(panel.groups)), panel.groups, fontsize=8)
    ax.set_title(panel.title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)


def _short(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _wrap(title: str, width_in: float) -> str:
    """Break a title into lines that fit the figure (about 11 characters an inch)."""
    return "\n".join(textwrap.wrap(title, int(width_in * 11)))


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)  # Agg, whatever backend matplotlib would pick
    fig.savefig(path, dpi=DPI)
    print(f"plot: {path}", file=sys.stderr, flush=True)
    return path
