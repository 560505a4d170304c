"""Cluster placement: the decisions above one node's tiers, asked by the simulator and the
controller alike.

:class:`~kvray.core.placement.PlacementPolicy` decides inside a node (which tier a page enters,
which page leaves a full tier). A :class:`ClusterPolicy` decides across nodes, at the points
where a request meets the cluster:

- ``route``: which node serves a request (the simulator's router; a serving front end);
- ``place``: which node keeps each page the request adds (today's controller rule, local
  first then a hash ring, is :class:`LocalFirstRing`);
- ``load_pages``: of the cached prefix, how many pages to load (the rest is recomputed):
  when links are congested, recomputing the tail may be faster;
- ``prefetch``: start loading the cached prefix while the request still waits in its
  node's queue;
- ``replicate``: copy the request's hit chain to other nodes (hot shared prefixes);
- ``disk_write_budget``: how many bytes per second the serving node may write to its NVMe
  tier under contention (:mod:`kvray.core.write_budget`; None, the default: no cap).

Heuristics (:data:`CLUSTER_POLICIES`): ``local-first`` (today's controller rule),
``cost-router`` (prefix overlap against node load, as Dynamo's KV router), ``always-prefetch``,
``cost-prefetch`` (both), ``cost-prefetch-budget`` (and a fixed NVMe write budget) and
``replicate-hot`` (threshold replication of hot prefixes); the simulator's oracle
searches :class:`PrefetchReplicate`'s settings.

Every verb sees the same observation in both worlds: a :class:`RequestView` (the request's
keys, where its cached prefix lives, who asks) and a :class:`ClusterView` (per node: engine
backlog, link utilisation, free share of each tier). The simulator builds them from its
modeled queues and links, the runtime from its stores' and engines' reports; a test
asserts the two agree for the same request (docs/design.md, "One policy, two worlds").

Example::
    from kvray.policy.cluster import ClusterView, LocalFirstRing, NodeView, RequestView

    policy = LocalFirstRing(local_limit=64)
    view = ClusterView(nodes=(NodeView("a"), NodeView("b")))
    request = RequestView(keys=(1, 2, 3), requester="a", hit_nodes=("a",))
    assert policy.place(request, missing=2, cluster=view) == ["a", "a"]
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from kvray.core.errors import ConfigError, PolicyError
from kvray.core.hashring import HashRing


@dataclass(frozen=True)
class NodeView:
    """One node as a policy sees it. Utilisations are shares of the link's capacity over the
    recent window (0 idle, 1 saturated): bytes that finished crossing it in the window over
    what it could carry then (kvray.sim.links.Link.utilisation); ``pcie_util`` is the busier
    PCIe direction. ``free_share`` maps a tier label to its free share; ``backlog_ms`` is the
    work queued ahead of a request arriving now on the node's earliest free engine;
    ``disk_write_gbps`` its drive's write rate (0: no disk tier), what a write budget is a share of."""

    name: str
    backlog_ms: float = 0.0
    free_share: Mapping[str, float] = field(default_factory=dict)
    nic_in_util: float = 0.0
    nic_out_util: float = 0.0
    pcie_util: float = 0.0
    disk_read_util: float = 0.0
    disk_write_util: float = 0.0
    disk_write_gbps: float = 0.0


# cost-prefetch-budget's write budget, a share of each drive's write rate: of the shares measured
# (0.05 to 0.5, and none) the best mean over the held-out cells with either drive model
# (docs/sim-eval, "A base for the residual, measured").
FIXED_WRITE_SHARE = 0.2


def budget_rate(share: float, node: NodeView) -> float:
    """A write budget of ``share`` of ``node``'s drive write rate, in bytes per second."""
    return share * node.disk_write_gbps * 1e9


@dataclass(frozen=True)
class ClusterView:
    """Every node, in a fixed order (the scenario's, or the controller's membership order),
    and what recomputing a page and fetching one from another node cost, against which a
    policy weighs loads and queues."""

    nodes: tuple[NodeView, ...]
    page_prefill_ms: float = 0.0  # time to recompute one page on these engines (0: unknown)
    page_fetch_ms: float = 0.0  # time to load one cached page from another node, as measured (0: unknown)

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.nodes]

    def node(self, name: str) -> NodeView:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"no node {name!r} in the cluster view; nodes: {', '.join(self.names)}")


