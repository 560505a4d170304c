"""The Ray runtime's cluster rules over N modeled nodes, without Ray or bytes.

A stand-in for the cluster simulator (branch ``sim``) until it merges: the feature-equality
and hit-agreement tests build their simulator-side views and hits here; once the cluster
simulator exposes its own view builder, they should point at it instead. It follows what
``kvray run`` does for each request (round robin over the nodes in membership order), with
the same objects the runtime runs: a :class:`~kvray.core.manager.CacheManager` per node
(its store's index, slots and placement policy), a :class:`~kvray.core.index.PrefixIndex`
of locations (the controller's) and the runtime's :class:`~kvray.policy.cluster.ClusterPolicy`:

1. the serving node's policy hears ``on_request`` (keys, backlog 0, tier costs), and so
   does each other node the request reads or stores pages on, before it does (backlog 0:
   the serving engine's queue is not that node's), as the simulator tells them;
2. a request whose pages all sit in that node's host tier is a local plan (the client's
   mapped slot directory): its hits are touched there and nothing is placed;
3. otherwise the controller's longest cached prefix, and the cluster policy places the
   missing pages, seeing every node as its last write left it (idle links, no backlog:
   requests are served one at a time);
4. each run of hit pages is read on its node (hits touched there; pages from another node
   count as ``remote`` hits), the serving node's own host pages last (the client copies
   them itself and tells its store afterwards);
5. each run of new pages is stored on its node, under its parent if that node holds it,
   else as a root of that node's index; pages a node evicts are forgotten by the
   controller (with their descendants), which then indexes the runs that landed.

Example::

    reference = ClusterReference(["a", "b"], config, LocalFirstRing(local_limit=8))
    for i, request in enumerate(trace):
        reference.serve(i, request)
    reference.hit_pages_by_tier
"""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np

from kvray.cluster.config import RuntimeConfig
from kvray.core.index import ROOT, PrefixIndex
from kvray.core.keys import trace_page_keys
from kvray.core.manager import CacheManager
from kvray.core.placement import RequestInfo
from kvray.core.tiers import LOCAL_TIERS, Tier
from kvray.policy import make_policy
from kvray.policy.cluster import ClusterPolicy, ClusterView, NodeView, RequestView
from kvray.traces import TraceRequest, full_blocks

REMOTE = Tier.REMOTE.label


def _moved(*_args) -> None:
    """Moves between tiers cost nothing here: only where pages are matters."""


