"""Disk admission by predicted reuse: a page leaving host memory is written to NVMe only when
its predicted chance of being read while it would stay there, times what a disk hit saves,
beats what the write costs on the drive's write link at its current utilisation.

Every heuristic writes each page it demotes; on the cluster scenarios NVMe writes are the
busiest link under all of them, while the oracle writes ~40% of LRU's bytes
(docs/sim-eval: "Disk admission"). The eviction model's score cannot gate: its loss is a
softmax over one decision's candidates, blind to a shift of every score, so it ranks pages
and says nothing of how far ahead any is used. :class:`DiskGate` is a pointwise head
instead: a logistic regression over the same feature rows (standardised as the eviction
model standardises them), P(read again within the disk tier's horizon), fitted online on
delayed labels: a demoted page (written or dropped) is labelled 1 when it is read or stored
again within the horizon, else 0 once the horizon has passed. The horizon is how long a page
stays on disk: the tier's pages over the pages written to it per request so far. The same
code runs in the simulator and in the runtime, both telling the policy of the same events.

Cost model, in page prefills (the unit of ``RequestInfo.tier_cost``): a disk hit saves
``1 - c`` (recomputing a page, less loading it from disk, ``c``); a write holds the drive's
write link about as long as a load, which delays what queues behind it by the M/M/1 wait
at utilisation ``u``: ``c * u / (1 - u)`` (free on an idle link, the link being the drive's
write side only); and the page it pushes off a full disk tier would have saved
``r * (1 - c)``, ``r`` the share of demoted pages read again within the horizon so far.
Write iff ``(P - r) * (1 - c) > c * u / (1 - u)``, and never where ``c >= 1`` (at half
bandwidth the cluster scenarios' disks load a page slower than the engine recomputes it; a
page written there is a slower hit). On the cluster scenarios the ``r`` term is what halves
the bytes (without it 0.60x / 0.79x LRU's NVMe bytes; twice it cost 3-6% of mean TTFT;
docs/sim-eval, "Disk admission"). Until :data:`WARMUP` labels have
arrived, every page is written (what every heuristic does).

Before any prediction, :func:`disk_pays` (on in every ``reuse`` policy, gate or not): a page
is written to disk only while a page read from there would reach the engine before the
engine could recompute it, the disk's load cost stretched by the queue on its load path.
A slower hit is worth less than a miss, and its write and read take link time from pages
that pay. On the 4- and 8-node scenarios it keeps what the gate gains where disks are slow
or busy, without the gate's losses where they are fast and idle (docs/sim-eval, "A disk hit
slower than recomputing").

Example::

    import numpy as np
    from kvray.policy.reuse_admission import DiskGate, disk_pays

    disk_pays(0.54, utilisation=0.3)   # True: 0.54 / 0.7 of a prefill
    disk_pays(0.54, utilisation=0.5)   # False: a hit would wait 1.08 prefills

    gate = DiskGate(mean=np.zeros(3), scale=np.ones(3), disk_pages=100)
    gate.request(now=1, disk_cost=0.2, util=0.1)
    gate.admit(key=7, row=np.zeros(3, dtype=np.float32), now=1)   # True: still warming up
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from kvray.core.placement import LRUPolicy, RequestInfo
from kvray.core.tiers import Tier

WARMUP = 256  # labelled demotions before the gate decides
MAX_UTILISATION = 0.95  # a link seen busier is counted this busy: the queue formula's pole
LEARNING_RATE = 0.05
MIN_HORIZON = 16.0  # requests


def disk_pays(load_cost: float, utilisation: float) -> bool:
    """Whether a page written to disk now would load faster than the engine recomputes it:
    ``load_cost`` (a page's load from the disk, in page prefills: ``RequestInfo.tier_cost``)
    stretched by the wait on the disk's load path at its recent busy share ``utilisation``
    (an M/M/1 sojourn, ``load_cost / (1 - u)``) stays under one prefill. Unknown costs (0) pay."""
    return load_cost / (1.0 - min(max(utilisation, 0.0), MAX_UTILISATION)) < 1.0


def write_wait(disk_cost: float, utilisation: float) -> float:
    """What one more page written to a drive costs what queues behind it, in page prefills: it
    holds the drive about as long as a load (``disk_cost``), and at utilisation ``u`` a write
    adds the M/M/1 wait ``disk_cost * u / (1 - u)`` (0 on an idle drive or one that never
    queues: a single-node scenario's): what :class:`DiskGate` weighs a write against, and what
    the tripwire's shadows pay per page they write (:mod:`kvray.policy.reuse_online`)."""
    u = min(max(utilisation, 0.0), MAX_UTILISATION)
    return disk_cost * u / (1.0 - u)


def disk_closed(info: RequestInfo) -> bool:
    """Whether ``info``'s request drops what leaves for disk: :func:`disk_pays` of the disk's
    cost and its load path's queue as the request arrives (unknown: 0, so the disk stays open)."""
    cost, busy = info.tier_cost or {}, info.load_util or {}
    return not disk_pays(cost.get(Tier.DISK, 0.0), busy.get(Tier.DISK, 0.0))


class LoadCostAdmission:
    """:func:`disk_pays` for an eviction rule that keeps no link flags of its own per instance,
    put before its class in the bases: a page leaving for disk while a disk hit would not beat
    recomputing it is dropped. ``reuse`` has it built in (its compiled hooks too); with a
    heuristic it measures what the rule alone is worth."""

    needs_link_util = True  # told each tier's load path's queue (RequestInfo.load_util)
    _disk_closed = False
    _closed_requests = 0

    def on_request(self, info: RequestInfo) -> None:
        """Decided once per request: the queue is read as the request arrives, as in ``reuse``."""
        super().on_request(info)  # type: ignore[misc]
        self._disk_closed = disk_closed(info)
        self._closed_requests += self._disk_closed

    def demote_target(self, handle: int, tier: Tier) -> Tier | None:
        """The rule's demotion, but nowhere (dropped: a miss later, never wrong KV) into a closed disk."""
        below = super().demote_target(handle, tier)  # type: ignore[misc]
        return None if below == Tier.DISK and self._disk_closed else below

    def stats(self) -> dict[str, int]:
        """The rule's counts, and the requests whose demotions into disk were dropped."""
        return {**super().stats(), "disk_closed_requests": self._closed_requests}  # type: ignore[misc]


class LoadCostLRU(LoadCostAdmission, LRUPolicy):
    """LRU that writes no page to a disk slower than recomputing it (``lru-load-cost``)."""

    name = "lru-load-cost"


class DiskGate:
    """P(read again within the disk tier's horizon) for pages about to be written to disk."""

    def __init__(self, mean: np.ndarray, scale: np.ndarray, disk_pages: int) -> None:
        self.mean, self.scale = np.asarray(mean, dtype=np.float64), np.asarray(scale, dtype=np.float64)
        self.w = np.zeros(len(self.mean))
        self.b = 0.0
        self.disk_pages = disk_pages
        self.written = self.dropped = self.labelled = 0
        self.resolved = self.reused = 0  # demotions a horizon old, and those of them read again within it
        self._requests = 0
        self._disk_cost = 0.0
        self._util = 0.0
        self._waiting: dict[int, tuple[np.ndarray, float]] = {}  # key -> (standardised row, when demoted)
        self._queue: deque[tuple[float, int]] = deque()  # (when, key), oldest first
        self._reads: deque[float] = deque()  # when each demotion read again within its horizon was demoted

    def horizon(self) -> float:
        """Requests a page stays on disk: the tier's pages over the pages written per request."""
        rate = self.written / max(self._requests, 1)
        return max(self.disk_pages / rate, MIN_HORIZON) if rate > 0 else float(self.disk_pages)

    def request(self, now: float, disk_cost: float, util: float) -> None:
        """A request arrives: the disk's relative load cost and its write link's busy share now
        (``RequestInfo.disk_write_util``: 0 on a link that never queues); demotions a horizon
        old and not read since are labelled not reused."""
        self._requests += 1
        self._disk_cost = min(max(disk_cost, 0.0), 1.0)
        self._util = util  # write_wait bounds it
        horizon = self.horizon()
        while self._queue and now - self._queue[0][0] > horizon:
            when, key = self._queue.popleft()
            self.resolved += 1
            entry = self._waiting.get(key)
            if entry is not None and entry[1] == when:
                del self._waiting[key]
                self._learn(entry[0], 0.0)
        while self._reads and now - self._reads[0] > horizon:  # counted as their cohort resolves: no early bias
            self._reads.popleft()
            self.reused += 1

    def probability(self, x: np.ndarray) -> float:
        return float(1.0 / (1.0 + np.exp(-(x @ self.w + self.b))))

    def admit(self, key: int, row: np.ndarray, now: float) -> bool:
        """Write the page ``key`` (features ``row``) to disk? Either way its reuse is watched."""
        x = (np.asarray(row, dtype=np.float64) - self.mean) / self.scale
        self._waiting[key] = (x, now)
        self._queue.append((now, key))
        c = self._disk_cost
        displaced = self.reused / max(self.resolved, 1)  # a demoted page's base rate of reuse
        pays = (self.probability(x) - displaced) * (1.0 - c) > write_wait(c, self._util)
        write = c < 1.0 and (self.labelled < WARMUP or pays)  # a disk no faster than recomputing is never written
        if write:
            self.written += 1
        else:
            self.dropped += 1
        return write

    def used(self, keys: Sequence[int], now: float) -> None:
        """Pages read, or stored again after they left: a demotion within the horizon was reused."""
        waiting = self._waiting
        if not waiting:
            return
        horizon = self.horizon()
        for key in keys:
            entry = waiting.pop(key, None)
            if entry is not None:
                reused = now - entry[1] <= horizon
                self._learn(entry[0], 1.0 if reused else 0.0)
                if reused:
                    self._reads.append(entry[1])

    def _learn(self, x: np.ndarray, label: float) -> None:
        """One step of logistic regression (log loss) towards ``label``."""
        g = self.probability(x) - label
        self.w -= LEARNING_RATE * g * x
        self.b -= LEARNING_RATE * g
        self.labelled += 1
