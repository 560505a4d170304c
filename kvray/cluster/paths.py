"""Transfer paths: how one run of pages moves between a store and a client's landing buffer.

Each path is a handler with the same four verbs: ``start_load`` / ``finish_load`` bring a
run of pages into the buffer rows ``run.start..``, ``start_store`` / ``finish_store`` send
buffer rows to a store. Starting returns a pending transfer without waiting, so runs on
different nodes move concurrently; finishing waits for it and turns every failure (the
store raised, died, or did not answer in time) into a miss. The client picks a path for a
run with one rule (:meth:`KvrayClient.path_for`) and calls the handler registered under
that name; adding a transport is a handler and a line in that rule. A handler sees its
client through a :class:`PathContext` (the landing buffer, the peers' addresses, where to
count a fault), never the client itself.

- ``local``: the node's own store actor copies between its tiers and the buffer (shared
  memory it maps); used for what the mapped host tier cannot serve (disk pages) and for
  same-node stores.
- ``tcp``: the peer's page server, no Ray call on the way (:mod:`kvray.cluster.transfer`).
- ``nixl``: Ray's tensor transport with NIXL (RDMA where the NICs have it); loads only,
  stores go by the object store. Between ``tcp`` and ``nixl`` the client takes, per
  peer, whichever has moved pages fastest (:class:`PathSpeeds`).
- ``collective``: the peer store sends into this node's store, which writes the buffer
  (gloo on CPU, NCCL on GPU); loads only, stores go by the object store.
- ``object_store``: pages as Ray objects, returned or passed to the peer store's method.

Same-node host pages bypass all of these: the client copies them out of its mapped host
tier itself (path ``mapped`` in :class:`~kvray.cluster.protocol.Loaded`).
"""

from __future__ import annotations

import glob
import importlib.util
import math
import operator
import os
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Iterable
from typing import Any

import ray

from kvray.cluster.protocol import Arrival, Run, Stored
from kvray.cluster.shm import LandingBuffer
from kvray.cluster.transfer import PeerLinks, PendingLoad, PendingStore, Told
from kvray.core.errors import RequestError
from kvray.core.keys import KEY_BYTES
from kvray.core.tiers import Tier

REMOTE = Tier.REMOTE.label
ACTOR_ERRORS = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError)
# A store's call that raised (disk full, an OSError of its disk tier) is a miss too.
STORE_ERRORS = (*ACTOR_ERRORS, ray.exceptions.RayTaskError)
# A call that ended (it raised, or its process died) can no longer touch the landing buffer,
# unless it raised because a wait of its own timed out (a collective receive it gave up on
# may still land); one given up on (timeout) or unanswered (the actor unavailable) may still.
ENDED = (ray.exceptions.RayTaskError, ray.exceptions.ActorDiedError)


