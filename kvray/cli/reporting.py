"""Where the command line reports: progress and errors on stderr, so stdout holds only results,
and bad input as one line with exit code 2 rather than a traceback."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import typer
from rich.console import Console

from kvray.core.errors import KvrayError

console = Console(stderr=True)


@contextmanager
def reported_errors() -> Iterator[None]:
    """Bad input ends the command with its one-line message (exit code 2), not a traceback."""
    try:
        yield
    except KvrayError as exc:
        console.print(f"[red]kvray: {exc}[/]", soft_wrap=True)
        raise typer.Exit(2) from None
