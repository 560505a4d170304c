"""How busy a drive has been lately, measured from the operations that ran on it.

A placement policy weighs a disk hit against recomputing the page, and a hit waits behind
what the drive is already doing: ``reuse`` writes a page to disk only while a load from
there, stretched by the queue on the drive's load path (``load_cost / (1 - u)``), beats
recomputing it (:func:`kvray.policy.reuse_admission.disk_pays`). The simulator knows ``u``
from its link model (:meth:`kvray.sim.links.Link.contention`: the busy share of the last
window); a running store measures it. :class:`BusyShare` is that measurement, as the
simulator counts a link's: the time taken by the operations that ended in the last
``window_s`` seconds, over the window (the simulator: the bytes that arrived in it over what
the link carries in that time). Operations that overlap (reads on several threads) add up,
so a drive with several requests in flight can read above 1; the policy caps what it reads
(:data:`~kvray.policy.reuse_admission.MAX_UTILISATION`). O(1) a call, amortised: a running
sum over the window's operations.

Example::

    from kvray.core.busy import BusyShare

    reads = BusyShare(window_s=1.0)
    reads.add(10.0, 10.3)      # a read from t=10.0 s to 10.3 s (time.monotonic's clock)
    reads.share(now=10.5)      # 0.3: busy 0.3 s of the last second
    reads.share(now=11.5)      # 0.0: the read ended before the window
"""

from __future__ import annotations

import threading
import time
from collections import deque

WINDOW_S = 1.0  # the simulator's default link window (Scenario.window_ms)


class BusyShare:
    """The busy share of the last ``window_s`` seconds, from the operations :meth:`add` is told of."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        self.window_s = window_s
        self._ended: deque[tuple[float, float]] = deque()  # (end, duration), in the order told
        self._busy = 0.0  # the durations in _ended
        self._lock = threading.Lock()  # reads run on several threads

    def add(self, start: float, end: float) -> None:
        """An operation ran from ``start`` to ``end`` (seconds of ``time.monotonic``)."""
        with self._lock:
            self._ended.append((end, end - start))
            self._busy += end - start

    def share(self, now: float | None = None) -> float:
        """The durations of the operations that ended in ``(now - window_s, now]`` over
        ``window_s``; those that ended before are forgotten (``now`` must not go backwards)."""
        now = time.monotonic() if now is None else now
        since = now - self.window_s
        with self._lock:
            ended = self._ended
            while ended and ended[0][0] <= since:
                self._busy -= ended.popleft()[1]
            if not ended:
                self._busy = 0.0  # no drift from the running sum's roundings
            return max(self._busy, 0.0) / self.window_s
