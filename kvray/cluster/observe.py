"""What the controller knows of each node when it asks the cluster policy where pages go.

A :class:`~kvray.policy.cluster.ClusterPolicy` decides from a
:class:`~kvray.policy.cluster.ClusterView`: per node the engine backlog, the free share of
each tier and the utilisation of its links. The simulator models these; the runtime
observes them, without adding a call to any request:

- stores answer every write (``write_from``, ``put_pages``, a page server's STORE) with
  their :class:`NodeReport` beside the pages they dropped: free and total slots per tier
  and the bytes each of their links has carried so far; the client passes the reports on
  with its ``commit``;
- engines give their backlog with ``lookup_pin``.

:class:`ClusterObservations` keeps the latest of each per node and turns byte counters into
utilisations over a sliding window (bytes moved / (window x link speed), at most 1).

Example::

    seen = ClusterObservations(LinkSpeeds(), window_s=1.0, empty={"host": 1.0})
    seen.report("a", NodeReport(free=(0, 10, 0), capacity=(0, 40, 0), link_bytes=(0,) * 5), now=0.0)
    seen.backlog("a", 2.5)
    seen.view(["a"], now=0.5).node("a").free_share   # {'host': 0.25}
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

from pydantic import Field

from kvray.core.config import FrozenModel
from kvray.core.tiers import LOCAL_TIERS
from kvray.policy.cluster import ClusterView, NodeView

LINKS = ("nic_in", "nic_out", "pcie", "disk_read", "disk_write")  # NodeView's ``<link>_util`` fields


class LinkSpeeds(FrozenModel):
    """Each node's link speeds (GB/s), what utilisations are shares of."""

    nic_gbps: float = Field(default=3.125, gt=0)  # 25 Gb/s Ethernet
    pcie_gbps: float = Field(default=25.0, gt=0)
    disk_read_gbps: float = Field(default=3.0, gt=0)
    disk_write_gbps: float = Field(default=2.0, gt=0)

    def bytes_per_s(self) -> tuple[float, ...]:
        """Capacity of each of :data:`LINKS`, in bytes per second."""
        gbps = (self.nic_gbps, self.nic_gbps, self.pcie_gbps, self.disk_read_gbps, self.disk_write_gbps)
        return tuple(g * 1e9 for g in gbps)


class NodeReport(NamedTuple):
    """A store's state after a write: free and total slots of device, host and disk, and
    the bytes each of :data:`LINKS` has carried since the store started."""

    free: tuple[int, int, int]
    capacity: tuple[int, int, int]
    link_bytes: tuple[int, int, int, int, int]

    def free_share(self) -> dict[str, float]:
        """Free share of each tier the node has (absent tiers left out)."""
        return {t.label: f / c for t, f, c in zip(LOCAL_TIERS, self.free, self.capacity) if c}

    def flat(self) -> tuple[int, ...]:
        """Eleven integers, as the page server's STORE answer carries them."""
        return (*self.free, *self.capacity, *self.link_bytes)

    @classmethod
    def from_flat(cls, values: Sequence[int]) -> NodeReport:
        return cls(tuple(values[0:3]), tuple(values[3:6]), tuple(values[6:11]))


class ClusterObservations:
    """The latest report and backlog of every node, and a window of link counters."""

    def __init__(self, speeds: LinkSpeeds, window_s: float, empty: dict[str, float] | None = None) -> None:
        """``empty``: the free share of a node not heard from yet (its tiers, all free)."""
        self.capacity = speeds.bytes_per_s()
        self.disk_write_gbps = speeds.disk_write_gbps  # a node with a disk tier's drive rate (NodeView's)
        self.window_s = window_s
        self.empty = dict(empty or {})
        self._reports: dict[str, NodeReport] = {}
        self._samples: dict[str, deque[tuple[float, tuple[int, ...]]]] = {}
        self._backlog: dict[str, float] = {}

    def report(self, node: str, report: NodeReport, now: float) -> None:
        self._reports[node] = report
        samples = self._samples.setdefault(node, deque())
        samples.append((now, report.link_bytes))
        while len(samples) > 1 and samples[1][0] <= now - self.window_s:
            samples.popleft()  # the oldest kept sample is the last one at or before the window's start

    def backlog(self, node: str, backlog_ms: float) -> None:
        self._backlog[node] = backlog_ms

    def forget(self, node: str) -> None:
        self._reports.pop(node, None)
        self._samples.pop(node, None)
        self._backlog.pop(node, None)

    def utilisation(self, node: str, now: float) -> tuple[float, ...]:
        """Share of each link's capacity used over the last ``window_s``: the bytes counted
        since the last report at or before the window's start (0 when no report came since),
        over the time since that report."""
        samples = self._samples.get(node)
        if not samples:
            return (0.0,) * len(LINKS)
        start = now - self.window_s
        t0, first = samples[0]
        for t, counted in samples:
            if t > start:
                break
            t0, first = t, counted
        last = samples[-1][1]
        span = max(now - t0, self.window_s)
        return tuple(min((b - a) / span / cap, 1.0) for a, b, cap in zip(first, last, self.capacity))

    def view(self, nodes: Sequence[str], now: float) -> ClusterView:
        """Every node of ``nodes`` as the policy sees it; one not heard from yet is idle and empty."""
        views = []
        for node in nodes:
            report = self._reports.get(node)
            util = dict(zip(LINKS, self.utilisation(node, now)))
            free = report.free_share() if report else dict(self.empty)
            views.append(
                NodeView(
                    node,
                    backlog_ms=self._backlog.get(node, 0.0),
                    free_share=free,
                    nic_in_util=util["nic_in"],
                    nic_out_util=util["nic_out"],
                    pcie_util=util["pcie"],
                    disk_read_util=util["disk_read"],
                    disk_write_util=util["disk_write"],
                    disk_write_gbps=self.disk_write_gbps if "disk" in free else 0.0,
                )
            )
        return ClusterView(tuple(views))
