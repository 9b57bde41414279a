"""Markdown tables and matplotlib plots for the report; scenarios call these from ``render()``.

Plots are written only where a picture says more than the table: throughput bars per
system, latency percentiles, series over time, time against size.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any, Optional, Sequence

from bench.common import cell_text, fold_rows, repetitions

COLORS = {"local": "#4c4c4c", "fusestate-file": "#1f77b4", "fusestate-s3": "#17becf", "rclone": "#ff7f0e",
          "s3fs": "#d62728", "fusestate": "#1f77b4", "fusestate+shim": "#2ca02c", "local-s3": "#8c8c8c",
          "download first": "#ff7f0e", "s3a": "#9467bd", "fusestate@s3": "#17becf", "fusestate+shim@s3": "#17becf",
          "juicefs-pg": "#e377c2", "juicefs-pg-fast": "#f7b6d2", "fusestate-pg": "#aec7e8",
          "fusestate-native": "#393b79", "fusestate-passthrough": "#2ca02c"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def md_table(head: Sequence[str], body: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(str(h) for h in head) + " |", "|" + "---|" * len(head)]
    for row in body:
        lines.append("| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in row) + " |")
    return "\n".join(lines)


def medians_note(doc: dict[str, Any], baseline: str = "local disk", more: str = "") -> str:
    """The sentence every scenario's text ends with: what the numbers and brackets are."""
    return f"Median of {repetitions(doc)} repetition(s); ratio against {baseline} in brackets{more}."


def table_cell(row: dict[str, Any], system: str) -> str:
    """A median with its ratio, or "failed" (the error is listed once under the table)."""
    cell = row["systems"].get(system)
    return "failed" if cell is not None and cell["median"] is None else cell_text(row, system)


def ratio_table(rows: list[dict[str, Any]], systems: list[str], *, show_variant: bool = True) -> str:
    """Median per system, ratio against the baseline in brackets."""
    head = (["metric", "variant"] if show_variant else ["metric"]) + ["unit"] + systems
    body = []
    for r in rows:
        first = [r["label"], r["variant"]] if show_variant else [r["label"]]
        body.append(first + [r["unit"]] + [table_cell(r, s) for s in systems])
    return md_table(head, body)


def variant_table(rows: list[dict[str, Any]], systems: list[str], metrics: Sequence[str], variant_head: str) -> str:
    """One row per variant (a state size), one column per metric; each cell is every system's median
    in turn, "a / b (ratio)": a long metric-by-variant table folded into a few lines."""
    return md_table(*fold_rows(rows, systems, list(metrics), variant_head, table_cell))


def thousands(ax: Any) -> None:
    """Plain numbers with separators on a linear y axis (800,000, not 800000 or 8e5)."""
    from matplotlib.ticker import FuncFormatter

    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}" if abs(v) >= 10 else f"{v:g}"))


def save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


def grouped_bars(path: Path, groups: list[str], series: dict[str, list[Optional[float]]], *, ylabel: str,
                 title: str, log: bool = False, errors: Optional[dict[str, list[bool]]] = None) -> Path:
    """One group of bars per metric, one bar per system; a failed cell is marked with an x."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(groups) + 2), 4.0))
    n = max(1, len(series))
    width = 0.8 / n
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(groups))]
        ys = [v if v is not None else 0 for v in values]
        ax.bar(xs, ys, width, label=name, color=COLORS.get(name))
        for x, v, failed in zip(xs, values, (errors or {}).get(name, [False] * len(values))):
            if v is None and failed:  # at the foot of the axis, which is not 0 on a log scale
                ax.text(x, 0.01, "x", ha="center", va="bottom", color=COLORS.get(name, "black"), fontsize=9,
                        transform=ax.get_xaxis_transform())
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([textwrap.fill(g, 16) for g in groups])  # long labels wrap instead of overlapping
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if log:
        ax.set_yscale("log")
    else:
        thousands(ax)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside the bars, never over them
    ax.grid(axis="y", alpha=0.3)
    return save(fig, path)


def bars_from_rows(path: Path, rows: list[dict[str, Any]], systems: list[str], *, ylabel: str, title: str,
                   log: bool = False) -> Path:
    groups = [r["label"] for r in rows]
    series = {s: [r["systems"].get(s, {}).get("median") for r in rows] for s in systems}
    errors = {s: ["error" in r["systems"].get(s, {}) for r in rows] for s in systems}
    return grouped_bars(path, groups, series, ylabel=ylabel, title=title, log=log, errors=errors)


def percentile_lines(path: Path, series: dict[str, dict[str, float]], *, ylabel: str, title: str) -> Path:
    """Latency percentiles (P50 ... P99.99) per system, log scale: the shape of the distribution."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4.0))
    for name, pct in series.items():
        keys = sorted(pct, key=lambda k: float(k))
        ax.plot([f"P{k}" for k in keys], [pct[k] for k in keys], marker="o", label=name, color=COLORS.get(name))
    ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save(fig, path)


