"""The request protocol's types: plans, leases, runs of pages, what a load delivered, and
the handle of one request.

An engine's request goes through the cache in one pattern: look up the cached prefix
(pinned under a lease), load it into the landing buffer, compute the rest into the rows
after it, release the lease, store the computed rows. :meth:`KvrayClient.request
<kvray.cluster.client.KvrayClient.request>` runs that pattern around a ``with`` block and
hands the block a :class:`Request`; the types here are what the client, the controller,
the transfer paths and the engines exchange on the way, and import from here.

- :class:`Plan`: the controller's answer to a lookup (where each cached page is, where
  each missing one goes), under a lease: ``NO_LEASE`` (the controller was unreachable:
  nothing pinned, nothing placed), ``LOCAL_LEASE`` (the client answered from its node's
  host tier: nothing pinned), or an id from :func:`new_lease` (pins at one controller shard).
- :class:`Run`: consecutive pages of a request on one node, which move together.
- :class:`Loaded`: what a load delivered: the first ``pages`` rows, by tier and path.
- :class:`Release`: what a request reports to the controller when it is done with its lease.
- :class:`Stored`: a store's answer to the write of one run: what the client commits.
- :class:`Decision`: the cluster policy's verbs for one request before it is served (which
  node, how much of the hit to load, prefetch, replicate), from ``Controller.decide``.
- :class:`Request`: one request inside its ``with`` block; its rows are the landing
  buffer's, so they are readable only there.

Example::

    with client.request(keys) as r:
        use(r.rows[: r.hit])                    # the cached prefix's KV
        compute_into(r.rows[r.hit :])           # the rest
        r.store()                               # stored on exit, after the release
    r.stored                                    # pages stored; r.rows now raises
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from kvray.core.errors import RequestError
from kvray.core.placement import RunPlace

if TYPE_CHECKING:
    import ray

    from kvray.cluster.observe import NodeReport

NO_LEASE = 0  # the lease of a plan made without the controller (it was down): nothing pinned
LOCAL_LEASE = -1  # a plan the client answered from its node's host tier alone: nothing pinned at a controller
# A request as a store's policy is told of it: packed keys, backlog ms, arrival ms, the depth its
# client says its session's own pages start at, this being its last request (RequestInfo.ends_session_from; -1: no hint)
Arrival = tuple[bytes, float, "float | None", int]


def new_lease() -> int:
    """A fresh lease id, drawn by the client so it knows the id even if ``lookup_pin``'s
    answer never arrives. Random, so no two clients (or a client across a controller
    restart) collide in practice; never ``NO_LEASE`` or ``LOCAL_LEASE``."""
    return secrets.randbits(62) + 1


@dataclass(frozen=True)
class Plan:
    """The controller's answer to one request."""

    lease: int
    hit_nodes: list[str]
    targets: list[str]
    shard: int = 0  # the controller shard that made it (and holds its lease), set by the client

    @property
    def hit_pages(self) -> int:
        return len(self.hit_nodes)

    def __reduce__(self):
        """Pickled (a Ray reply) with its per-page node lists as runs, one ``(node, pages)``
        entry per run of a chain on one node: a million-token prefix held by one node is one
        entry, where its 7,812 names cost 2 ms to pickle and as much to load."""
        return _plan_from_runs, (self.lease, node_runs(self.hit_nodes), node_runs(self.targets), self.shard)

    @classmethod
    def placing(cls, targets: Sequence[str]) -> Plan:
        """A plan with nothing cached or pinned that stores page ``i`` on ``targets[i]``:
        for writing pages where the caller chooses (a benchmark's or a test's placement)."""
        return cls(NO_LEASE, [], list(targets))


def node_runs(nodes: Sequence[str]) -> list[tuple[str, int]]:
    """``nodes`` as runs of one node: ``(node, how many in a row)``, in order."""
    return [(node, sum(1 for _ in group)) for node, group in itertools.groupby(nodes)]


def _plan_from_runs(lease: int, hit_runs: list[tuple[str, int]], target_runs: list[tuple[str, int]], shard: int) -> Plan:
    def expand(runs: list[tuple[str, int]]) -> list[str]:
        return list(itertools.chain.from_iterable(itertools.repeat(node, count) for node, count in runs))

    return Plan(lease, expand(hit_runs), expand(target_runs), shard)


@dataclass(frozen=True)
class Run:
    """Pages ``start..stop`` of a request (its rows in the landing buffer), all on ``node``."""

    node: str
    start: int
    stop: int

    def place(self, request_pages: int) -> RunPlace:
        """Where the run sits in its request of ``request_pages`` pages (its rows are its depths)."""
        return RunPlace(self.start, request_pages)


def runs_of(nodes: Sequence[str], start: int) -> list[Run]:
    """Maximal runs of consecutive pages on one node, numbered from row ``start``."""
    runs, row = [], start
    for node, group in itertools.groupby(nodes):
        n = sum(1 for _ in group)
        runs.append(Run(node, row, row + n))
        row += n
    return runs


class Release(NamedTuple):
    """A request's report to the controller shard that holds its lease: end the lease, count
    the hits by tier, forget the pages a store no longer had (``lost``, by node).
    ``local_pages``: the pages of a request the client answered from its node's host tier
    (lease ``LOCAL_LEASE``).

    Sent on its own (``Controller.release``, or through the node's store for a local plan),
    or, when the request then stores the pages it computed, with that store's commit
    (``Controller.commit(..., release=...)``): one controller call instead of two, and the
    controller ends the lease before it adds the pages, as if the release had come first.
    """

    lease: int
    hits_by_tier: dict[str, int]
    lost: dict[str, list[int]]
    bytes_between_nodes: int = 0
    local_pages: int = 0


