"""The controller actor: the cluster's metadata, and no page bytes.

It keeps the global prefix index (:class:`~kvray.core.index.PrefixIndex`, with each page's
node in the ``node`` column), the heat of every page, pins of pages being read, and what
it observes of every node (:mod:`kvray.cluster.observe`: engine backlogs, free tier
shares, link utilisations). The node of each new page is the runtime's cluster policy's
choice (:class:`~kvray.policy.cluster.ClusterPolicy` ``place``, asked with a
:class:`~kvray.policy.cluster.RequestView` and a :class:`~kvray.policy.cluster.ClusterView`
built from those observations; by default ``local-first``: the requesting engine's node
when the request fits there, otherwise spread by a hash ring). Engines talk to
it at most once per request (``lookup_pin`` answers the cached prefix, where each page lives
and where each missing page should go) and report back without waiting (``release``,
``commit``). A request whose pages all sit in the engine's own node's host tier never
reaches ``lookup_pin``: the client answers it from that tier's slot directory (lease
``LOCAL_LEASE``), and its ``release`` arrives through the node's store. Page bytes move
between engines and store actors only.

The index is kept honest three ways: stores report pages they evicted with every write;
an engine reports pages the index promised but a store no longer had; a node that leaves
has all its locations dropped (``remove_node``), and a store that restarts re-announces
the pages its disk tier kept.

The controller itself may die: Ray restarts it (``max_restarts``), and the new incarnation
finds the runtime's store actors by name and rebuilds membership and index from what they
hold (:meth:`Controller.rebuild`) before it answers anyone. Leases and pins of the old
incarnation are gone; clients treat a request that meets the outage as a miss.

A runtime with ``controller_shards`` > 1 runs one controller per shard: each is this class
over its :class:`~kvray.core.partition.Partition` (the chains whose root page hashes to it),
with every store registered at each; clients route each request to its chain's shard
(:mod:`kvray.cluster.shards`), and a restarted shard rebuilds only the chains it owns.

Before a request is served, the replay's driver (or any front end) asks ``decide``: the
cluster policy's ``route``, ``load_pages``, ``prefetch`` and ``replicate`` for it, from the
same views the simulator builds (:class:`~kvray.cluster.protocol.Decision`); the serving
engine executes them. A replica (a copy of a hit chain on a node ``replicate`` named) is indexed as
a page's second location: lookups from that node find it there first, as the simulator's
holders do, and a page evicted from one location keeps the others.

Leases are named by the client (:func:`~kvray.cluster.protocol.new_lease`), so a client whose ``lookup_pin``
timed out can still end the pins that call may have taken, and every lease expires after
``RuntimeConfig.lease_ttl_s``: a client that dies between ``lookup_pin`` and ``release``
holds its pages for that long at most. A page dropped while pinned waits, invisible to
lookups ("doomed"), until its last lease ends; pins only guard this forgetting (stores
verify every page they return), so a lease that expired under a slow reader costs it
misses, never wrong KV.

Example::

    lease = new_lease()
    plan = ray.get(controller.lookup_pin.remote(keys, my_node, lease))
    plan.hit_nodes          # node of each cached page, root first
    plan.targets            # node for each page still to store
    controller.release.remote(lease, {"host": 3}, lost={})
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence

import numpy as np
import ray

from kvray.cluster.config import NAMESPACE, RuntimeConfig, store_name
from kvray.cluster.metrics import export_cluster_stats
from kvray.cluster.observe import ClusterObservations, NodeReport
from kvray.cluster.protocol import LOCAL_LEASE, Decision, Plan, Release, new_lease
from kvray.core.errors import ConfigError, PolicyError
from kvray.core.index import ROOT, PrefixIndex, parents_first
from kvray.core.keys import unpack_keys
from kvray.core.partition import Partition, owned_links
from kvray.core.write_budget import checked_rate
from kvray.policy.cluster import ClusterView, RequestView

NO_NODE = -1
REBUILD_WAIT_S = 10.0  # how long a restarted controller waits for each store's holdings


class Controller:
    """Global prefix index, page locations, heat, pins and placement; see the module doc."""

    def __init__(self, config: RuntimeConfig, token: bytes | None = None, shard: int = 0) -> None:
        self.config = config
        self.partition = Partition(shard, config.controller_shards, config.controller_route_depth)
        self.token = token  # the transfer secret, for this runtime's stores and clients only
        self.servers: dict[str, tuple[str, int]] = {}
        self.index = PrefixIndex()
        self.policy = config.make_cluster_policy()
        tiers = config.tiers.model_dump()
        self.observed = ClusterObservations(
            config.links, config.observe_window_s, empty={tier: 1.0 for tier, pages in tiers.items() if pages}
        )
        self.node_ids: list[str] = []
        self._node_ix: dict[str, int] = {}
        self.stores: dict[str, ray.actor.ActorHandle] = {}
        self.ranks: dict[str, int] = {}
        # lease -> (expiry on the monotonic clock, pinned handles); every lease lives
        # lease_ttl_s, so insertion order is expiry order and expiring is popping the front.
        self._leases: OrderedDict[int, tuple[float, np.ndarray]] = OrderedDict()
        self._doomed: set[int] = set()
        self.expired_leases = 0
        self.lookups = 0
        self.replicas: dict[int, list[int]] = {}  # handle -> nodes holding a copy besides index.node's
        self.disk_budgets: dict[str, float | None] = {}  # node -> the NVMe write budget its store was last sent
        tiers_held = [tier for tier, pages in tiers.items() if pages]
        # the tier every cached page is in when nodes have one tier (else unknown: the index keeps nodes only)
        self._only_tier = tiers_held[0] if len(tiers_held) == 1 else None
        self.local_lookups = 0  # requests clients answered from their own node's host tier
        self.lookup_pages = 0
        self.hit_pages: Counter = Counter()
        self.bytes_between_nodes = 0
        self.lost_pages = 0
        self.rebuilt_pages = 0
        self.rebuild_s = 0.0
        # In a driver without Ray too (benchmarks weigh a controller in-process): asking for
        # the runtime context there would start Ray.
        if ray.is_initialized():
            context = ray.get_runtime_context()
            if context.get_actor_id() is not None and context.was_current_actor_reconstructed:
                self.rebuild()

    def rebuild(self) -> int:
        """Recover membership and index (this shard's chains) from the live store actors;
        returns pages indexed.

        A page goes back only under its parent (roots first), so the index stays
        prefix-closed; a store that does not answer within ``REBUILD_WAIT_S`` stays out
        (its pages are misses until it registers again).
        """
        t0 = time.perf_counter()
        prefix = store_name(self.config.name, "")
        stores = []
        for actor in ray.util.list_named_actors(all_namespaces=True):
            if actor["namespace"] == NAMESPACE and actor["name"].startswith(prefix):
                try:
                    stores.append(ray.get_actor(actor["name"], namespace=NAMESPACE))
                except ValueError:
                    continue  # stopped since it was listed
        refs = [store.holdings.remote() for store in stores]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=REBUILD_WAIT_S)
        links = []
        for store, ref in zip(stores, refs):
            try:
                held = ray.get(ref) if ref in ready else None
            except ray.exceptions.RayError:
                held = None  # dying or restarting: it re-registers when it is back
            if held is not None:
                self.register_store(held["node_id"], store, held["rank"], server=held["server"])
                links.extend((key, parent, held["node_id"]) for key, parent in held["pages"])
        ordered, _ = parents_first(links)  # pages whose chain lost its root stay out: misses
        for key, parent_key, node in owned_links(ordered, self.partition):
            if self.index.handle_of(key) is not None:
                continue  # the same page on two nodes: one location is enough
            parent = ROOT if parent_key is None else self.index.handle_of(parent_key)
            depth = 0 if parent == ROOT else int(self.index.depth[parent]) + 1
            self.index.add(key, parent=parent, depth=depth, node=self._node_ix[node])
        self.rebuilt_pages = len(self.index)
        self.rebuild_s = time.perf_counter() - t0
        return self.rebuilt_pages

    # -- membership ---------------------------------------------------------------------
    def register_store(
        self,
        node_id: str,
        store: ray.actor.ActorHandle,
        rank: int | None = None,
        kept_keys: Sequence[int] | None = None,
        server: tuple[str, int] | None = None,
    ) -> None:
        """Add a node's store (``server``: its page server's address, if any); with
        ``kept_keys`` (a restart) forget what it no longer holds."""
        if node_id not in self._node_ix:
            self._node_ix[node_id] = len(self.node_ids)
            self.node_ids.append(node_id)
        self.stores[node_id] = store
        self.disk_budgets.pop(node_id, None)  # a restarted store starts without one: sent again when asked
        if rank is None:
            self.ranks.pop(node_id, None)  # a restarted store is outside the collective group
        else:
            self.ranks[node_id] = rank
        if server is None:
            self.servers.pop(node_id, None)
        else:
            self.servers[node_id] = tuple(server)
        if kept_keys is not None:
            kept = set(kept_keys)
            self._drop_where(self._on_node(node_id), lambda h: self.index.key_of(h) not in kept)

    def remove_node(self, node_id: str) -> int:
        """A node left: drop every page located there; returns how many."""
        self.stores.pop(node_id, None)
        self.ranks.pop(node_id, None)
        self.servers.pop(node_id, None)
        self.observed.forget(node_id)
        if node_id not in self._node_ix:
            return 0
        ix = self._node_ix[node_id]
        for handle in [h for h, copies in self.replicas.items() if ix in copies]:
            self._lose(handle, ix)
        return self._drop_where(self._on_node(node_id), lambda h: True)

    def runtime_config(self) -> RuntimeConfig:
        return self.config

    def members(self) -> dict:
        """Live stores, their collective ranks and page servers, and the transfer token
        (what clients route by)."""
        return {"stores": dict(self.stores), "ranks": dict(self.ranks), "servers": dict(self.servers), "token": self.token}

    def _handles(self) -> np.ndarray:
        return np.fromiter(map(self.index.handle_of, self.index.keys()), dtype=np.int64, count=len(self.index))

    def _on_node(self, node_id: str) -> np.ndarray:
        handles = self._handles()
        return handles[self.index.node[handles] == self._node_ix[node_id]]

    def _drop_where(self, handles: np.ndarray, condition) -> int:
        before = len(self.index)
        for handle in handles.tolist():
            if self._indexed(handle) and condition(handle):
                self._lose(handle, int(self.index.node[handle]))
        dropped = before - len(self.index)
        self.lost_pages += dropped
        return dropped

    def _indexed(self, handle: int) -> bool:
        try:
            self.index.key_of(handle)
        except KeyError:
            return False  # went with an ancestor dropped earlier in the same sweep
        return True

    def _lose(self, handle: int, ix: int) -> None:
        """Node ``ix`` no longer holds the page: a copy elsewhere becomes its location (the
        oldest replica), or, when none is left, the page is forgotten with its descendants."""
        copies = self.replicas.get(handle)
        if int(self.index.node[handle]) == ix:
            if not copies:
                self._drop(handle)
                return
            self.index.move(handle, int(self.index.tier[handle]), int(self.index.slot[handle]), node=copies.pop(0))
        elif copies and ix in copies:
            copies.remove(ix)
        if copies is not None and not copies:
            del self.replicas[handle]

    def _drop(self, handle: int) -> None:
        """Forget a page and its descendants (they can never match without it).

        If a reader holds any of them, the whole subtree waits in ``_doomed`` (invisible to
        lookups) until its last lease ends. A lease pins a whole chain from the root, so a
        pinned descendant means ``handle`` itself is pinned, and the lease that ends last
        passes through ``handle`` (:meth:`_end`).
        """
        try:
            removed = self.index.remove_subtree(handle)
        except ValueError:  # a reader holds one of them
            self._doomed.add(handle)
            return
        self._doomed.difference_update(removed)  # their handles may be reused by new pages
        if self.replicas:
            for gone in removed:
                self.replicas.pop(gone, None)

    def _end(self, handles: np.ndarray) -> None:
        """Unpin a lease's chain and drop the doomed pages on it that no lease holds any more:
        the work is the chain's length, whatever the number of leases or doomed pages."""
        self.index.unpin(handles)
        if self._doomed:
            for handle in handles.tolist():  # root first: an ancestor's drop takes its doomed descendants
                if handle in self._doomed and not self.index.pins[handle]:
                    self._doomed.discard(handle)
                    self._drop(handle)

    def _expire(self) -> None:
        """End the leases whose time is up (a client that died or gave up without ``release``)."""
        now = time.monotonic()
        while self._leases:
            lease, (deadline, handles) = next(iter(self._leases.items()))
            if deadline > now:
                return
            del self._leases[lease]
            self.expired_leases += 1
            self._end(handles)

    # -- the per-request verbs ----------------------------------------------------------------
    def lookup_pin(
        self, keys: Sequence[int] | bytes, requester: str | None, lease: int | None = None, backlog_ms: float = 0.0
    ) -> Plan:
        """Cached prefix of ``keys`` (pinned under ``lease``, drawn here if None) and a node
        for each missing page, by the cluster policy. A ``lease`` still open is ended first:
        an id pins one chain. ``backlog_ms``: the requesting engine's queued work.

        ``keys`` may come packed (:func:`~kvray.core.keys.pack_keys`), as clients send them:
        Ray serializes a list of 128-bit ints one int at a time, which made a 1M-token
        prefix's lookup (7,812 keys) 50 ms where the lookup and pin themselves take 1 ms."""
        if isinstance(keys, bytes):
            keys = unpack_keys(keys)
        self._expire()
        if lease is None:
            lease = new_lease()
        self._release_pins(lease)
        if requester in self.stores:
            self.observed.backlog(requester, backlog_ms)
        handles = self.index.lookup(keys)
        handles = handles[: self._first_doomed(handles)]
        self.index.pin(handles)
        self.index.touch(handles)
        self._leases[lease] = (time.monotonic() + self.config.lease_ttl_s, handles)
        self.lookups += 1
        self.lookup_pages += len(keys)
        hit_nodes = self._hit_nodes(handles, requester)
        return Plan(lease, hit_nodes, self._place(RequestView(tuple(keys), requester, tuple(hit_nodes))))

    def _hit_nodes(self, handles: np.ndarray, prefer: str | None) -> list[str]:
        """The node each cached page is read from: ``prefer`` when it holds the page, else
        the node of the page before, else its first location (the simulator's rule,
        ``ClusterSimulator.hit_nodes``)."""
        primary = self.index.node[handles].tolist()
        if not self.replicas:
            return [self.node_ids[i] for i in primary]
        want = self._node_ix.get(prefer, NO_NODE) if prefer is not None else NO_NODE
        out, prev = [], want
        for handle, first in zip(handles.tolist(), primary):
            copies = self.replicas.get(handle)
            if copies is None:
                node = first
            else:
                held = [first, *copies]
                node = want if want in held else prev if prev in held else first
            out.append(self.node_ids[node])
            prev = node
        return out

    def decide(self, keys: Sequence[int] | bytes, front: str | None, backlog_ms: float = 0.0, route: bool = True) -> Decision:
        """The cluster policy's verbs for a request arriving at ``front`` (the front end's
        node): which node serves it, then, as that node sees it, how much of the hit to load,
        whether to prefetch and where to replicate (the simulator's ``ClusterSimulator.serve``
        asks them in this order, of the same views). Nothing is pinned or counted: the serving
        engine looks the prefix up again with ``lookup_pin``. ``backlog_ms``: the front node's
        engine backlog. ``route=False``: ``front`` serves it whatever ``route`` answers (an
        engine already routed to, as by the Ray Serve router, asks the other verbs;
        :mod:`kvray.engines.vllm.verbs`); ``route`` is still asked, as a learned policy
        (``rl-router``) decides every verb of a request there."""
        if isinstance(keys, bytes):
            keys = unpack_keys(keys)
        self._expire()
        if front in self.stores:
            self.observed.backlog(front, backlog_ms)
        keys = tuple(keys)
        handles = self.index.lookup(keys)
        handles = handles[: self._first_doomed(handles)]
        cluster = self.cluster_view()
        view = self._request_view(keys, handles, front)
        routed = self.policy.route(view, cluster)  # asked even for route=False: a policy may decide every verb there
        node = front if not route and front in self.stores else routed
        if node not in self.stores:
            raise PolicyError(f"cluster policy {self.policy.name!r} routed to {node!r}; live nodes: {', '.join(self.stores)}")
        if node != front:
            view = self._request_view(keys, handles, node)
        hits = len(handles)
        load = min(max(int(self.policy.load_pages(view, cluster)), 0), hits) if hits else 0
        prefetch = load > 0 and bool(self.policy.prefetch(view, cluster))
        replicate = tuple(n for n in self.policy.replicate(view, cluster) if n in self.stores) if hits else ()
        return Decision(node, hits, load, prefetch, replicate, self._send_disk_budget(node, cluster))

    def _send_disk_budget(self, node: str, cluster: ClusterView) -> ray.ObjectRef | None:
        """The policy's NVMe write budget for the serving node (asked where the simulator asks
        it), sent to the node's store when it changes; returns that call (None: unchanged).
        The controller does not wait for it (it would hold up every lookup for a round trip):
        the request's executor does (``Decision.budget_set``), before the request's writes,
        which the simulator puts under the budget it set for the same request."""
        try:
            rate = checked_rate(self.policy.disk_write_budget(cluster.node(node), cluster))
        except ConfigError as exc:
            raise PolicyError(f"cluster policy {self.policy.name!r}: {exc}") from exc
        if rate == self.disk_budgets.get(node):
            return None
        self.disk_budgets[node] = rate
        return self.stores[node].set_disk_write_budget.remote(rate)

    def _request_view(self, keys: tuple[int, ...], handles: np.ndarray, requester: str | None) -> RequestView:
        hit_nodes = tuple(self._hit_nodes(handles, requester))
        tiers = (self._only_tier,) * len(hit_nodes) if self._only_tier else ()
        return RequestView(keys, requester, hit_nodes, hit_tiers=tiers)

    def locate(self, keys: Sequence[int]) -> tuple[RequestView, ClusterView]:
        """The request as the cluster policy's ``route`` sees it before any engine asks (where
        its cached prefix lives, the node of each page root first, and their tiers as
        :meth:`decide` shows them; no requester) and the cluster view, for a request router
        choosing an engine (:mod:`kvray.engines.vllm.router`): nothing is pinned, touched or
        counted, as the engine that serves the request looks it up again with ``lookup_pin``."""
        self._expire()
        handles = self.index.lookup(keys)
        handles = handles[: self._first_doomed(handles)]
        return self._request_view(tuple(keys), handles, None), self.cluster_view()

    def cluster_view(self) -> ClusterView:
        """The live nodes, in membership order, as the cluster policy sees them now."""
        view = self.observed.view(list(self.stores), time.monotonic())
        return ClusterView(view.nodes, page_prefill_ms=self.config.page_prefill_ms or 0.0)

    def _place(self, request: RequestView) -> list[str]:
        """The policy's node for each page after the cached prefix; checked, as a policy's
        answer naming a node that is not a live store would lose the pages."""
        missing = len(request.keys) - len(request.hit_nodes)
        if not missing or not self.stores:
            return []
        targets = list(self.policy.place(request, missing, self.cluster_view()))
        if len(targets) != missing or not set(targets) <= self.stores.keys():
            raise PolicyError(
                f"cluster policy {self.policy.name!r} placed {missing} pages on {targets!r}: "
                f"expected one live node (of {', '.join(self.stores)}) per page"
            )
        return targets

    def _release_pins(self, lease: int) -> None:
        held = self._leases.pop(lease, None)
        if held is not None:
            self._end(held[1])

    def _first_doomed(self, handles: np.ndarray) -> int:
        """Length of the chain before its first doomed page (its descendants are doomed too)."""
        if self._doomed:
            for i, h in enumerate(handles.tolist()):
                if h in self._doomed:
                    return i
        return len(handles)

    def release(
        self,
        lease: int,
        hits_by_tier: Mapping[str, int],
        lost: Mapping[str, Sequence[int]],
        bytes_between_nodes: int = 0,
        local_pages: int = 0,
    ) -> None:
        """End a lease: unpin, count the hits the engine got, drop locations that failed.

        A lease this incarnation never granted (made before a restart, ``NO_LEASE`` or
        ``LOCAL_LEASE``) pinned nothing here. ``local_pages``: the pages of a request the
        client answered without ``lookup_pin`` (lease ``LOCAL_LEASE``), counted as looked up.
        """
        self._expire()
        self._release_pins(lease)
        if lease == LOCAL_LEASE:
            self.local_lookups += 1
            self.lookup_pages += local_pages
        self.hit_pages.update(hits_by_tier)
        self.bytes_between_nodes += bytes_between_nodes
        for node_id, keys in lost.items():
            self.lost_pages += self._forget(node_id, keys)

    def commit(
        self,
        parent_key: int | None,
        keys: Sequence[int],
        nodes: Sequence[str],
        depth: int,
        dropped: Mapping[str, Sequence[int]],
        reports: Mapping[str, NodeReport] | None = None,
        release: Release | None = None,
        replica: bool = False,
    ) -> int:
        """Publish a chain of pages stores now hold (``keys[i]`` on ``nodes[i]``, the first one
        a child of ``parent_key``); forget the pages stores report evicted, and keep the
        ``reports`` the stores answered the writes with. ``release``: the storing request's
        own report (:class:`~kvray.cluster.protocol.Release`), handled first, as if it had
        come on its own just before. ``replica``: the pages are copies of a chain indexed
        elsewhere (the ``replicate`` verb): a page indexed already gains ``nodes[i]`` as a
        further location. Returns pages added."""
        if release is not None:
            self.release(*release)
        self._expire()
        now = time.monotonic()
        for node_id, report in (reports or {}).items():
            if node_id in self.stores:
                self.observed.report(node_id, NodeReport(*report), now)
        for node_id, gone in dropped.items():
            self._forget(node_id, gone)
        parent = ROOT if parent_key is None else self.index.handle_of(parent_key)
        added = 0
        for i, (key, node_id) in enumerate(zip(keys, nodes)):
            if parent is None or parent in self._doomed or node_id not in self._node_ix:
                break  # the chain broke (its parent left meanwhile): the rest could never match
            handle = self.index.handle_of(key)
            if handle is None:
                handle = self.index.add(key, parent=parent, depth=depth + i, node=self._node_ix[node_id])
                added += 1
            elif replica and (ix := self._node_ix[node_id]) != int(self.index.node[handle]):
                copies = self.replicas.setdefault(handle, [])
                if ix not in copies:
                    copies.append(ix)
            parent = handle
        return added

    def _forget(self, node_id: str, keys: Sequence[int]) -> int:
        """Drop the pages among ``keys`` that the index places on ``node_id``; returns pages dropped."""
        ix = self._node_ix.get(node_id, NO_NODE)
        before = len(self.index)
        for key in keys:
            handle = self.index.handle_of(key)
            if handle is not None and handle not in self._doomed:
                self._lose(handle, ix)
        return before - len(self.index)

    # -- state ----------------------------------------------------------------------------------
    def pages_by_node(self) -> dict[str, int]:
        """Indexed pages per node (every node that ever joined, live or not)."""
        counts = np.bincount(self.index.node[self._handles()], minlength=len(self.node_ids))
        return {node: int(n) for node, n in zip(self.node_ids, counts.tolist())}

    def snapshot(self) -> dict:
        self._expire()
        hits = sum(self.hit_pages.values())
        snap = {
            "shard": self.partition.shard,
            "nodes": list(self.stores),
            "indexed_pages": len(self.index),
            "pages_by_node": self.pages_by_node(),
            "index_bytes": self.index.memory_bytes(),
            "lookups": self.lookups,
            "local_lookups": self.local_lookups,
            "lookup_pages": self.lookup_pages,
            "page_hit_rate": hits / self.lookup_pages if self.lookup_pages else 0.0,
            "hit_pages_by_tier": dict(self.hit_pages),
            "bytes_between_nodes": self.bytes_between_nodes,
            "lost_pages": self.lost_pages,
            "open_leases": len(self._leases),
            "expired_leases": self.expired_leases,
            "doomed_pages": len(self._doomed),
            "replica_locations": sum(len(copies) for copies in self.replicas.values()),
            "rebuilt_pages": self.rebuilt_pages,
            "rebuild_s": self.rebuild_s,
        }
        export_cluster_stats(snap)
        return snap

    def status(self) -> dict:
        """Cluster snapshot, and a ``stats`` call to every live store (object refs, which
        the caller awaits with its own deadline: waiting here would hold up every lookup)."""
        return {"cluster": self.snapshot(), "stores": {node: store.stats.remote() for node, store in self.stores.items()}}


ControllerActor = ray.remote(max_restarts=-1, max_task_retries=0)(Controller)