class PathContext:
    """What a transfer path sees of the client it moves pages for: the landing buffer, the
    routes to the stores (this node's store actor, the peers' collective ranks and page
    servers, the TCP links), how long to wait, and where to say what went wrong (a call
    that became a miss, a buffer a call given up on may still use). The client owns one and
    keeps it current (a fresh buffer, new routes); the paths read and report through it,
    and nothing else of the client is theirs to touch.
    """

    def __init__(self, buffer: LandingBuffer, timeout_s: float) -> None:
        self.buffer = buffer
        self.timeout_s = timeout_s
        self.speeds = PathSpeeds()
        self.links: PeerLinks | None = None
        self.local_store: ray.actor.ActorHandle | None = None
        self.ranks: dict[str, int] = {}
        self.servers: dict[str, tuple[str, int]] = {}
        # Calls that became misses, by cause: ``timeout`` (no answer in ``timeout_s``, or the
        # store's own wait on a peer timed out), ``unavailable`` (the actor died or is
        # restarting), ``store_error`` (the store raised).
        self.faults: Counter[str] = Counter()
        self.stale = False  # a call given up on may still copy into or out of ``buffer``
        self.arrival: Arrival | None = None  # the request's, until this node's store has it
        self._peer_arrival: Arrival | None = None  # the request's, for other nodes' stores
        self._told: set[str] = set()  # the peers told of the request so far
        # The request's pages copied from the mapped host tier (packed keys, seconds), for the
        # write to this node's store that follows to report (the client sets it instead of a ``touch``).
        self.hits: tuple[bytes, float] | None = None

    def arrive(self, keys: bytes, backlog_ms: float, arrival_ms: float | None, ends_session_from: int = -1) -> None:
        """A request begins (its packed keys, the engine's backlog, its arrival or None for
        now, its client's end-of-session hint or -1): the first call to each store carries it
        (:meth:`take_arrival`, :meth:`tell_peer`)."""
        if arrival_ms is not None and not math.isfinite(arrival_ms):
            raise RequestError(f"arrival_ms={arrival_ms} must be finite (or None: now)")
        ends_session_from = checked_hint(ends_session_from, len(keys) // KEY_BYTES)
        self.arrival = (keys, float(backlog_ms), arrival_ms, ends_session_from)
        self._peer_arrival = (keys, 0.0, arrival_ms, ends_session_from)  # a peer's queue is not this engine's
        self._told.clear()

    def quiet(self) -> None:
        """A request no store is to be told of by this client's calls (a retried lookup of a
        request told already): nothing to carry, not even the last request's arrival."""
        self.arrival = self._peer_arrival = None

    def tell_peer(self, node: str) -> Arrival | None:
        """The request's arrival for the first call to peer ``node``'s store to carry (once per
        request): the simulator tells every node whose pages a request reads or stores."""
        if self._peer_arrival is None or node in self._told:
            return None
        self._told.add(node)
        return self._peer_arrival

    def take_arrival(self) -> Arrival | None:
        """The request's arrival, for the first call to this node's store to carry (once)."""
        arrival, self.arrival = self.arrival, None
        return arrival

    def take_hits(self) -> tuple[bytes, float] | None:
        """The request's mapped hits, for the first write to this node's store to carry (once)."""
        hits, self.hits = self.hits, None
        return hits

    def count_fault(self, exc: Exception) -> None:
        """A call that became a miss, by cause (see ``faults``)."""
        if isinstance(exc, TimeoutError):  # Ray's GetTimeoutError, or a store's TimeoutError passed on
            self.faults["timeout"] += 1
        elif isinstance(exc, ray.exceptions.RayTaskError):
            self.faults["store_error"] += 1
        else:
            self.faults["unavailable"] += 1

    def buffer_may_be_in_use(self) -> None:
        """A store call given up on may still copy into or out of ``buffer``: the request
        in progress ends on a fresh one (the client renews it at the end of the load or store)."""
        self.stale = True


class StoreCallPath(ABC):
    """A path served by a method of a store actor, answered through ``ray.get``.

    ``between_nodes``: its bytes cross the network (counted in ``bytes_between_nodes``).
    ``load_maps_buffer`` / ``store_maps_buffer``: a store actor writes or reads the client's
    landing buffer itself in a load / a store, so a call given up on may still do so later:
    the client then moves to a fresh buffer (see :mod:`kvray.cluster.client`).
    ``in_order``: two transfers to one store run in the order sent (not so for calls of a
    store actor, which runs several at once).
    """

    name = ""
    in_order = False
    between_nodes = True
    load_maps_buffer = False
    store_maps_buffer = False

    def __init__(self, context: PathContext) -> None:
        self.context = context

    @abstractmethod
    def start_load(self, store, keys: list[int], run: Run) -> Any:
        """Ask for ``keys`` (run ``run`` of a request) without waiting; a pending transfer."""

    @abstractmethod
    def loaded(self, run: Run, answer: Any) -> tuple[int, dict[str, int]]:
        """A finished load's answer as (pages now in the buffer, pages by tier)."""

    def start_store(self, store, keys: list[int], run: Run, parent: int | None, request_pages: int) -> Any:
        """Send ``keys`` (run ``run`` of a request of ``request_pages`` pages, after ``parent``)
        to be stored, without waiting; a pending store."""
        pages = self.context.buffer.pages[run.start : run.stop]
        return store.put_pages.remote(keys, pages, parent, run.place(request_pages), self.context.tell_peer(run.node))

    def finish_load(self, run: Run, pending: Any) -> tuple[int, dict[str, int]]:
        answer = self._answer(pending, self.load_maps_buffer)
        return (0, {}) if answer is None else self.loaded(run, answer)

    def finish_store(self, pending: Any) -> Stored | None:
        """The store's answer (what it stored and holds of the run, the keys it dropped
        meanwhile, its report), or None if nothing was kept."""
        return self._answer(pending, self.store_maps_buffer)

    def abandon(self, pending: Any) -> None:
        """``pending`` will not be finished: an error cut its request short. A store actor's
        call may still run and use the landing buffer, so the client moves to a fresh one
        (:meth:`PathContext.buffer_may_be_in_use`)."""
        self.context.buffer_may_be_in_use()

    def _answer(self, ref, maps_buffer: bool) -> Any:
        try:
            return ray.get(ref, timeout=self.context.timeout_s)
        except STORE_ERRORS as exc:
            self.context.count_fault(exc)
            if maps_buffer and (not isinstance(exc, ENDED) or isinstance(exc, TimeoutError)):
                self.context.buffer_may_be_in_use()
            return None


def abandon_all(started: Iterable[tuple[StoreCallPath, Any]]) -> None:
    """Abandon each transfer ``(path, pending)`` that was sent (:meth:`StoreCallPath.abandon`)."""
    for path, pending in started:
        if pending is not None:
            path.abandon(pending)


class LocalPath(StoreCallPath):
    name = "local"
    between_nodes = False
    load_maps_buffer = store_maps_buffer = True

    def start_load(self, store, keys, run):
        buffer = self.context.buffer
        return store.read_into.remote(keys, buffer.name, buffer.capacity, run.start, self.context.take_arrival())

    def loaded(self, run, answer):
        return answer  # the store copied the pages and says how many, by tier

    def start_store(self, store, keys, run, parent, request_pages):
        buffer = self.context.buffer
        context = self.context
        return store.write_from.remote(
            keys,
            buffer.name,
            buffer.capacity,
            run.start,
            parent,
            context.take_arrival(),
            context.take_hits(),
            run.place(request_pages),
        )


class ObjectStorePath(StoreCallPath):
    name = "object_store"

    def start_load(self, store, keys, run):
        return store.get_pages.remote(keys, self.context.tell_peer(run.node))

    def loaded(self, run, answer):
        self.context.buffer.pages[run.start : run.start + len(answer)] = answer
        return len(answer), {REMOTE: len(answer)}


class CollectivePath(StoreCallPath):
    """Loads by collective send/recv between the stores; stores by the object store."""

    name = "collective"
    load_maps_buffer = True  # this node's store writes the received pages into the buffer

    def start_load(self, store, keys, run):
        context = self.context
        buffer, rank = context.buffer, context.ranks[run.node]
        here, there = context.take_arrival(), context.tell_peer(run.node)
        return context.local_store.pull.remote(keys, store, rank, buffer.name, buffer.capacity, run.start, here, there)

    def loaded(self, run, answer):
        return answer, {REMOTE: answer}


class NixlPath(StoreCallPath):
    """Ray's tensor transport with NIXL: the peer store returns the pages as a tensor
    (``get_pages_nixl``) that this process pulls by NIXL over UCX, which takes RDMA where
    the NICs offer it and TCP elsewhere; stores go by the object store. Any failure of
    the transport (NIXL missing on the peer, an agent that cannot start) is a miss, and
    the client stops choosing this path for that peer (:class:`PathSpeeds`)."""

    name = "nixl"

    def start_load(self, store, keys, run):
        return store.get_pages_nixl.options(tensor_transport="nixl").remote(keys, self.context.tell_peer(run.node))

    def loaded(self, run, answer):
        self.context.buffer.pages[run.start : run.start + len(answer)] = answer.numpy()
        return len(answer), {REMOTE: len(answer)}

    def finish_load(self, run, pending):
        try:
            return super().finish_load(run, pending)
        except Exception as exc:  # noqa: BLE001 - the transport's own errors (NIXL, UCX) are not Ray's
            self.context.count_fault(exc)
            self.context.speeds.failed(run.node, self.name)
            return 0, {}


class TcpPath(StoreCallPath):
    """The peer's page server: the client's own socket, no actor call and no ray.get."""

    name = "tcp"
    in_order = True  # one connection per peer, answered in order

    def loaded(self, run, answer):
        return answer  # finish_load receives straight into the buffer

    def start_load(self, store, keys, run) -> PendingLoad:
        return self.context.links.load(self.context.servers[run.node], keys, _told(self.context.tell_peer(run.node)))

    def finish_load(self, run, pending: PendingLoad):
        got = pending.receive(self.context.buffer.pages[run.start : run.stop])
        return got, {REMOTE: got}

    def start_store(self, store, keys, run, parent, request_pages) -> PendingStore:
        context = self.context
        pages = context.buffer.pages[run.start : run.stop]
        told = _told(context.tell_peer(run.node))
        return context.links.store(context.servers[run.node], keys, pages, parent, run.place(request_pages), told)

    def finish_store(self, pending: PendingStore) -> Stored | None:
        return pending.receive()

    def abandon(self, pending: PendingLoad | PendingStore) -> None:
        pending.abandon()  # this process reads the answer into the buffer: only the link is unsafe


def checked_hint(ends_session_from: object, pages: int) -> int:
    """A request's end-of-session hint as an int: the index of the first of the session's own
    pages this last request ends (0 to ``pages - 1``), or -1 for none; else a RequestError
    naming it, before the request pins or waits on anything."""
    try:
        if isinstance(ends_session_from, bool):
            raise TypeError
        hint = operator.index(ends_session_from)  # an int, a numpy integer
    except TypeError:
        hint = None
    if hint is None or not -1 <= hint < pages:
        raise RequestError(
            f"ends_session_from={ends_session_from!r} must be an int: the first of the session's own pages this "
            f"last request ends, 0 to {pages - 1} for its {pages} pages, or -1 (no hint)"
        )
    return hint


def _told(arrival: Arrival | None) -> Told | None:
    """An arrival as a TELL carries it: keys, time and session-end hint (a peer is told no backlog)."""
    return None if arrival is None else (arrival[0], arrival[2], arrival[3])


PATHS: tuple[type[StoreCallPath], ...] = (LocalPath, TcpPath, NixlPath, CollectivePath, ObjectStorePath)
NIXL_IMPORTABLE = importlib.util.find_spec("nixl") is not None  # the optional extra ``kvray[nixl]``
RDMA_NICS = bool(glob.glob("/sys/class/infiniband/*"))  # verbs devices (InfiniBand, RoCE, EFA) on this node
# NIXL logs at INFO to stdout from its first agent on, which would corrupt a command's JSON output
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
MEASURED_BYTES = 1 << 20  # transfers at least this large say how fast a path is
REMEASURE_EVERY = 32  # one large transfer in this many goes by the runner-up, to notice a change


def nixl_wanted(setting: bool | str) -> bool:
    """Whether NIXL is a candidate path here under ``RuntimeConfig.nixl``: never without the
    ``nixl`` package; with it, always for True, and for ``"auto"`` only on a node with an
    RDMA NIC (where UCX over TCP, all NIXL has without one, rarely beats the page server)."""
    return NIXL_IMPORTABLE and (setting is True or (setting == "auto" and RDMA_NICS))


class PathSpeeds:
    """How fast each direct path (TCP, NIXL) moved pages from each peer, so that the client
    sends a peer's runs by the fastest path that works there, whatever the network is.

    No path is assumed faster: each untried one is tried on a large transfer first, then
    the fastest by a moving average of recent large transfers is chosen, and every
    ``REMEASURE_EVERY``-th large transfer goes by the runner-up so that a change (a
    congested link, a peer restarted) is noticed. A path that failed to a peer is not
    chosen for it again while another works. On this machine UCX runs over TCP and the
    page server wins; a cluster whose NICs do RDMA gets NIXL without a setting.

    Example::

        speeds = PathSpeeds()
        speeds.pick("node-b", ["tcp", "nixl"], 64 << 20)      # "tcp": untried first, in order
        speeds.record("node-b", "tcp", 64 << 20, 0.05)
        speeds.pick("node-b", ["tcp", "nixl"], 64 << 20)      # "nixl": untried
    """

    def __init__(self) -> None:
        self._speed: dict[tuple[str, str], float] = {}  # (peer, path) -> bytes/s, 0 once failed
        self._large: Counter[str] = Counter()

    def pick(self, node: str, candidates: list[str], nbytes: int) -> str:
        """The path for ``nbytes`` from ``node`` among ``candidates`` (in order of preference)."""
        working = [c for c in candidates if self._speed.get((node, c), 1.0) > 0] or candidates
        if len(working) == 1:
            return working[0]
        if nbytes < MEASURED_BYTES:  # too small to measure or to matter: the best known
            return max(working, key=lambda c: self._speed.get((node, c), 0.0))
        untried = [c for c in working if (node, c) not in self._speed]
        if untried:
            return untried[0]
        ranked = sorted(working, key=lambda c: -self._speed[(node, c)])
        self._large[node] += 1
        return ranked[1] if self._large[node] % REMEASURE_EVERY == 0 else ranked[0]

    def record(self, node: str, path: str, nbytes: int, seconds: float) -> None:
        """``nbytes`` arrived from ``node`` by ``path`` in ``seconds``."""
        if nbytes < MEASURED_BYTES or seconds <= 0:
            return
        speed, old = nbytes / seconds, self._speed.get((node, path))
        self._speed[(node, path)] = speed if not old else 0.7 * old + 0.3 * speed

    def failed(self, node: str, path: str) -> None:
        self._speed[(node, path)] = 0.0

    def best(self, node: str, candidates: list[str]) -> str | None:
        """The fastest measured working path among ``candidates``, or None before any measure."""
        known = [c for c in candidates if self._speed.get((node, c), 0.0) > 0]
        return max(known, key=lambda c: self._speed[(node, c)]) if known else None
