"""Page buffers for the requests a page server (:mod:`kvray.cluster.transfer`) has in flight."""

from __future__ import annotations

from threading import Lock

import numpy as np


class RowPool:
    """Page buffers for the requests in flight on a server's connections.

    A request takes rows for its pages and gives them back once answered. Between requests
    at most ``keep_rows`` rows stay allocated in all (one largest request's worth, so a
    steady stream of requests reuses warm memory): an idle connection holds none, and a
    burst of parallel requests allocates buffers that are freed once they are answered.
    """

    def __init__(self, page_nbytes: int, keep_rows: int) -> None:
        self._page_nbytes = page_nbytes
        self._keep_rows = keep_rows
        self._free: list[np.ndarray] = []  # smallest first
        self._lock = Lock()

    @property
    def kept_rows(self) -> int:
        with self._lock:
            return sum(len(rows) for rows in self._free)

    def take(self, n: int) -> np.ndarray:
        """At least ``n`` rows, the smallest free buffer that fits or a new one."""
        with self._lock:
            for i, rows in enumerate(self._free):
                if len(rows) >= n:
                    return self._free.pop(i)
        return np.empty((n, self._page_nbytes), dtype=np.uint8)

    def give(self, rows: np.ndarray) -> None:
        """Keep ``rows`` for later requests if they fit, making room by freeing smaller buffers."""
        with self._lock:
            kept = sum(len(free) for free in self._free)
            while self._free and kept + len(rows) > self._keep_rows and len(self._free[0]) < len(rows):
                kept -= len(self._free.pop(0))
            if kept + len(rows) <= self._keep_rows:
                self._free.append(rows)
                self._free.sort(key=len)