@dataclass(frozen=True)
class RequestView:
    """A request at the cluster: its page keys root first, the engine's node (None when it is
    not on any store's node), the node of each page of its cached prefix, its session (the
    flow a sticky router keeps together; empty when unknown) and the tier label of each page
    of its cached prefix on its node (empty when unknown: the runtime does not report them yet)."""

    keys: tuple[int, ...]
    requester: str | None = None
    hit_nodes: tuple[str, ...] = ()
    session: str = ""
    hit_tiers: tuple[str, ...] = ()


class ClusterPolicy:
    """Base class of cluster policies; every verb has a sensible default, so a heuristic
    overrides only what it decides.

    Example::

        class LeastLoaded(ClusterPolicy):
            name = "least-loaded"

            def route(self, request, cluster):
                return min(cluster.nodes, key=lambda n: n.backlog_ms).name
    """

    name: ClassVar[str] = "base"
    local_limit: int = 1024  # the largest request (pages) a policy that keeps requests on one node keeps there

    def route(self, request: RequestView, cluster: ClusterView) -> str:
        """The node that serves ``request``: its requester when it has one, else the least loaded."""
        if request.requester is not None:
            return request.requester
        return min(cluster.nodes, key=lambda n: n.backlog_ms).name

    def place(self, request: RequestView, missing: int, cluster: ClusterView) -> list[str]:
        """A node for each of the ``missing`` pages after the cached prefix, root first."""
        node = request.requester if request.requester in cluster.names else cluster.nodes[0].name
        return [node] * missing

    def load_pages(self, request: RequestView, cluster: ClusterView) -> int:
        """How many pages of the cached prefix to load; the rest is recomputed."""
        return len(request.hit_nodes)

    def prefetch(self, request: RequestView, cluster: ClusterView) -> bool:
        """Whether to load the cached prefix while the request waits in its node's queue."""
        return False

    def replicate(self, request: RequestView, cluster: ClusterView) -> list[str]:
        """Nodes that should receive a copy of the request's hit chain (none by default)."""
        return []

    def disk_write_budget(self, node: NodeView, cluster: ClusterView) -> float | None:
        """Bytes per second ``node`` (serving a request now) may write to its disk tier; pages
        beyond it are not written there. None (the default): no cap."""
        return None


class LocalFirstRing(ClusterPolicy):
    """Today's rule: a request that fits (``local_limit`` pages) stays on the requester's node;
    a larger one, or one from outside the cluster, is spread over all nodes by a hash ring,
    so that no node's memory is the ceiling of one long prefix."""

    name = "local-first"

    def __init__(self, local_limit: int = 1024) -> None:
        self.local_limit = local_limit
        self._ring = HashRing()
        self._ring_nodes: tuple[str, ...] = ()

    def place(self, request: RequestView, missing: int, cluster: ClusterView) -> list[str]:
        if missing == 0:
            return []
        names = cluster.names
        if request.requester in names and len(request.keys) <= self.local_limit:
            return [request.requester] * missing
        if tuple(names) != self._ring_nodes:
            self._ring = HashRing(names)
            self._ring_nodes = tuple(names)
        return self._ring.owners(request.keys[len(request.keys) - missing :])


