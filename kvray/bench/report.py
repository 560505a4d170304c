"""Printing benchmark results as a table (the JSON form is ``BenchResult.as_dict``)."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvray.bench import BenchResult


def print_table(results: list[BenchResult]) -> None:
    table = Table(title="kvray benchmarks (medians; ratio = kvray / baseline)")
    table.add_column("benchmark", no_wrap=True)
    for col in ("kvray", "baseline", "unit", "ratio", "goal"):
        table.add_column(col, justify="right")
    for r in results:
        mark = {True: "[green]met[/]", False: "[red]missed[/]", None: ""}[r.meets_goal]
        table.add_row(escape(r.name), f"{r.kvray:.4g}", f"{r.baseline:.4g}", r.unit, f"{r.ratio:.3f}", f"{r.goal or ''} {mark}")
    Console(width=140).print(table)
