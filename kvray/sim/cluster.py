"""Cluster simulator: N nodes, each the runtime's own cache, with links as queued resources.

Every node is a :class:`~kvray.sim.node.SimNode`: a real
:class:`~kvray.core.manager.CacheManager` with its own
:class:`~kvray.core.placement.PlacementPolicy`, prefill engines and links (PCIe, NVMe, NIC);
optionally one switch all cross-node bytes share. A
:class:`~kvray.policy.cluster.ClusterPolicy` makes the decisions above the nodes.

Requests are served in arrival order; each resource (engine, link lane) is a first-come
first-served calendar, so a request's loads queue behind the moves and loads booked before
it. For one request arriving at ``t``:

1. the scenario's router lands it on a node, and ``ClusterPolicy.route`` keeps or moves it;
2. its cached prefix is found across the cluster (a page may sit on any node), and
   ``load_pages`` says how many of those pages to load (the rest is recomputed);
3. its engine starts at ``s >= t``; the loads go out at ``s``, or at ``t`` when ``prefetch``
   says so (overlapping the queue wait), each over the links of its path (a page on another
   node: that node's NIC out, the switch, this node's NIC in and PCIe); prefill starts when
   the engine is free and the loads are in, and the TTFT ends with it;
4. hit pages are touched and may be promoted on the node that holds them (promotions,
   and the demotions room-making causes, occupy that node's links);
5. its new pages go where ``place`` says, stored by the chosen node's chain writer
   (``CacheManager.store_chain``) and policy; ``replicate`` copies its hit chain to other
   nodes. These writes start when the TTFT ends, off its path but on the links.

The single-node :class:`~kvray.sim.simulator.Simulator` is this with one node. Deterministic
for a seed (the router's).

Example::
    from kvray.policy.cluster import make_cluster_policy
    from kvray.sim.cluster import ClusterSimulator
    from kvray.sim.node import node_capacities
    from kvray.scenario import load_scenario
    from kvray.sim.workloads import WorkloadSpec, generate

    scenario = load_scenario("h100-4node-skewed")          # shipped in simulations/
    trace = generate(WorkloadSpec(sessions=40), seed=1)
    sim = ClusterSimulator(scenario, "lru", make_cluster_policy("cost-router"), node_capacities(scenario, trace, 0.05))
    result = sim.replay(trace)
    print(result.mean_ttft_ms, result.extra["link_bytes"])
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from kvray.core.errors import ConfigError, PolicyError
from kvray.core.index import ROOT
from kvray.core.placement import PlacementPolicy, RequestInfo
from kvray.core.tiers import TIER_LABELS, Tier
from kvray.core.write_budget import checked_rate
from kvray.policy.cluster import ClusterPolicy, ClusterView, LocalFirstRing, RequestView
from kvray.report import ReplayResult, ReplayTally, hit_tokens, policy_stats_since
from kvray.scenario import Scenario
from kvray.sim.links import Link, transfer
from kvray.sim.node import TIERS, Router, SimNode, session_of
from kvray.traces import TraceRequest, full_blocks, next_uses, session_end_hints

PolicySource = str | Callable[[], PlacementPolicy] | Sequence[PlacementPolicy]
ADVANCE_EVERY = 64  # requests between two prunings of the links' past bookings (Link.advance)


class ClusterSimulator:
    """One replay over a cluster scenario: a :class:`SimNode` per node, the scenario's
    router and a cluster policy.

    ``policy`` is a policy name (one instance per node), a factory, or one instance per node;
    without a ``cluster_policy`` the runtime's default, ``local-first``, decides across nodes.

    Example::

        sim = ClusterSimulator(scenario, "lru", make_cluster_policy("local-first"))
        result = sim.replay(trace)
        result.extra["link_utilisation"]      # per node/link: busy share over the replay
        result.extra["prefill_utilisation"]   # per node: its engines' busy share while requests came
    """

    def __init__(
        self,
        scenario: Scenario,
        policy: PolicySource,
        cluster_policy: ClusterPolicy | None = None,
        capacities: Sequence[Mapping[Tier, int] | None] | None = None,
    ) -> None:
        specs = scenario.node_scenarios()
        if isinstance(policy, str):
            from kvray.policy import make_policy

            name = policy
            policies = [make_policy(name) for _ in specs]
        elif callable(policy):
            policies = [policy() for _ in specs]
        else:
            policies = list(policy)
        if len(policies) != len(specs) or (capacities is not None and len(capacities) != len(specs)):
            raise ConfigError(f"scenario {scenario.name!r} has {len(specs)} node(s): give a policy and sizes for each")
        self.scenario = scenario
        self.cluster_policy = cluster_policy or LocalFirstRing()  # the runtime's default (RuntimeConfig)
        queued, window = scenario.links_queued, scenario.window_ms
        self.nodes = [
            SimNode(i, spec, p, capacities[i] if capacities else None, queued, window)
            for i, (spec, p) in enumerate(zip(specs, policies))
        ]
        self.names = [n.name for n in self.nodes]
        self._by_name = {n: i for i, n in enumerate(self.names)}
        self.block_tokens = scenario.layout.page_tokens
        self.page_nbytes = scenario.layout.page_nbytes
        self.page_prefill_ms = self.nodes[0].cost.page_prefill_ms()
        self.router = Router(scenario.router, len(self.nodes))
        self.switch = (
            Link("switch", scenario.switch.gbps, scenario.switch.latency_us, 1, queued, window) if scenario.switch else None
        )
        self.single = len(self.nodes) == 1
        self._holders: dict[int, list[int]] = {}  # key -> nodes holding it (clusters only)
        if not self.single:
            for node in self.nodes:
                self._listen(node)
        self._view: ClusterView | None = None
        self._view_at = -np.inf
        self._paths: dict[tuple[int, int, Tier, Tier | None], tuple[Link, ...]] = {}
        # request index -> its client's end-of-session hint (RequestInfo.ends_session_from), for
        # the requests served by their index: replay sets it, a caller serving one by one may
        self.session_ends: dict[int, int] = {}
        self._disk_budgets: dict[str, float | None] = {}  # node -> the policy's NVMe write budget, as last set
        # node -> pages the replicate verb stored there (the runtime's cluster_verbs.replicated_pages_by_node)
        self.replicated_pages: dict[str, int] = {}

    @property
    def links(self) -> list[Link]:
        return [link for node in self.nodes for link in node.links] + ([self.switch] if self.switch else [])

    def _listen(self, node: SimNode) -> None:
        holders, i = self._holders, node.index

        def placed(key: int, tier: Tier, slot: int, checksum: int) -> None:
            at = holders.setdefault(key, [])
            if i not in at:
                at.append(i)

        def dropped(key: int) -> None:
            at = holders[key]
            at.remove(i)
            if not at:
                del holders[key]

        node.manager.page_placed, node.manager.page_dropped = placed, dropped

    # -- observations --------------------------------------------------------------------
    def cluster_view(self, now_ms: float) -> ClusterView:
        """Every node's view at ``now_ms`` (refreshed at most every ``view_refresh_ms``)."""
        if self._view is None or now_ms - self._view_at >= self.scenario.view_refresh_ms:
            self._view = ClusterView(tuple(n.view(now_ms) for n in self.nodes), page_prefill_ms=self.page_prefill_ms)
            self._view_at = now_ms
        return self._view

    def hit_nodes(self, keys: Sequence[int], prefer: int | None) -> list[int]:
        """The node of each page of the cluster's cached prefix of ``keys``: ``prefer`` when
        it holds the page, else the node of the page before, else the first holder."""
        if self.single:
            return [0] * self.nodes[0].manager.index.match(keys)
        holders, out, prev = self._holders, [], prefer
        for key in keys:
            at = holders.get(key)
            if not at:
                break
            node = prefer if prefer in at else prev if prev in at else at[0]
            out.append(node)
            prev = node
        return out

    def request_view(self, request: TraceRequest, node: int | None) -> RequestView:
        keys = full_blocks(request.hash_ids, request.input_length, self.block_tokens)
        hits = self.hit_nodes(keys, node)
        names = self.names
        return RequestView(
            tuple(keys),
            None if node is None else names[node],
            tuple(names[h] for h in hits),
            session_of(request),
            self.hit_tiers(keys, hits),
        )

    def hit_tiers(self, keys: Sequence[int], hits: Sequence[int]) -> tuple[str, ...]:
        """The tier label of each page of a cached prefix on the node ``hits`` names for it."""
        indexes = [n.manager.index for n in self.nodes]
        return tuple(TIER_LABELS[int(indexes[h].tier[indexes[h].handle_of(k)])] for k, h in zip(keys, hits))

    def views(self, request: TraceRequest, node: str | None = None) -> tuple[RequestView, ClusterView]:
        """What the cluster policy sees for ``request`` served by ``node`` (the runtime's
        engine node), from the modeled queues and links at the request's arrival."""
        at = None if node is None else self._node(node)
        return self.request_view(request, at), self.cluster_view(request.timestamp_ms)

    def _node(self, name: str) -> int:
        try:
            return self._by_name[name]
        except KeyError:
            raise PolicyError(
                f"cluster policy {self.cluster_policy.name!r} named node {name!r}; nodes: {', '.join(self.names)}"
            ) from None

    # -- serving -------------------------------------------------------------------------
    def serve(self, request: TraceRequest, future: np.ndarray | None = None, index: int = -1) -> tuple[list[str], float]:
        """Serve one request (``index``: its position in the trace, told to policies with
        ``future``); returns the tier label of each loaded hit page ("remote": from
        another node) and its modeled TTFT (ms)."""
        now = request.timestamp_ms
        policy = self.cluster_policy
        front = self.router.land(session_of(request))
        view = self.request_view(request, front)
        cluster = self.cluster_view(now)
        at = self._node(policy.route(view, cluster))
        if at != front:
            hits = self.hit_nodes(view.keys, at)
            view = RequestView(
                view.keys, self.names[at], tuple(self.names[h] for h in hits), view.session, self.hit_tiers(view.keys, hits)
            )
        keys, node = view.keys, self.nodes[at]
        info = self._request_info(node, keys, now, future, index, self.session_ends.get(index, -1))
        node.policy.on_request(info)
        told = {at}
        prefix = self._prefix(view, at)  # per node holding prefix pages: its handles, root first
        for h in prefix:
            self._tell(h, told, info, now)
        hits = len(view.hit_nodes)
        load = min(max(policy.load_pages(view, cluster), 0), hits) if hits else 0
        prefetch = load > 0 and policy.prefetch(view, cluster)
        self._disk_budget(at, cluster)
        engine, start = node.queue.start(now)
        ready = now if prefetch else start
        labels, loaded = self._load(view, at, load, ready, "prefetch" if prefetch else "load")
        ready = max(start, loaded)
        end = ready + node.cost.prefill_ms(request.input_length - hit_tokens(request, load, self.block_tokens))
        node.queue.finish(engine, start, end)
        for h, handles in prefix.items():
            holder = self.nodes[h]
            holder.clock = start
            holder.manager.touch(handles)
            holder.manager.promote(handles, holder.mover)
        self._store(view, at, end, cluster, session_of(request), told, info, now)
        if hits:
            self._replicate(view, end, cluster, session_of(request), told, info, now)
        return labels, end - now

    def _disk_budget(self, at: int, cluster: ClusterView) -> None:
        """The policy's NVMe write budget for the serving node, on the node's modeled clock,
        set when it changes (the runtime's controller sends it to the node's store)."""
        name = self.names[at]
        rate = checked_rate(self.cluster_policy.disk_write_budget(cluster.node(name), cluster))
        if rate != self._disk_budgets.get(name):
            self._disk_budgets[name] = rate
            node = self.nodes[at]
            node.manager.set_disk_budget(rate, lambda: node.clock / 1e3)

    def _prefix(self, view: RequestView, at: int) -> dict[int, np.ndarray]:
        if self.single:
            match = self.nodes[0].manager.lookup(view.keys)
            self._tiers = match.tiers
            return {0: match.handles} if len(match) else {}
        by_node: dict[int, list[int]] = {}
        tiers = []
        for key, name in zip(view.keys, view.hit_nodes):
            index = self.nodes[self._by_name[name]].manager.index
            handle = index.handle_of(key)
            by_node.setdefault(self._by_name[name], []).append(handle)
            tiers.append(int(index.tier[handle]))
        self._tiers = np.array(tiers, dtype=np.int64)
        return {h: np.array(hs, dtype=np.int64) for h, hs in by_node.items()}

    def _load(self, view: RequestView, at: int, pages: int, ready: float, kind: str) -> tuple[list[str], float]:
        """Load the first ``pages`` of the cached prefix, run by run (same node, same tier),
        one after the other; returns their tier labels and when the last one arrived."""
        if not pages:
            return [], ready
        tiers = self._tiers[:pages].tolist()
        hit_nodes = view.hit_nodes
        labels: list = []
        i = 0
        while i < pages:
            tier, name = tiers[i], hit_nodes[i]
            j = i + 1
            while j < pages and tiers[j] == tier and hit_nodes[j] == name:
                j += 1
            h = self._by_name[name]
            path = self._path(h, at, TIERS[tier], None)
            ready = transfer(path, ready, (j - i) * self.page_nbytes, kind, self.nodes[h].access_ms[tier], j - i)
            labels.extend([TIER_LABELS[tier] if h == at else "remote"] * (j - i))
            i = j
        return labels, ready

    def _path(self, src: int, dst: int, tier: Tier, into: Tier | None) -> tuple[Link, ...]:
        """Links a page crosses from ``tier`` of node ``src`` to node ``dst``: to its engine
        (``into`` None) or into its tier ``into``."""
        key = (src, dst, tier, into)
        path = self._paths.get(key)
        if path is None:
            a, b = self.nodes[src], self.nodes[dst]
            if src == dst:
                path = a.load_path[tier] if into is None else a.move_path[tier, into]
            else:
                middle = (a.nic_out,) + ((self.switch,) if self.switch else ()) + (b.nic_in,)
                arrive = (b.h2d,) if into is None else b.from_host[into]
                path = a.to_host[tier] + middle + arrive
            self._paths[key] = path
        return path

    def _request_info(
        self, node: SimNode, keys: tuple[int, ...], now: float, future: np.ndarray | None, index: int, ends_from: int
    ) -> RequestInfo:
        """What ``node``'s policy is told of a request arriving at ``now`` (``ends_from``: its
        end-of-session hint, -1 for none)."""
        load_util = None
        if node.policy.needs_link_util:
            load_util = {t: max(link.contention(now) for link in path) for t, path in node.load_path.items()}
        return RequestInfo(
            keys,
            node.queue.backlog_ms(now),
            node.tier_cost,
            future,
            arrival_ms=now,
            page_prefill_ms=node.cost.page_prefill_ms(),
            engines=node.engines,
            disk_write_util=node.nvme_write.contention(now) if node.policy.needs_disk_util and Tier.DISK in node.to_host else 0.0,
            index=index if future is not None else -1,
            load_util=load_util,
            ends_session_from=ends_from,
        )

    def _tell(self, h: int, told: set[int], info: RequestInfo, now: float) -> SimNode:
        """Node ``h``'s policy hears of the request (once) before the request touches its pages."""
        node = self.nodes[h]
        if h not in told:
            node.policy.on_request(self._request_info(node, info.keys, now, info.future, info.index, info.ends_session_from))
            told.add(h)
        return node

    def _store(
        self,
        view: RequestView,
        at: int,
        end: float,
        cluster: ClusterView,
        tenant: str,
        told: set,
        info: RequestInfo,
        now: float,
    ) -> None:
        keys, hits = view.keys, len(view.hit_nodes)
        if hits == len(keys):
            return
        if self.single:
            node = self.nodes[0]
            node.clock = end
            node.store_chain(keys, node.write, tenant=tenant)
            return
        targets = self.cluster_policy.place(view, len(keys) - hits, cluster)
        if len(targets) != len(keys) - hits:
            raise PolicyError(f"cluster policy {self.cluster_policy.name!r} placed {len(targets)} of {len(keys) - hits} pages")
        i = hits
        while i < len(keys):
            target = targets[i - hits]
            j = i + 1
            while j < len(keys) and targets[j - hits] == target:
                j += 1
            p = self._node(target)
            node = self._tell(p, told, info, now)
            index = node.manager.index
            parent = index.handle_of(keys[i - 1]) if i else ROOT
            node.clock = end
            node.write = self._writer(at, p)
            node.store_chain(keys, node.write, parent=parent if parent is not None else ROOT, tenant=tenant, start=i, stop=j)
            if index.handle_of(keys[j - 1]) is None:
                return  # the chain broke here: pages after it could never be matched
            i = j

    def _writer(self, src: int, dst: int) -> Callable[[int, int, Tier, int, int], int]:
        """Writes of pages computed on node ``src`` into node ``dst``'s tiers."""
        node = self.nodes[dst]
        if src == dst:
            return node._write_local
        nbytes = self.page_nbytes

        def write(depth: int, key: int, tier: Tier, slot: int, parent: int) -> int:
            path = (self.nodes[src].d2h,) + self._path(src, dst, Tier.HOST, tier)
            transfer(path, node.clock, nbytes, "store", node.access_ms[tier])
            return 0

        return write

    def _replicate(
        self, view: RequestView, end: float, cluster: ClusterView, tenant: str, told: set, info: RequestInfo, now: float
    ) -> None:
        hits = len(view.hit_nodes)
        for name in self.cluster_policy.replicate(view, cluster):
            t = self._node(name)
            node = self._tell(t, told, info, now)
            sources = [(self._by_name[n], TIERS[tier]) for n, tier in zip(view.hit_nodes, self._tiers.tolist())]

            def copy(depth: int, key: int, tier: Tier, slot: int, parent: int, t=t, node=node, sources=sources) -> int:
                h, src_tier = sources[depth]
                path = self._path(h, t, src_tier, tier) if h != t else node.move_path.get((src_tier, tier), ())
                latency = self.nodes[h].access_ms[src_tier] + node.access_ms[tier]
                transfer(path, end, self.page_nbytes, "replicate", latency)
                return 0

            node.clock = end
            if stored := node.store_chain(view.keys, copy, tenant=tenant, stop=hits):
                self.replicated_pages[name] = self.replicated_pages.get(name, 0) + stored

    @property
    def takes_session_ends(self) -> bool:
        """Whether a node's policy takes the clients' end-of-session hints (``needs_session_ends``)."""
        return any(n.policy.needs_session_ends for n in self.nodes)

    # -- replay --------------------------------------------------------------------------
    def replay(
        self,
        trace: Sequence[TraceRequest],
        warmup_requests: int = 0,
        progress: Callable[[int], None] | None = None,
    ) -> ReplayResult:
        """Serve every request in order; the first ``warmup_requests`` fill the cache unmeasured."""
        needs_future = any(n.policy.needs_future for n in self.nodes)
        futures = next_uses(trace) if needs_future else None
        if self.takes_session_ends:  # each session's last request carries its client's hint
            self.session_ends = session_end_hints(trace, self.block_tokens, futures)
        tally = ReplayTally(self.block_tokens)
        links = self.links
        base = self._counters(links)
        began = trace[warmup_requests].timestamp_ms if len(trace) > warmup_requests else 0.0
        last_end = began
        for i, request in enumerate(trace):
            if i == warmup_requests:
                base = self._counters(links)
            if i % ADVANCE_EVERY == 0:
                for link in links:
                    link.advance(request.timestamp_ms)
            hit_tiers, ttft = self.serve(request, None if futures is None else futures[i], i)
            if i >= warmup_requests:
                tally.record(request, hit_tiers, ttft)
                last_end = max(last_end, request.timestamp_ms + ttft)
            if progress is not None:
                progress(i)
        moved, busy, background, link_bytes, prefill, policy = base
        span = max([last_end] + [link.last_end_ms for link in links]) - began
        now_moved, now_busy, now_background, now_bytes, now_prefill, now_policy = self._counters(links)
        served = last_end - began  # from the first measured arrival to the last first token
        names = [link.name for link in links]
        return tally.result(
            policy=self.nodes[0].policy.name,
            scenario=self.scenario.name,
            bytes_moved=now_moved - moved,
            capacity_pages=self._capacity_pages(),
            background_move_ms=now_background - background,
            cluster_policy=self.cluster_policy.name,
            policy_stats=policy_stats_since(policy, now_policy),
            nodes=len(self.nodes),
            link_bytes={n: now_bytes[n] - link_bytes[n] for n in names if now_bytes[n] - link_bytes[n]},
            link_utilisation={
                n: round((now_busy[n] - busy[n]) / (span * link.lanes), 6) if span > 0 else 0.0
                for n, link in zip(names, links)
                if now_busy[n] - busy[n] > 0
            },
            prefill_utilisation={
                node.name: round((now_prefill[node.name] - prefill[node.name]) / (served * node.engines), 6)
                if served > 0
                else 0.0
                for node in self.nodes
            },
        )

    def _counters(self, links: list[Link]) -> tuple[int, dict, float, dict, dict, dict]:
        return (
            sum(n.manager.metrics.bytes_moved for n in self.nodes),
            {link.name: link.busy_ms for link in links},
            sum(n.background_ms for n in self.nodes),
            {link.name: link.bytes for link in links},
            {n.name: n.queue.busy_ms for n in self.nodes},
            {n.name: n.policy.stats() for n in self.nodes},
        )

    def _capacity_pages(self) -> dict[str, int]:
        total: dict[Tier, int] = {}
        for node in self.nodes:
            for tier, pages in node.manager.capacities.items():
                total[tier] = total.get(tier, 0) + pages
        return {t.label: c for t, c in sorted(total.items())}
