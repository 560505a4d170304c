"""Links as queued resources: every byte the simulator moves occupies the links it crosses.

A :class:`Link` is a resource of ``lanes`` parallel channels (PCIe: one per GPU of the node;
an NVMe drive, a NIC direction or a switch: one) with a bandwidth and a per-transfer
latency. :func:`transfer` sends bytes along a path of links: the transfer starts at the
earliest time, once it is ready, that every link on the path has a lane idle for its whole
duration, then holds that lane of each for ``latency + bytes / bottleneck bandwidth``, so two
transfers over a shared link queue behind each other and a slow hop (NVMe) sets the pace of
a path that also crosses a fast one (PCIe). Per-transfer latency holds the link too: a page
loaded as its own transfer costs its latency each time, as a DMA or NVMe command does.

A lane is booked by time, not by the order of the calls: the simulator books a request's
writes when its prefill will end, often seconds after the next requests' loads start, and
a load fits in the idle time before such a write. (Booking in call order made a page read
from another node's GPU wait behind demotions booked for seconds later: on the 4-node skewed
scenario under ARC those waits were 0.8 s per remote load on average.)
:meth:`Link.advance` forgets what ended before the simulator's clock.

An unqueued link (``queued=False``) never delays a transfer but still counts its bytes and
busy time: the single-node scenarios of the simulator's first version run that way, so their
results are unchanged, and their utilisation above 1 shows what they leave uncharged.

Example::
    from kvray.sim.links import Link, transfer

    pcie = Link("pcie_h2d", gbps=50.0, latency_us=10.0)
    first = transfer((pcie,), ready_ms=0.0, nbytes=50_000_000, kind="load")   # 1 ms + 10 us
    second = transfer((pcie,), ready_ms=0.0, nbytes=50_000_000, kind="load")  # waits for the first
    assert abs(first - 1.01) < 1e-9 and abs(second - 2.02) < 1e-9
    later = transfer((pcie,), ready_ms=10.0, nbytes=50_000_000, kind="store")  # booked for 10 ms
    early = transfer((pcie,), ready_ms=3.0, nbytes=50_000_000, kind="load")    # fits before it
    assert abs(early - 4.01) < 1e-9
    assert pcie.bytes_by_kind["load"] == 150_000_000 and pcie.utilisation(now_ms=1000.0) == 200_000_000 / 50e9
"""

from __future__ import annotations

import heapq
from bisect import bisect_right, insort
from collections import deque
from collections.abc import Sequence
from functools import lru_cache


