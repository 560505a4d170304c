"""How busy a drive has been lately, measured from the I/O calls that ran on it.

A placement policy weighs a disk hit against recomputing the page, and a hit waits behind
what the drive is already doing: ``reuse`` writes a page to disk only while a load from
there, stretched by the queue on the drive's load path (``load_cost / (1 - u)``), beats
recomputing it (:func:`kvray.policy.reuse_admission.disk_pays`). The simulator knows ``u``
from its link model (:meth:`kvray.sim.links.Link.contention`: the busy share of the last
window); a running store measures it. :class:`BusyShare` is that measurement: the share of
the last ``window_s`` seconds during which at least one of its operations was in flight (the
union of their spans, as ``iostat``'s %util counts a device), so it never exceeds 1 however
many threads read at once. The disk pool times only its
``preadv``/``pwritev`` calls, not the hashing around them nor the copies ``read_many`` serves
from the page cache (:class:`~kvray.core.tiers.disk.DiskPool`; a ``preadv`` the page cache
answers is counted: the pool cannot tell it from the drive's). O(1) a call, amortised, and bounded:
what left the window is dropped as operations are added, whether or not anyone asks.

Example::

    from kvray.core.busy import BusyShare

    reads = BusyShare(window_s=1.0)
    reads.add(10.0, 10.3)      # a read from t=10.0 s to 10.3 s (time.monotonic's clock)
    reads.add(10.2, 10.4)      # another, overlapping it: 0.1 s more in flight
    reads.share(now=10.5)      # 0.4: something was in flight 0.4 s of the last second
    reads.share(now=11.2)      # 0.2: of that, 10.2-10.4 is still in the window
    reads.share(now=11.5)      # 0.0: both ended before the window
"""

from __future__ import annotations

import threading
import time
from collections import deque

WINDOW_S = 1.0  # the simulator's default link window (Scenario.window_ms)


class BusyShare:
    """The share of the last ``window_s`` seconds with an operation in flight, from the
    operations :meth:`add` is told of as they end."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        self.window_s = window_s
        self._spans: deque[tuple[float, float]] = deque()  # the union of the spans told: disjoint, in order
        self._busy = 0.0  # the lengths of _spans
        self._lock = threading.Lock()  # reads run on several threads

    def add(self, start: float, end: float) -> None:
        """An operation ran from ``start`` to ``end`` (seconds of ``time.monotonic``), told as
        it ends (threads may tell them a little out of order): it joins the spans it overlaps,
        so time two operations shared counts once."""
        if end <= start:
            return
        with self._lock:
            spans, later = self._spans, []
            while spans and spans[-1][0] > end:  # told late: spans wholly after it stay as they are
                later.append(spans.pop())
            while spans and spans[-1][1] >= start:
                first, last = spans.pop()
                self._busy -= last - first
                start, end = min(start, first), max(end, last)
            spans.append((start, end))
            spans.extend(reversed(later))
            self._busy += end - start
            self._forget(spans[-1][1] - self.window_s)

    def share(self, now: float | None = None) -> float:
        """The time in ``(now - window_s, now]`` during which an operation was in flight, over
        ``window_s``, of the operations told by ``now`` (which must not go backwards)."""
        now = time.monotonic() if now is None else now
        since = now - self.window_s
        with self._lock:
            self._forget(since)
            spans = self._spans
            busy = self._busy - max(0.0, since - spans[0][0]) if spans else 0.0  # only the first can start before
        return min(max(busy, 0.0) / self.window_s, 1.0)

    def _forget(self, since: float) -> None:
        spans = self._spans
        while spans and spans[0][1] <= since:
            first, last = spans.popleft()
            self._busy -= last - first
        if not spans:
            self._busy = 0.0  # no drift from the running sum's roundings