class CostRouter(LocalFirstRing):
    """A router weighing prefix overlap against load, as NVIDIA Dynamo's KV router does:
    serve on the node with the least ``backlog_ms + page_prefill_ms x (pages it must
    prefill + remote_weight x pages it must fetch from another node)``; ties go to the
    requester (the front end's choice), then to the scenario's order. ``remote_weight`` is
    the view's measured ``page_fetch_ms / page_prefill_ms`` where it has one, the
    constructor's guess otherwise. Pages are placed as :class:`LocalFirstRing` places them,
    relative to the node chosen.

    Example::

        view = ClusterView((NodeView("a", backlog_ms=10.0), NodeView("b")), page_prefill_ms=20.0)
        request = RequestView(keys=(1, 2, 3), requester="b", hit_nodes=("a", "a"))
        CostRouter().route(request, view)   # 'a': 10 ms queue + 1 page (30) beats 1 page + fetching 2 (40)
    """

    name = "cost-router"

    def __init__(self, remote_weight: float = 0.5, local_limit: int = 1024) -> None:
        super().__init__(local_limit)
        self.remote_weight = remote_weight

    def route(self, request: RequestView, cluster: ClusterView) -> str:
        hits = request.hit_nodes
        page_ms = cluster.page_prefill_ms or 1.0
        missing = len(request.keys) - len(hits)
        remote_weight = self.remote_weight_in(cluster)
        best, best_cost = None, float("inf")
        for node in cluster.nodes:
            local = sum(1 for h in hits if h == node.name)
            cost = node.backlog_ms + page_ms * (missing + remote_weight * (len(hits) - local))
            if cost < best_cost or (cost == best_cost and node.name == request.requester):
                best, best_cost = node.name, cost
        return best

    def remote_weight_in(self, cluster: ClusterView) -> float:
        """A page fetched from another node in pages of prefill: measured where the view
        says what a fetch costs, else :attr:`remote_weight`."""
        if cluster.page_fetch_ms > 0 and cluster.page_prefill_ms > 0:
            return cluster.page_fetch_ms / cluster.page_prefill_ms
        return self.remote_weight


class AlwaysPrefetch(LocalFirstRing):
    """:class:`LocalFirstRing`, and every cached prefix is loaded while its request still
    waits for an engine, so the loads overlap the queue wait.

    Example::

        AlwaysPrefetch().prefetch(RequestView(keys=(1,), hit_nodes=("a",)), ClusterView((NodeView("a"),)))  # True
    """

    name = "always-prefetch"

    def prefetch(self, request: RequestView, cluster: ClusterView) -> bool:
        return True


class CostPrefetch(CostRouter):
    """:class:`CostRouter`, and every cached prefix is loaded while its request still waits
    for an engine: the oracle's usual cluster setting (``route=cost,prefetch=on``) as a fixed
    rule, against which the learned router's selective prefetch is measured.

    Example::

        CostPrefetch().prefetch(RequestView(keys=(1,), hit_nodes=("a",)), ClusterView((NodeView("a"),)))  # True
    """

    name = "cost-prefetch"

    def prefetch(self, request: RequestView, cluster: ClusterView) -> bool:
        return True


class CostPrefetchBudget(CostPrefetch):
    """:class:`CostPrefetch`, and every serving node's NVMe writes capped at ``share`` of its
    drive's write rate: the fixed rule the learned write budget (``rl-router``'s fifth head)
    is measured against. It pays where writes crowd the loads off a drive and costs where the
    drive has room to keep what will be read: on fast idle drives, and at low load
    (docs/sim-eval, "The NVMe write budget head" and "A base for the residual, measured").

    Example::

        CostPrefetchBudget(share=0.1).disk_write_budget(NodeView("a", disk_write_gbps=2.0), ClusterView(()))  # 2e8
    """

    name = "cost-prefetch-budget"

    def __init__(self, share: float = FIXED_WRITE_SHARE, remote_weight: float = 0.5, local_limit: int = 1024) -> None:
        if not 0 < share <= 1:
            raise ConfigError(f"cost-prefetch-budget: share must be in (0, 1] of the drive's write rate, got {share}")
        super().__init__(remote_weight, local_limit)
        self.share = share
        if share != FIXED_WRITE_SHARE:  # reports say which share, by the name that builds it again
            self.name = f"{CostPrefetchBudget.name}:{share!r}"

    def disk_write_budget(self, node: NodeView, cluster: ClusterView) -> float | None:
        return budget_rate(self.share, node) if node.disk_write_gbps > 0 else None