class Link:
    """One direction of a physical link: ``lanes`` channels of ``gbps`` (1e9 bytes/s) each, each
    holding its bookings as sorted ``(start, end)`` intervals.

    Its utilisation is what a runtime reads off byte counters: the bytes whose transfers
    ended in the last ``window_ms`` over what the link could carry in that time.

    Example::

        nvme_read = Link("nvme_read", gbps=7.0, latency_us=100.0)
        transfer((nvme_read,), ready_ms=0.0, nbytes=64 << 20, kind="load")   # ~9.7 ms
    """

    __slots__ = (
        "name",
        "bytes_per_ms",
        "latency_ms",
        "lanes",
        "queued",
        "window_ms",
        "bytes_by_kind",
        "busy_ms",
        "last_end_ms",
        "_starts",
        "_ends",
        "_pending",
        "_window",
        "_window_bytes",
    )

    def __init__(
        self,
        name: str,
        gbps: float,
        latency_us: float = 0.0,
        lanes: int = 1,
        queued: bool = True,
        window_ms: float = 1000.0,
    ) -> None:
        if gbps <= 0 or lanes <= 0 or latency_us < 0 or window_ms <= 0:
            raise ValueError(f"link {name!r}: bandwidth, lanes and window must be positive, latency not negative")
        self.name = name
        self.bytes_per_ms = gbps * 1e6
        self.latency_ms = latency_us / 1e3
        self.lanes = lanes
        self.queued = queued
        self.window_ms = window_ms
        self.bytes_by_kind: dict[str, int] = {}
        self.busy_ms = 0.0
        self.last_end_ms = 0.0
        self._starts: list[list[float]] = [[] for _ in range(lanes)]  # per lane, sorted; ends likewise
        self._ends: list[list[float]] = [[] for _ in range(lanes)]
        self._pending: list[tuple[float, int]] = []  # heap of (end, bytes) not yet arrived
        self._window: deque[tuple[float, int]] = deque()  # arrived within the window, by end
        self._window_bytes = 0

    def _fit(self, lane: int, ready_ms: float, duration_ms: float) -> float:
        """The earliest start at or after ``ready_ms`` at which ``lane`` is idle for ``duration_ms``."""
        starts, ends = self._starts[lane], self._ends[lane]
        start = ready_ms
        for i in range(bisect_right(ends, ready_ms), len(ends)):
            if start + duration_ms <= starts[i]:
                break
            if ends[i] > start:
                start = ends[i]
        return start

    def earliest(self, ready_ms: float, duration_ms: float) -> float:
        """The earliest start at or after ``ready_ms`` at which some lane is idle for
        ``duration_ms`` (``ready_ms`` itself for an unqueued link: it never delays)."""
        if not self.queued:
            return ready_ms
        best = self._fit(0, ready_ms, duration_ms)
        for lane in range(1, self.lanes):
            if best == ready_ms:
                break
            best = min(best, self._fit(lane, ready_ms, duration_ms))
        return best

    def occupy(self, start: float, end: float, nbytes: int, kind: str) -> None:
        """Hold a lane idle from ``start`` to ``end`` (one :meth:`earliest` gave) and count the bytes."""
        if self.queued:
            lane = next((i for i in range(self.lanes) if self._fit(i, start, end - start) <= start), None)
            if lane is None:
                raise ValueError(f"link {self.name!r}: no lane idle from {start} to {end} ms")
            starts, ends = self._starts[lane], self._ends[lane]
            if not ends or start >= ends[-1]:
                starts.append(start)
                ends.append(end)
            else:
                insort(starts, start)
                insort(ends, end)
        self.bytes_by_kind[kind] = self.bytes_by_kind.get(kind, 0) + nbytes
        self.busy_ms += end - start
        if end > self.last_end_ms:
            self.last_end_ms = end
        heapq.heappush(self._pending, (end, nbytes))

    def advance(self, now_ms: float) -> None:
        """No transfer will be ready before ``now_ms`` from now on: bookings that ended by
        then are forgotten, so that a busy link's search stays short."""
        for starts, ends in zip(self._starts, self._ends):
            done = bisect_right(ends, now_ms)
            if done:
                del starts[:done], ends[:done]

    @property
    def bytes(self) -> int:
        return sum(self.bytes_by_kind.values())

    def utilisation(self, now_ms: float) -> float:
        """Bytes that arrived over the link in ``(now_ms - window_ms, now_ms]`` over its
        capacity in that time; ``now_ms`` must not go backwards between calls. Above 1 only
        for an unqueued link."""
        pending, window = self._pending, self._window
        while pending and pending[0][0] <= now_ms:
            item = heapq.heappop(pending)
            window.append(item)
            self._window_bytes += item[1]
        cutoff = now_ms - self.window_ms
        while window and window[0][0] <= cutoff:
            self._window_bytes -= window.popleft()[1]
        return self._window_bytes / (self.bytes_per_ms * self.window_ms * self.lanes)

    def contention(self, now_ms: float) -> float:
        """The busy share a transfer booked now would queue behind: :meth:`utilisation` on a
        queued link, 0 on an unqueued one (it delays nothing, however busy)."""
        return self.utilisation(now_ms) if self.queued else 0.0

    def utilisation_over(self, span_ms: float) -> float:
        """Busy share of the lanes over a whole replay of ``span_ms`` (the table's figure)."""
        return self.busy_ms / (span_ms * self.lanes) if span_ms > 0 else 0.0


@lru_cache(maxsize=4096)  # bounded: links belong to one simulator, and an eval creates many
def _path_shape(path: tuple[Link, ...]) -> tuple[float, float]:
    """A path's summed latency and bottleneck bytes/ms (fixed for a link's life)."""
    return sum(link.latency_ms for link in path), min(link.bytes_per_ms for link in path)


def _shape(path: Sequence[Link]) -> tuple[float, float]:
    return _path_shape(tuple(path))


def transfer(path: Sequence[Link], ready_ms: float, nbytes: int, kind: str, latency_ms: float = 0.0, ops: int = 1) -> float:
    """Move ``nbytes`` along ``path`` as ``ops`` back-to-back operations, each paying
    ``latency_ms`` (the source's access latency) plus the links' latencies; returns when the
    last byte arrives. The transfer starts at the earliest time at or after ``ready_ms`` that
    every link has a lane idle for its whole duration, and holds that lane of each link."""
    return book(path, ready_ms, transfer_ms(path, nbytes, latency_ms, ops), nbytes, kind)


def book(path: Sequence[Link], ready_ms: float, duration: float, nbytes: int, kind: str) -> float:
    """:func:`transfer` of a known ``duration`` (:func:`transfer_ms`): what a caller moving
    many pages along one path works out once (the simulator's mover, per page event)."""
    if not path:
        return ready_ms
    start = ready_ms
    while True:  # the earliest time every link has a lane idle throughout
        latest = start
        for link in path:
            if link.queued:
                fits = link.earliest(start, duration)
                if fits > latest:
                    latest = fits
        if latest == start:
            break
        start = latest
    end = start + duration
    for link in path:
        link.occupy(start, end, nbytes, kind)
    return end


def transfer_ms(path: Sequence[Link], nbytes: int, latency_ms: float = 0.0, ops: int = 1) -> float:
    """How long :func:`transfer` holds ``path`` once it starts (its queueing aside)."""
    if not path:
        return 0.0
    links_latency, bytes_per_ms = _shape(path)
    return ops * (latency_ms + links_latency) + nbytes / bytes_per_ms
