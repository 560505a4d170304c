"""Prefill stand-in: real compute whose cost per token is calibrated on this machine.

``kvray run`` has no model to run, yet its time to first token must contain the cost of
computing the KV a cache missed. Sleeping would make the figure a constant; this runs a
real matrix multiply whose number of rows is proportional to the missed tokens, scaled
once at start-up so that one token costs ``us_per_token`` microseconds of CPU here. The
figure therefore moves with load on the machine like a real prefill does.

Example::

    prefill = PrefillWorkload(us_per_token=5.0)
    prefill.run(4096)          # about 20 ms of matmul
"""

from __future__ import annotations

import time

import numpy as np

CHUNK_ROWS = 1024


class PrefillWorkload:
    """A ``[rows, width] @ [width, width]`` matmul sized to ``us_per_token`` per token."""

    def __init__(self, us_per_token: float, width: int = 256, seed: int = 0) -> None:
        generator = np.random.default_rng(seed)
        self.weight = generator.standard_normal((width, width), dtype=np.float32)
        self.activations = generator.standard_normal((CHUNK_ROWS, width), dtype=np.float32)
        self.out = np.empty((CHUNK_ROWS, width), dtype=np.float32)
        self.rows_per_token = us_per_token * 1e-6 / self._seconds_per_row() if us_per_token > 0 else 0.0

    def _seconds_per_row(self) -> float:
        """The fastest of many timed chunks: start-up is when the machine is busiest, and
        the unloaded speed is what ``us_per_token`` means."""
        for _ in range(3):
            self._matmul(CHUNK_ROWS)
        times = []
        for _ in range(21):
            t0 = time.perf_counter()
            self._matmul(CHUNK_ROWS)
            times.append(time.perf_counter() - t0)
        return min(times) / CHUNK_ROWS

    def _matmul(self, rows: int) -> None:
        np.matmul(self.activations[:rows], self.weight, out=self.out[:rows])

    def run(self, tokens: int) -> None:
        rows = round(tokens * self.rows_per_token)
        while rows > 0:
            step = min(rows, CHUNK_ROWS)
            self._matmul(step)
            rows -= step