def time_series(path: Path, panels: list[dict[str, Any]], *, title: str) -> Path:
    """Stacked panels sharing the time axis; each panel: {"ylabel", "lines": {name: (xs, ys)}}."""
    plt = _plt()
    fig, axes = plt.subplots(len(panels), 1, figsize=(7.5, 2.6 * len(panels)), sharex=True, squeeze=False)
    for ax, panel in zip(axes[:, 0], panels):
        for name, (xs, ys) in panel["lines"].items():
            ax.plot(xs, ys, label=name, color=COLORS.get(name), linewidth=1.2)
        ax.set_ylabel(panel["ylabel"])
        if panel.get("logy"):
            ax.set_yscale("log")
        if panel.get("ylim"):
            ax.set_ylim(*panel["ylim"])
        for x, text in panel.get("marks", []):
            ax.axvline(x, color="grey", linestyle=":", linewidth=1)
            ax.text(x, ax.get_ylim()[1], f" {text}", va="top", fontsize=8, color="grey")
        for x, text in panel.get("notes", []):
            ax.annotate(text, (x, 0.02), xycoords=("data", "axes fraction"), fontsize=8, color="grey")
        ax.grid(alpha=0.3)
        if len(panel["lines"]) > 1:
            ax.legend(fontsize=8)
    axes[-1, 0].set_xlabel("seconds")
    axes[0, 0].set_title(title)
    return save(fig, path)


def xy_lines(path: Path, series: dict[str, tuple[list[float], list[float]]], *, xlabel: str, ylabel: str,
             title: str, logy: bool = False) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4.0))
    for name, (xs, ys) in series.items():
        # "<system> <part>" (such as "local load") is drawn dashed in its system's colour.
        system = name if name in COLORS else name.rsplit(" ", 1)[0]
        ax.plot(xs, ys, marker="o", label=name, color=COLORS.get(system),
                linestyle="-" if system == name else "--")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if logy:
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save(fig, path)


def points_plot(path: Path, points: dict[str, list[tuple[float, float]]], img_rel: str, alt: str, *,
                xlabel: str, ylabel: str, title: str) -> Optional[str]:
    """Lines through (x, y) points per series, as a markdown image; None when no series has a point."""
    series = {name: ([x for x, _ in pts], [y for _, y in pts]) for name, pts in points.items() if pts}
    if not series:
        return None
    img = xy_lines(path, series, xlabel=xlabel, ylabel=ylabel, title=title)
    return f"![{alt}]({img_rel}/{img.name})"


def ratio_between(row: dict[str, Any], num: str, den: str) -> Optional[float]:
    """One system's median over another's in a summary row (None if either has none)."""
    a = row["systems"].get(num, {}).get("median")
    b = row["systems"].get(den, {}).get("median")
    return a / b if a is not None and b else None


def goal_row(goal: str, measured: str, met: Optional[bool]) -> dict[str, Any]:
    return {"goal": goal, "measured": measured, "met": met}
