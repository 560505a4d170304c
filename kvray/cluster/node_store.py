"""The per-node store actor: one :class:`~kvray.core.store.PageStore` owning a node's tiers.

It is placed on its node with node affinity and is the only process that writes that
node's device, host and disk pools. Its host tier lives in POSIX shared memory beside a
:class:`~kvray.core.tiers.directory.SlotDirectory` it keeps current, so an engine on the same
node (``host_tier`` names the segments) finds and copies host pages itself, with no Ray
call, and only tells the store about the hits afterwards (``touch``, fire-and-forget,
which also forwards the controller's report of a request answered entirely here). The
segments are named afresh by every incarnation of the store, so a client that asks
``host_tier`` now and then never mistakes a restarted store's memory for its
predecessor's. Pages on the local disk tier (or read through the store) and pages
stored move with one call per request (``read_into`` / ``write_from``) between the
store's slots and the engine's :class:`~kvray.cluster.shm.LandingBuffer`, so page bytes
never pass through Ray. Other nodes reach its pages through its page server (direct
TCP, :mod:`kvray.cluster.transfer`), the object store (``get_pages`` returns one
``[n, page_nbytes]`` array, which Ray keeps in the object store and hands over
zero-copy), NIXL (``get_pages_nixl``: the same pages as a tensor for Ray's tensor
transport) or the collective path (a peer's ``pull`` asks this store to ``send_pages``
and receives them straight into its engine's landing buffer).

Every page that leaves this store (evicted past the last tier, corrupt) is remembered and
reported with the next write, so the controller's index never keeps it for long; every
write also answers how much of its run the store holds (a store out of room keeps a
prefix, and the client commits only that) and the node's
:class:`~kvray.cluster.observe.NodeReport` (free slots per tier, bytes per link), which
the controller's cluster policy decides from. The first
call an engine on this node makes for a request (``read_into``, ``write_from``, ``pull``
or ``touch``) carries the request's arrival (its keys and the engine's backlog), and the
store tells its placement policy (``on_request``) before anything else of that request; so
does the first call of another node's engine that reads or writes pages here (a TCP TELL,
or ``request`` on the Ray calls; backlog 0: that engine's queue is not this node's), as the
simulator tells a source or target node. A TCP read answers before its policy work runs
(:mod:`kvray.cluster.after_answer`). A store
that restarts (``max_restarts``) rebuilds its disk tier from the slot file and tells the
controller which pages survived. A controller that restarts asks every store for its
``holdings`` (each page with its parent in the request chain) and rebuilds its index from
them, so the store remembers the chain parent of each run written to it.

An engine that gave up on a call (it timed out) stops using that landing buffer and
``release_buffer``s it; a copy still running on it keeps its mapping until it returns,
and only then is it unmapped (:meth:`NodeStore._close_released`). ``inject_faults`` is a
test hook (the tests and ``kvray.apps.soak`` only): it delays, or fails, the next
copies between landing buffers and the tiers, as a slow or failing disk would.

Example::

    store = NodeStoreActor.options(scheduling_strategy=on_node(node_id)).remote(config, node_id)
    ray.get(store.write_from.remote(keys, buf.name, buf.capacity, 0))
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
import ray

from kvray.cluster.after_answer import AfterAnswer
from kvray.cluster.config import NAMESPACE, RuntimeConfig, controller_name
from kvray.cluster.metrics import export_store_stats
from kvray.cluster.observe import NodeReport
from kvray.cluster.protocol import Arrival, Stored
from kvray.cluster.shm import LandingBuffer, reap_orphans
from kvray.cluster.store_waits import InjectedFaults, within
from kvray.cluster.transfer import PageServer, Told
from kvray.core.keys import unpack_keys
from kvray.core.placement import RequestInfo, RunPlace
from kvray.core.store import PageStore
from kvray.core.tiers import LOCAL_TIERS, Tier
from kvray.core.tiers.directory import retire_predecessors

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)
COLLECTIVE_GROUP = "kvray-pages"
STORE_RESTARTS = 3  # how often Ray restarts a store actor that died


class NodeStore:
    """Owns one node's tiers; see the module docstring."""

    def __init__(self, config: RuntimeConfig, node_id: str | None, controller: str, token: bytes | None = None) -> None:
        """``node_id`` None: wherever Ray placed it (by ``store_resources``, e.g. on a node the
        autoscaler launched for it). ``token``: the runtime's transfer secret; with it the
        store serves its pages to peers over TCP (:mod:`kvray.cluster.transfer`)."""
        self.config = config
        self.node_id = node_id = node_id or ray.get_runtime_context().get_node_id()
        prefix = f"kvray_{config.name}_{node_id[:16]}_"  # one store per runtime and node at a time
        retire_predecessors(prefix)  # an earlier incarnation's segments, killed before it could close them
        self.host_name = prefix + secrets.token_hex(4)  # new per incarnation
        self.store = PageStore(
            config.store_config(node_id, self.host_name if config.tiers.host else None), config.make_placement_policy()
        )
        costs = config.tier_costs()
        self.tier_cost = None if costs is None else {t: c for t, c in costs.items() if t in self.store.manager.slots}
        self.page_nbytes = config.layout.page_nbytes
        self._dropped: list[int] = []
        self._dropped_lock = threading.Lock()
        self.store.on_page_dropped(self._on_drop)
        self._buffers: dict[str, LandingBuffer] = {}
        self._buffers_lock = threading.Lock()
        self._in_use: Counter[str] = Counter()  # buffer name -> copies in flight
        self._released: dict[str, LandingBuffer] = {}  # released by their engine while a copy still ran
        self._faults = InjectedFaults()
        self._rank: int | None = None
        self._broken_ranks: set[int] = set()  # peers whose collective receive timed out: their pairs are out of step
        self._run_parents: dict[int, int | None] = {}  # first key of a run -> the key before it in its chain
        self._peer_locks: dict[int, threading.Lock] = {}
        # shard 0's name (``controller``), then the other shards' (kvray.cluster.shards)
        self._controller_names = [controller, *(controller_name(config.name, s) for s in range(1, config.controller_shards))]
        self._controller_handles: dict[int, ray.actor.ActorHandle] = {}
        self.sent_bytes = 0
        self.received_bytes = 0
        self._bytes_lock = threading.Lock()  # up to max_concurrency calls count at once
        self._server = None
        self._after = AfterAnswer()
        if token is not None:
            self._server = PageServer(
                self._serve_read,
                lambda keys, rows, parent, place, told: self._put(keys, rows, parent, place, _peer(told)),
                self.page_nbytes,
                token,
                ray.util.get_node_ip_address(),
                config.max_request_pages,
                keepalive=config.keepalive,
                request_s=config.peer_timeout_s,
                answered=self._after.run,
            )
        context = ray.get_runtime_context()
        self.restarted = context.was_current_actor_reconstructed
        if self.restarted:  # the disk tier survived; the host tier and collective rank did not
            self._register(context.current_actor)

    def _register(self, me) -> None:
        """Tell every controller shard this restarted store is back, with the pages its disk kept.

        Bounded: if a shard is down or slow, its rebuild (or the loss reports of
        engines that miss here) brings its index in line instead.
        """
        kept = self.store.cached_keys()
        for shard in range(len(self._controller_names)):
            try:
                ray.get(
                    self._controller(shard).register_store.remote(self.node_id, me, None, kept, self.server_address()),
                    timeout=self.config.peer_timeout_s,
                )
            except (ValueError, ray.exceptions.RayError) as exc:
                logger.warning(
                    "restarted store %s could not register with controller shard %d: %s", self.node_id[:12], shard, exc
                )

    # -- bookkeeping -----------------------------------------------------------------
    def _on_drop(self, key: int) -> None:
        with self._dropped_lock:
            self._dropped.append(key)
            self._run_parents.pop(key, None)

    def _stored(self, keys: Sequence[int], stored: int, parent: int | None) -> Stored:
        """Remember the chain parent of a run that landed; the reply of a write."""
        if stored:
            with self._dropped_lock:
                self._run_parents[keys[0]] = parent
        return Stored(stored, self._held_prefix(keys), self._take_dropped(), self.report())

    def _held_prefix(self, keys: Sequence[int]) -> int:
        """How many leading ``keys`` of a run just written this store holds: the part of the
        run the client may commit. Counted page by page, not by the index's binary search:
        a page past one that was refused may be held as the root of an earlier run, so the
        pages held need not be prefix-closed within this run."""
        held = 0
        for key in keys:
            if key not in self.store:
                break
            held += 1
        return held

    def report(self) -> NodeReport:
        """Free and total slots per tier, and the bytes each link carried so far."""
        traffic = self.store.traffic()
        pages = {t: traffic[t][2] + traffic[t][3] for t in LOCAL_TIERS}
        server = self._server
        with self._bytes_lock:
            nic_in = self.received_bytes + (server.received_bytes if server else 0)
            nic_out = self.sent_bytes + (server.sent_bytes if server else 0)
        nbytes = self.page_nbytes
        return NodeReport(
            tuple(traffic[t][0] for t in LOCAL_TIERS),
            tuple(traffic[t][1] for t in LOCAL_TIERS),
            (nic_in, nic_out, pages[Tier.DEVICE] * nbytes, traffic[Tier.DISK][2] * nbytes, traffic[Tier.DISK][3] * nbytes),
        )

    def _arrived(self, request: Arrival | None) -> None:
        """A request's first call here: tell the policy it arrived (``request``: its packed
        keys, the engine's backlog in ms and its arrival time in ms, None for now on this
        node's clock; a replay gives the trace's, the clock the simulator's policies see;
        None: told already, or not this call's to tell). First, what a page server's read left
        queued (:mod:`kvray.cluster.after_answer`): every call that reaches the store comes here."""
        self._after.run()
        self._tell(request)

    def _tell(self, request: Arrival | None) -> None:
        """:meth:`_arrived` without running the queued work (which runs this one)."""
        if request is not None:
            keys, backlog_ms, arrival_ms, ends_from = request
            self.store.on_request(
                RequestInfo(
                    tuple(unpack_keys(keys)),
                    backlog_ms,
                    self.tier_cost,
                    arrival_ms=time.monotonic() * 1000.0 if arrival_ms is None else arrival_ms,
                    page_prefill_ms=self.config.page_prefill_ms or 0.0,
                    engines=self.config.prefill_engines,
                    ends_session_from=ends_from,
                )
            )

    def _take_dropped(self) -> list[int]:
        with self._dropped_lock:
            dropped, self._dropped = self._dropped, []
        return dropped

    @contextlib.contextmanager
    def _mapped(self, name: str, capacity: int) -> Iterator[np.ndarray]:
        """An engine's landing buffer, mapped once and marked in use while the caller copies.

        Under a lock: two threads mapping the same new buffer would leave one mapping
        unreferenced, and its collection unmaps memory the other thread is copying; and
        the reaping of dead engines' buffers must skip the ones in use.
        """
        with self._buffers_lock:
            self._close_released()
            buf = self._buffers.get(name)
            if buf is None:
                reap_orphans(self._buffers, self._in_use)  # a new engine here: a good moment to forget dead ones
                buf = self._buffers[name] = LandingBuffer.attach(name, capacity, self.page_nbytes)
            self._in_use[name] += 1
        try:
            self._faults.apply()  # mapped and in use: a delayed copy lands in this mapping
            yield buf.pages
        finally:
            with self._buffers_lock:
                self._in_use[name] -= 1
                if not self._in_use[name]:
                    del self._in_use[name]

    def info(self) -> dict:
        """Node id, whether this incarnation is a restart, and the pages it holds."""
        return {
            "node_id": self.node_id,
            "restarted": self.restarted,
            "keys": self.store.cached_keys(),
            "tiers": self.config.tiers.model_dump(),
        }

    def holdings(self) -> dict:
        """What a restarted controller rebuilds its index from: this node, its collective
        rank, and ``(key, parent key or None)`` of each page whose place in its chain is known.

        Pages recovered from disk after this store restarted start runs whose chain parent
        died with the old process; they (and pages after them) are left out: misses, never wrong KV.
        """
        with self._dropped_lock:
            run_parents = dict(self._run_parents)
        pages = []
        for key, parent in self.store.chain_links():
            if parent is not None:
                pages.append((key, parent))
            elif key in run_parents:
                pages.append((key, run_parents[key]))
        return {"node_id": self.node_id, "rank": self._rank, "server": self.server_address(), "pages": pages}

    # -- same-node data plane -----------------------------------------------------------
    def read_into(
        self, keys: Sequence[int], buffer: str, capacity: int, row: int, request: Arrival | None = None
    ) -> tuple[int, dict[str, int]]:
        """Copy the cached, verified prefix of ``keys`` into buffer rows ``row..`` (``request``:
        see :meth:`_arrived`)."""
        self._arrived(request)
        with self._mapped(buffer, capacity) as pages:
            return self._read(keys, lambda i: pages[row + i])

    def write_from(
        self,
        keys: Sequence[int],
        buffer: str,
        capacity: int,
        row: int,
        parent: int | None = None,
        request: Arrival | None = None,
        hits: tuple[bytes, float] | None = None,
        place: RunPlace | None = None,
    ) -> Stored:
        """Store buffer rows ``row..`` as one chain under ``keys`` (``parent``: the key before
        ``keys[0]`` in the request, None at its start); returns what was stored and is held
        of it, the keys dropped since the last report and this node's report
        (:class:`~kvray.cluster.protocol.Stored`). ``request``: see :meth:`_arrived`.
        ``hits``: the request's pages copied from the mapped host tier and how long that
        took, counted first as :meth:`touch` counts them (the engine sends them here
        rather than in a touch of their own when it writes to this node next). ``place``:
        where the run sits in its request (:class:`~kvray.core.placement.RunPlace`)."""
        self._arrived(request)
        if hits is not None:
            self.store.touch_pages(unpack_keys(hits[0]), hits[1])
        with self._mapped(buffer, capacity) as pages:
            return self._put(keys, pages[row : row + len(keys)], parent, place)

    def _read(self, keys: Sequence[int], targets, hits: bool = True) -> tuple[int, dict[str, int]]:
        """``PageStore.read_pages``, where a page evicted here but still in the controller's
        index (the report is on its way) makes the run a miss rather than an error."""
        try:
            return self.store.read_pages(keys, targets, hits)
        except KeyError:
            return 0, {}

    def _serve_read(self, keys: Sequence[int], rows: np.ndarray, told: Told | None) -> int:
        """A peer's TCP read: copy the pages; the policy hears of the request (``told``) and of
        the hits after the answer is sent (:mod:`kvray.cluster.after_answer`)."""
        self._after.run()
        began = time.perf_counter()
        got, _ = self._read(keys, lambda i: rows[i], hits=False)
        load_s = time.perf_counter() - began
        if told is not None:
            self._after.add(lambda: self._tell(_peer(told)))
        self._after.add(lambda: self.store.touch_pages(keys[:got], load_s, looked_up=True))
        return got

    def server_address(self) -> tuple[str, int] | None:
        """Where this store's page server listens (None: it serves no TCP peers)."""
        return self._server.address if self._server else None

    def host_tier(self) -> dict | None:
        """What an engine on this node maps to read the host tier itself (None: no host tier)."""
        if self.store.directory is None:
            return None
        return {"name": self.host_name, "capacity": self.config.tiers.host, "page_nbytes": self.page_nbytes}

    def touch(
        self,
        keys: bytes,
        report: tuple | None = None,
        request: Arrival | None = None,
        shard: int = 0,
        load_s: float | None = None,
    ) -> None:
        """An engine copied the prefix ``keys`` (:func:`~kvray.core.keys.pack_keys`) out of the shared
        host tier in ``load_s`` seconds: count the hits (recency, heat, promotions) and the
        load (bytes, latency), and pass ``report`` (the arguments of the controller's
        ``release``) on to controller shard ``shard``. ``request``: see :meth:`_arrived`."""
        self._arrived(request)
        if keys:
            self.store.touch_pages(unpack_keys(keys), load_s)
        if report is not None:
            self._controller(shard).release.remote(*report)

    def _controller(self, shard: int):
        if shard not in self._controller_handles:
            self._controller_handles[shard] = ray.get_actor(self._controller_names[shard], namespace=NAMESPACE)
        return self._controller_handles[shard]

    def release_buffer(self, buffer: str) -> None:
        """The engine is done with ``buffer`` (it closed, or gave up on a call still copying)."""
        with self._buffers_lock:
            buf = self._buffers.pop(buffer, None)
            if buf is not None:
                self._released[buffer] = buf
            self._close_released()

    def _close_released(self) -> None:
        """Unmap released buffers no copy uses any more (under ``_buffers_lock``). A copy
        that just finished may still hold a view for a moment: then a later call does it."""
        for name in [n for n, buf in self._released.items() if not self._in_use[n] and not buf.views_out]:
            self._released.pop(name).close()

    def inject_faults(self, delay_s: float = 0.0, fail: bool = False, calls: int = 1) -> None:
        """Test hook: the next ``calls`` copies between a landing buffer and the tiers
        (``read_into``, ``write_from``, a ``pull``'s receive) first sleep ``delay_s``, then,
        with ``fail``, raise ``OSError`` as a failing disk would."""
        self._faults.arm(delay_s, fail, calls)

    def _count_bytes(self, sent: int = 0, received: int = 0) -> None:
        with self._bytes_lock:
            self.sent_bytes += sent
            self.received_bytes += received

    # -- cross-node data plane: object store ----------------------------------------------
    def get_pages(self, keys: Sequence[int], request: Arrival | None = None) -> np.ndarray:
        """The cached, verified prefix of ``keys`` as one array (travels by object store;
        ``request``: see :meth:`_arrived`)."""
        self._arrived(request)
        pages = np.empty((len(keys), self.page_nbytes), dtype=np.uint8)
        got, _ = self._read(keys, lambda i: pages[i])
        self._count_bytes(sent=got * self.page_nbytes)
        return pages[:got]

    def put_pages(
        self,
        keys: Sequence[int],
        pages: np.ndarray,
        parent: int | None = None,
        place: RunPlace | None = None,
        request: Arrival | None = None,
    ) -> Stored:
        self._count_bytes(received=pages.nbytes)
        return self._put(keys, pages, parent, place, request)

    def _put(
        self,
        keys: Sequence[int],
        pages: np.ndarray,
        parent: int | None,
        place: RunPlace | None = None,
        request: Arrival | None = None,
    ) -> Stored:
        """Store one run. It joins its parent's chain when that page is here, so evicting the
        parent drops the run too (as in the simulator and a single PageStore); otherwise it
        starts a root here. Either way its pages keep their depths in the request (``place``),
        as the simulator's nodes store a chain spread over them. ``request``: see :meth:`_arrived`."""
        self._arrived(request)
        local = parent if parent is not None and parent in self.store else None
        stored = self.store.put_pages(keys, pages, self.store.fingerprint.digest, local, place)
        return self._stored(keys, stored, parent)

    # -- cross-node data plane: NIXL (Ray's tensor transport) ------------------------------
    def get_pages_nixl(self, keys: Sequence[int], request: Arrival | None = None) -> torch.Tensor:
        """:meth:`get_pages` as a tensor Ray's tensor transport hands over by NIXL: the
        caller pulls the bytes out of this process's memory (RDMA where the NICs have it,
        UCX's TCP otherwise); only metadata goes through Ray. The caller asks for the
        transport (``.options(tensor_transport="nixl")``, :class:`~kvray.cluster.paths.NixlPath`):
        naming it here, with ``@ray.method``, would import torch with this module."""
        import torch  # here, not with the module: a store without NIXL or a collective never loads it

        return torch.from_numpy(self.get_pages(keys, request))

    # -- cross-node data plane: collective -------------------------------------------------
    def init_collective(self, world_size: int, rank: int, backend: str = "gloo") -> int:
        from ray.util import collective

        gloo_timeout_ms = int(self.config.start_timeout_s * 1000)  # the rendezvous; the runtime's start bounds the rest
        collective.init_collective_group(
            world_size, rank, backend=backend, group_name=COLLECTIVE_GROUP, gloo_timeout=gloo_timeout_ms
        )
        self._rank = rank
        return rank

    def send_pages(self, keys: Sequence[int], dst_rank: int, request: Arrival | None = None) -> int:
        """Send the cached prefix of ``keys`` to ``dst_rank``: a page count, then the pages
        (waiting at most ``peer_timeout_s`` for the peer to take them).

        Only a peer's :meth:`pull` calls this, so sends to one peer never interleave.
        """
        import torch
        from ray.util import collective

        pages = self.get_pages(keys, request)

        def send() -> None:
            collective.send(torch.tensor([len(pages)], dtype=torch.int64), dst_rank, COLLECTIVE_GROUP)
            if len(pages):
                collective.send(torch.from_numpy(pages), dst_rank, COLLECTIVE_GROUP)

        within(self.config.peer_timeout_s, f"the collective send to rank {dst_rank}", send)
        return len(pages)

    def pull(
        self,
        keys: Sequence[int],
        source,
        src_rank: int,
        buffer: str,
        capacity: int,
        offset: int,
        request: Arrival | None = None,
        source_request: Arrival | None = None,
    ) -> int:
        """Have ``source`` send the cached prefix of ``keys`` and receive it into buffer rows
        ``offset..`` (``request``, ``source_request``: this store's and the source's, see
        :meth:`_arrived`).

        One pull per source at a time (a lock per peer): gloo matches sends and receives
        of a pair in order, so two transfers between the same pair must not overlap. The
        receive waits at most ``peer_timeout_s`` (a TimeoutError naming the peer); one that
        failed leaves the pair out of step (a send may still arrive for it), so pulls from
        that peer take the object store from then on.
        """
        self._arrived(request)
        with self._peer_locks.setdefault(src_rank, threading.Lock()):
            if src_rank in self._broken_ranks:
                return self._pull_by_object_store(keys, source, buffer, capacity, offset, source_request)
            sent = source.send_pages.remote(list(keys), self._rank, source_request)
            try:
                n = within(
                    self.config.peer_timeout_s,
                    f"the collective receive from rank {src_rank}",
                    lambda: self._receive(src_rank, buffer, capacity, offset),
                )
            except BaseException:
                self._broken_ranks.add(src_rank)
                raise
            ray.get(sent, timeout=self.config.peer_timeout_s)
        self._count_bytes(received=n * self.page_nbytes)
        return n

    def _receive(self, src_rank: int, buffer: str, capacity: int, offset: int) -> int:
        """The receiving half of :meth:`pull`: a page count from ``src_rank``, then that many
        pages into buffer rows ``offset..``. On a thread of its own (:func:`~kvray.cluster.store_waits.within`), which
        holds the buffer mapped from the start, however late the pages come."""
        import torch
        from ray.util import collective

        with self._mapped(buffer, capacity) as pages:
            count = torch.zeros(1, dtype=torch.int64)
            collective.recv(count, src_rank, COLLECTIVE_GROUP)
            n = int(count.item())
            if n:
                collective.recv(torch.from_numpy(pages[offset : offset + n]), src_rank, COLLECTIVE_GROUP)
        return n

    def _pull_by_object_store(
        self, keys: Sequence[int], source, buffer: str, capacity: int, offset: int, source_request: Arrival | None
    ) -> int:
        """:meth:`pull` from a peer whose collective pair is out of step: the pages come by
        the object store instead."""
        pages = ray.get(source.get_pages.remote(list(keys), source_request), timeout=self.config.peer_timeout_s)
        with self._mapped(buffer, capacity) as rows:
            rows[offset : offset + len(pages)] = pages
        self._count_bytes(received=pages.nbytes)
        return len(pages)

    # -- state ----------------------------------------------------------------------------
    def stats(self) -> dict:
        self._after.run()
        with self._buffers_lock:
            self._close_released()
            reap_orphans(self._buffers, self._in_use)
        stats = self.store.stats()
        stats.update(
            node_id=self.node_id,
            pages=len(self.store),
            sent_bytes=self.sent_bytes + (self._server.sent_bytes if self._server else 0),
            tcp_rejected=self._server.rejected if self._server else 0,
            tcp_corrupt=self._server.corrupt if self._server else 0,
            received_bytes=self.received_bytes + (self._server.received_bytes if self._server else 0),
            landing_buffers=len(self._buffers) + len(self._released),  # mapped here, released or not
            restarted=self.restarted,
            time=time.time(),
        )
        export_store_stats(self.node_id[:12], stats)
        return stats

    def ping(self) -> str:
        return self.node_id

    def set_disk_write_budget(self, bytes_per_s: float | None) -> None:
        """The cluster policy's ``disk_write_budget`` for this node (the controller sends it)."""
        self.store.set_disk_write_budget(bytes_per_s)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for buf in [*self._buffers.values(), *self._released.values()]:
            buf.close()
        self._buffers.clear()
        self._released.clear()
        self.store.close()


def _peer(told: Told | None) -> Arrival | None:
    """A TELL's request as :meth:`NodeStore._arrived` takes it: another node's engine, whose
    backlog is not this node's (0, as a quiet node's)."""
    return None if told is None else (told[0], 0.0, told[1], told[2])


NodeStoreActor = ray.remote(max_restarts=STORE_RESTARTS, max_task_retries=0, max_concurrency=8, enable_tensor_transport=True)(
    NodeStore
)