class ReplicateHot(LocalFirstRing):
    """:class:`LocalFirstRing`, and a hit chain whose root page has been asked for
    ``threshold`` times or more is copied to the serving node when that node lacks part of
    it: hot shared prefixes (system prompts, documents) end up local everywhere they are read.

    Example::

        policy = ReplicateHot(threshold=2)
        view = ClusterView((NodeView("a"), NodeView("b")))
        request = RequestView(keys=(1, 2), requester="b", hit_nodes=("a", "a"))
        policy.replicate(request, view), policy.replicate(request, view)   # ([], ['b'])
    """

    name = "replicate-hot"

    def __init__(self, threshold: int = 4, local_limit: int = 1024) -> None:
        super().__init__(local_limit)
        self.threshold = threshold
        self._asked: dict[int, int] = {}

    def replicate(self, request: RequestView, cluster: ClusterView) -> list[str]:
        if not request.hit_nodes:
            return []
        root = request.keys[0]
        asked = self._asked[root] = self._asked.get(root, 0) + 1
        if asked < self.threshold or request.requester is None:
            return []
        return [request.requester] if any(h != request.requester for h in request.hit_nodes) else []


class PrefetchReplicate(ReplicateHot):
    """Routing by the front end or by :class:`CostRouter`, prefetch on or off, and hot-prefix
    replication at a given threshold (None: never): the points the oracle searches over
    (kvray/sim/oracle.py), beside Belady on every node.

    Example::

        PrefetchReplicate(prefetch=True, threshold=None).prefetch(RequestView(keys=(1,)), ClusterView(()))   # True
    """

    name = "prefetch-replicate"

    def __init__(
        self, prefetch: bool = True, threshold: int | None = None, cost_route: bool = False, local_limit: int = 1024
    ) -> None:
        super().__init__(threshold or 0, local_limit)
        self.always_prefetch = prefetch
        self.replicates = threshold is not None
        self._router = CostRouter(local_limit=local_limit) if cost_route else None

    def route(self, request: RequestView, cluster: ClusterView) -> str:
        return self._router.route(request, cluster) if self._router else super().route(request, cluster)

    def prefetch(self, request: RequestView, cluster: ClusterView) -> bool:
        return self.always_prefetch

    def replicate(self, request: RequestView, cluster: ClusterView) -> list[str]:
        return super().replicate(request, cluster) if self.replicates else []


CLUSTER_POLICIES: dict[str, type[ClusterPolicy]] = {
    "local-first": LocalFirstRing,
    "cost-router": CostRouter,
    "always-prefetch": AlwaysPrefetch,
    "cost-prefetch": CostPrefetch,
    "cost-prefetch-budget": CostPrefetchBudget,
    "replicate-hot": ReplicateHot,
}


LEARNED_ROUTER = "kvray.policy.residual:RLRouter"  # rl-router[:FOLDER]; by import path, as it builds on this module


def make_cluster_policy(name: str, local_limit: int | None = None) -> ClusterPolicy:
    """A cluster policy by registered name (:data:`CLUSTER_POLICIES`), ``rl-router`` (the
    shipped PPO residual on the cost router, :mod:`kvray.policy.residual`) or ``rl-router:PATH``
    (one trained by ``kvray train --cluster``), ``cost-prefetch-budget:SHARE`` (another share
    of each drive's write rate than :data:`FIXED_WRITE_SHARE`), or import path
    (``package.module:Class``, :mod:`kvray.policy.plugin`); ``local_limit``, when given, is
    the largest request a node keeps (the runtime's ``RuntimeConfig.local_limit``)."""
    from kvray.policy.plugin import is_import_path, policy_class

    if name == "rl-router" or name.startswith("rl-router:"):
        router = policy_class(LEARNED_ROUTER, ClusterPolicy)  # imported when named: it loads weights
        folder = name.partition(":")[2]
        policy = router(folder) if folder else router()
    elif name.startswith(f"{CostPrefetchBudget.name}:"):
        share = name.partition(":")[2]
        try:
            policy = CostPrefetchBudget(share=float(share))
        except ConfigError as exc:
            raise PolicyError(f"cluster policy {name!r}: {exc}") from None
        except ValueError:
            raise PolicyError(f"cluster policy {name!r}: the share after ':' must be a number, got {share!r}") from None
    elif is_import_path(name):
        policy = policy_class(name, ClusterPolicy)()
    elif name not in CLUSTER_POLICIES:
        known = ", ".join(sorted([*CLUSTER_POLICIES, "rl-router"]))
        raise PolicyError(f"unknown cluster policy {name!r}; known: {known}")
    else:
        policy = CLUSTER_POLICIES[name]()
    if local_limit is not None:
        policy.local_limit = local_limit
    return policy
