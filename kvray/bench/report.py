"""Benchmark results as a table, and saved as JSON with a plot of their ratios beside it."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from kvray import report
from kvray.bench import BenchResult


def print_table(results: list[BenchResult]) -> None:
    columns = ("benchmark", "kvray", "baseline", "unit", "ratio", "goal")
    mark = {True: "[green]met[/]", False: "[red]missed[/]", None: ""}
    rows = [
        (escape(r.name), f"{r.kvray:.4g}", f"{r.baseline:.4g}", r.unit, f"{r.ratio:.3f}", f"{r.goal or ''} {mark[r.meets_goal]}")
        for r in results
    ]
    report.print_table(Console(), "kvray benchmarks (medians; ratio = kvray / baseline)", columns, rows, text=("benchmark",))


def save(results: list[BenchResult], path: Path) -> Path:
    """Write ``results`` to ``path`` (JSON, ``BenchResult.as_dict`` each) and a bar chart of
    their ratios beside it (same name, ``.png``): one bar per row, its goal marked, green
    where met and red where missed. Returns the plot's path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([r.as_dict() for r in results], indent=2) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {True: "tab:green", False: "tab:red", None: "tab:gray"}
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(results) + 1.2))
    rows = range(len(results))
    ax.barh(rows, [r.ratio for r in results], color=[colours[r.meets_goal] for r in results])
    for row, r in zip(rows, results):
        if r.goal:
            op, target = r.goal.split()
            ax.plot([float(target)] * 2, [row - 0.4, row + 0.4], color="black")
            ax.annotate(f"{r.ratio:.2f} (goal {op} {target})", (r.ratio, row), xytext=(3, 0),
                        textcoords="offset points", va="center", fontsize=8)  # fmt: skip
    ax.set_yticks(list(rows), [f"{r.name} [{r.unit}]" for r in results], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("kvray / baseline (black: the goal; green met, red missed)")
    fig.tight_layout()
    plot = path.with_suffix(".png")
    fig.savefig(plot, dpi=110)
    plt.close(fig)
    return plot