class Decision(NamedTuple):
    """The cluster policy's verbs for one request (``Controller.decide``), which the serving
    engine executes: ``node`` serves it; of the ``hit_pages`` cached, the first ``load_pages``
    are loaded and the rest recomputed; ``prefetch``: the load starts before the request
    waits for its engine; ``replicate``: nodes that keep a copy of the hit chain afterwards.
    ``budget_set``: when the policy's NVMe write budget for ``node`` changed, the serving
    store's call that applies it (an object ref); the executor waits for it before the
    request, so the request's own writes are under it, as in the simulator. The default (no
    decision asked) is the requester serving with every hit page loaded."""

    node: str
    hit_pages: int = 0
    load_pages: int = 0
    prefetch: bool = False
    replicate: tuple[str, ...] = ()
    budget_set: ray.ObjectRef | None = None

    def wait_for_budget(self, timeout_s: float) -> None:
        """Return once the budget decided with this request is applied (at once if it did not
        change). A call that fails or outlasts ``timeout_s`` does not hold the request up: its
        writes may then go under the budget before, which costs NVMe bytes, never a wrong page."""
        if self.budget_set is not None:
            import ray

            ray.wait([self.budget_set], timeout=timeout_s)


class Stored(NamedTuple):
    """A store's answer to the write of one run, on every path (shared memory, TCP, the
    object store).

    ``landed`` is what the client commits to the controller: the leading pages of the run
    the store holds once the write is done. A store out of room, or whose policy refused a
    page, keeps a prefix of the run, and an index naming the rest would send later loads to
    pages that are not there. ``stored`` counts the pages the write added (the request's
    ``r.stored``): fewer than ``landed`` where the store held some already, more where a
    concurrent write evicted some meanwhile. ``dropped``: keys the store let go of since its
    last answer, from any chain; ``report``: its state after the write.
    """

    stored: int
    landed: int
    dropped: list[int]
    report: NodeReport


@dataclass
class Loaded:
    """What ``load`` delivered: the first ``pages`` rows of the buffer, by tier and path."""

    pages: int
    by_tier: dict[str, int] = field(default_factory=dict)
    lost: dict[str, list[int]] = field(default_factory=dict)
    bytes_between_nodes: int = 0
    paths: dict[str, int] = field(default_factory=dict)  # transfer path -> pages
    mapped: list[int] = field(default_factory=list)  # keys copied from the mapped host tier
    mapped_s: float = 0.0  # how long those copies took (the store counts them as its loads)
    buffer: str = ""  # the landing buffer holding the rows once ``load`` returned (a later copy checks it still does)

    def merge(self, other: Loaded) -> None:
        """Count ``other`` (a later chunk of the same request) in this one."""
        for path, n in other.paths.items():
            self.paths[path] = self.paths.get(path, 0) + n
        for tier, n in other.by_tier.items():
            self.by_tier[tier] = self.by_tier.get(tier, 0) + n
        for node, keys in other.lost.items():
            self.lost.setdefault(node, []).extend(keys)
        self.pages += other.pages
        self.bytes_between_nodes += other.bytes_between_nodes
        self.mapped.extend(other.mapped)
        self.mapped_s += other.mapped_s

    def add(self, path: str, pages: int, by_tier: dict[str, int], between_nodes: int) -> None:
        if not pages:
            return
        self.pages += pages
        self.paths[path] = self.paths.get(path, 0) + pages
        for tier, n in by_tier.items():
            self.by_tier[tier] = self.by_tier.get(tier, 0) + n
        self.bytes_between_nodes += between_nodes


class Request:
    """One request inside ``with client.request(keys) as r:`` (made by the client).

    ``rows`` are the request's rows of the client's landing buffer: ``rows[:hit]`` hold the
    cached prefix's KV, ``rows[hit:len(keys)]`` are the caller's to compute into. They are
    readable only inside the block: after it the client may reuse or replace the buffer
    (the next request, or a fresh buffer after a call given up on), so ``rows`` raises and
    the view handed out is made read-only. :meth:`store` asks for the computed rows to be
    stored when the block ends (only if it ends without an exception: half-computed rows
    are never stored). What the request got (``hit``, ``loaded``, ``plan``, ``stored``)
    stays readable after the block.
    """

    def __init__(self, keys: Sequence[int], plan: Plan, loaded: Loaded, rows: np.ndarray, recomputed: int = 0) -> None:
        self.keys = keys
        self.plan = plan
        self.loaded = loaded
        self.recomputed = recomputed  # cached pages after ``hit`` the caller recomputes (a load split), not stored again
        self.stored: int | None = None  # pages stored on exit; None: not asked, or the block raised
        self.store_wanted = False
        self._rows: np.ndarray | None = rows

    @property
    def hit(self) -> int:
        """Leading pages of the request loaded from the cache (``rows[:hit]``)."""
        return self.loaded.pages

    @property
    def rows(self) -> np.ndarray:
        """``[len(keys), page_nbytes]`` uint8 rows of the landing buffer, valid inside the block only."""
        if self._rows is None:
            raise RequestError(
                "Request.rows read after its `with client.request(...)` block: the landing buffer belongs "
                "to the client's next request now; copy what you need inside the block"
            )
        return self._rows

    def store(self) -> None:
        """Store rows ``hit..len(keys)`` (computed by the caller) where the plan says, when the block ends."""
        if self._rows is None:
            raise RequestError("Request.store() called after its `with client.request(...)` block: call it inside")
        self.store_wanted = True

    def close(self) -> None:
        """End the rows' validity (the client calls this as the block ends)."""
        if self._rows is not None:
            self._rows.flags.writeable = False  # a view a caller kept can no longer write the next request's rows
            self._rows = None
