"""Ranges of the command line's numeric flags, checked as click parses them.

A value out of range ends the command before it does anything (exit 2) with click's
``Invalid value for '--FLAG':`` and the range and the value, e.g. ``--limit must be >= 1``
reads ``Invalid value for '--limit': must be >= 1, got -3``. Each flag is checked here once,
so no error from deeper down (a trace sliced to ``N-3`` requests, a model's field name)
stands in for the flag the user typed.

Example::

    import typer
    from kvray.flags import COUNT

    limit: int | None = typer.Option(None, "--limit", callback=COUNT)
    COUNT(3), COUNT(None)   # 3, None; COUNT(-3) raises typer.BadParameter("must be >= 1, got -3")
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import typer

Value = TypeVar("Value")


def in_range(
    low: float, high: float | None = None, *, low_open: bool = False, high_open: bool = False
) -> Callable[[Value], Value]:
    """A typer callback refusing a flag's value (each value of a repeated flag) outside
    ``low`` .. ``high`` (each included unless ``low_open`` / ``high_open``); None, a flag not
    given, passes."""
    if high is None:
        words = f"{'>' if low_open else '>='} {low:g}"
    else:
        words = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"

    def check(value: Value) -> Value:
        for v in value if isinstance(value, list) else [value]:
            if v is None:
                continue
            above = v > low if low_open else v >= low
            below = high is None or (v < high if high_open else v <= high)
            if not (above and below):
                raise typer.BadParameter(f"must be {words}, got {v:g}")
        return value

    return check


def one_of(*choices: str) -> Callable[[str], str]:
    """A typer callback refusing a flag's value outside ``choices`` (click's ``Choice``, which
    this typer's ``Option`` does not take)."""

    def check(value: str) -> str:
        if value not in choices:
            raise typer.BadParameter(f"expected one of {', '.join(choices)}, got {value!r}")
        return value

    return check


COUNT = in_range(1)  # requests, nodes, sessions, repeats, jobs: one or more
NON_NEGATIVE = in_range(0)  # a count where 0 means none, a seed, a cost
POSITIVE = in_range(0, low_open=True)  # a scale or a rate
CAPACITY_FRACTION = in_range(0, 100, low_open=True)  # device + host as a share of the trace's unique pages
TIME_FRACTION = in_range(0, 1, low_open=True)  # the share of a trace's time span trained on
LOAD = in_range(0, 1, low_open=True, high_open=True)  # --load: a busy share; 1 is saturation, which no scaling reaches
LOAD_HELP = "scale the trace's arrival gaps so that under LRU the prefill engines are busy this share of the time (0 < U < 1)"