class ClusterReference:
    """N nodes served as the runtime serves them; see the module docstring."""

    def __init__(self, nodes: list[str], config: RuntimeConfig, cluster_policy: ClusterPolicy) -> None:
        self.names = list(nodes)
        self.config = config
        self.fingerprint = config.fingerprint()
        tiers = config.tiers.model_dump()
        self.nodes = {
            name: CacheManager({t: tiers[t.label] for t in LOCAL_TIERS}, make_policy(config.policy)) for name in self.names
        }
        self.dropped: dict[str, list[int]] = {name: [] for name in self.names}
        for name, manager in self.nodes.items():
            manager.page_dropped = self.dropped[name].append
        self.index = PrefixIndex()  # the controller's: key -> node
        self.policy = cluster_policy
        self.policy.local_limit = config.local_limit
        costs = config.tier_costs()
        self.tier_cost = {
            name: None if costs is None else {t: c for t, c in costs.items() if t in m.slots} for name, m in self.nodes.items()
        }
        self.free_share = {name: self._free_share(name) for name in self.names}  # as each node's last write left it
        self.hit_pages_by_tier: Counter[str] = Counter()

    def _free_share(self, name: str) -> dict[str, float]:
        slots = self.nodes[name].slots
        return {t.label: (s.capacity - s.used) / s.capacity for t, s in sorted(slots.items())}

    def keys(self, request: TraceRequest) -> list[int]:
        return trace_page_keys(self.fingerprint, full_blocks(request.hash_ids, request.input_length, 512))

    def view(self) -> ClusterView:
        nodes = tuple(NodeView(name, free_share=dict(self.free_share[name])) for name in self.names)
        return ClusterView(nodes, page_prefill_ms=self.config.page_prefill_ms or 0.0)  # as the controller tells its policy

    def serve(self, i: int, request: TraceRequest, ends_session_from: int = -1) -> None:
        """Request ``i`` (``ends_session_from``: its client's end-of-session hint, as the replay sends it)."""
        keys = self.keys(request)
        if not keys:
            return
        here = self.names[i % len(self.names)]
        node = self.nodes[here]
        self._keys, self._told, self._ends_from = tuple(keys), set(), ends_session_from
        self._tell(here)
        if Tier.HOST in node.slots and self._in_host(here, keys) == len(keys):
            self._hit(here, keys)  # a local plan: the client read it all from its mapped host tier
            self.hit_pages_by_tier[Tier.HOST.label] += len(keys)
            return
        handles = self.index.lookup(keys)
        hit_nodes = [self.names[n] for n in self.index.node[handles].tolist()]
        self.index.touch(handles)
        missing = len(keys) - len(hit_nodes)
        targets = self.policy.place(RequestView(tuple(keys), here, tuple(hit_nodes)), missing, self.view()) if missing else []
        loaded = self._load(here, keys, hit_nodes)
        self._store(here, keys, loaded, [here] * max(len(hit_nodes) - loaded, 0) + list(targets))

    def _tell(self, name: str) -> None:
        """Node ``name``'s policy hears of the request being served, once."""
        if name not in self._told:
            self._told.add(name)
            self.nodes[name].policy.on_request(
                RequestInfo(
                    self._keys,
                    0.0,
                    self.tier_cost[name],
                    page_prefill_ms=self.config.page_prefill_ms or 0.0,
                    engines=self.config.prefill_engines,
                    ends_session_from=self._ends_from,
                )
            )

    def _hit(self, name: str, keys: list[int]) -> tuple[int, dict[str, int]]:
        """A node's store reads (or hears of reads of) the cached prefix of ``keys``: how
        many pages, by the tier they were in."""
        manager = self.nodes[name]
        match = manager.lookup(keys)
        labels, counts = np.unique(match.tiers, return_counts=True)
        manager.touch(match.handles)
        manager.promote(match.handles, _moved)
        return len(match), {Tier(int(t)).label: int(n) for t, n in zip(labels, counts)}

    def _in_host(self, name: str, keys: list[int]) -> int:
        """How many leading ``keys`` sit in the node's host tier (its slot directory)."""
        index = self.nodes[name].index
        for j, key in enumerate(keys):
            handle = index.handle_of(key)
            if handle is None or index.tier[handle] != Tier.HOST:
                return j
        return len(keys)

    def _load(self, here: str, keys: list[int], hit_nodes: list[str]) -> int:
        """The client's load: runs of hit pages, counted while the prefix is unbroken."""
        mapped_reads = Tier.HOST in self.nodes[here].slots
        loaded, start, mapped = 0, 0, []
        for name, group in itertools.groupby(hit_nodes):
            stop = start + len(list(group))
            run = keys[start:stop]
            if name == here and mapped_reads:
                got = self._in_host(here, run)
                parts = [("mapped", got, {Tier.HOST.label: got} if got else {})]
                if got < len(run):
                    parts.append(("local", *self._hit(here, run[got:])))
            else:
                self._tell(name)
                n, by_tier = self._hit(name, run)
                parts = [("local", n, by_tier)] if name == here else [("remote", n, {REMOTE: n} if n else {})]
            got = 0
            for path, n, by_tier in parts:
                if loaded == start + got:
                    loaded += n
                    self.hit_pages_by_tier.update(by_tier)
                    if path == "mapped":
                        mapped += run[got : got + n]
                got += n
            start = stop
        if mapped:
            self._hit(here, mapped)  # the client tells its store of the pages it copied itself
        return loaded

    def _store(self, here: str, keys: list[int], start: int, targets: list[str]) -> None:
        row, landed_nodes = start, []
        for name, group in itertools.groupby(targets):
            n = len(list(group))
            run, parent = keys[row : row + n], keys[row - 1] if row else None
            manager = self.nodes[name]
            self._tell(name)
            under = manager.index.handle_of(parent) if parent is not None else None
            manager.store_chain(run, _moved, parent=ROOT if under is None else under)
            self.free_share[name] = self._free_share(name)
            landed_nodes += [name] * n
            row += n
        for name, gone in self.dropped.items():
            self._forget(name, gone)
            gone.clear()
        parent = ROOT if not start else self.index.handle_of(keys[start - 1])
        for depth, (key, name) in enumerate(zip(keys[start:row], landed_nodes), start):
            if parent is None:
                break
            handle = self.index.handle_of(key)
            if handle is None:
                handle = self.index.add(key, parent=parent, depth=depth, node=self.names.index(name))
            parent = handle

    def _forget(self, name: str, keys: list[int]) -> None:
        ix = self.names.index(name)
        for key in keys:
            handle = self.index.handle_of(key)
            if handle is not None and self.index.node[handle] == ix:
                self.index.remove_subtree(handle)
