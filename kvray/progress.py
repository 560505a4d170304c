"""One progress bar for every long loop (replays, simulations, evaluations).

It draws on stderr, so a command's JSON on stdout stays clean, and redraws at most ~200
times whatever the loop's length.

Example::
    from kvray.progress import progress_bar

    items = range(1000)
    with progress_bar(len(items), "replay lru") as tick:
        for i, item in enumerate(items):
            if tick:
                tick(i)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console


@contextmanager
def progress_bar(total: int, label: str, enabled: bool = True) -> Iterator[Callable[[int], None] | None]:
    """A transient rich bar; yields a callback taking the index of the item done (None when off)."""
    if not enabled:
        yield None
        return
    from rich.progress import Progress

    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(label, total=total)
        step = max(1, total // 200)
        yield lambda i: bar.update(task, completed=i + 1) if (i + 1) % step == 0 else None
