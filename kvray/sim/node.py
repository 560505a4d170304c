"""The cluster simulator's parts: a simulated node, the nodes' sizes and the front end.

A :class:`SimNode` is one node as :class:`~kvray.sim.cluster.ClusterSimulator` models it:
a real :class:`~kvray.core.manager.CacheManager` with its own
:class:`~kvray.core.placement.PlacementPolicy`, prefill engines (a
:class:`~kvray.scenario.PrefillQueue`) and links (:mod:`kvray.sim.links`): the GPU's memory,
PCIe host-to-device and device-to-host (one lane per engine), NVMe read and write, NIC in
and out. :func:`node_capacities` sizes every node's tiers; :class:`Router` is the scenario's
front end, which lands a request's session on a node before any cluster policy decides.

Example::
    from kvray.policy import make_policy
    from kvray.scenario import load_scenario
    from kvray.sim.node import SimNode

    node = SimNode(0, load_scenario("h100-llama8b"), make_policy("lru"), queued=True)
    node.view(0.0).backlog_ms      # 0.0: nothing queued yet
"""

from __future__ import annotations

import bisect
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import numpy as np

from kvray.core.errors import ConfigError
from kvray.core.index import ROOT
from kvray.core.manager import CacheManager
from kvray.core.placement import LRUPolicy, PlacementPolicy
from kvray.core.tiers import Tier
from kvray.policy.cluster import NodeView
from kvray.policy.experts import native, use_compiled_chain
from kvray.scenario import PrefillQueue, RouterSpec, Scenario
from kvray.sim.cost import CostModel
from kvray.sim.links import Link, book, transfer_ms
from kvray.traces import TraceRequest, unique_blocks

try:  # the chain writer in C (kvray/sim/_chain.c); without it the manager's own, in Python
    from kvray.sim import _chain
except ImportError:  # a checkout whose extensions are not built
    _chain = None

use_compiled_chain(_chain)  # the policies' shadow caches store through it too
TIERS = tuple(Tier)


@contextmanager
def python_chain_writer() -> Iterator[None]:
    """Replays in this block store chains with the manager's Python only: the reference that
    :mod:`kvray.sim._chain` transcribes, which tests and the benchmark compare it with."""
    global _chain
    compiled, _chain = _chain, None
    use_compiled_chain(None)
    try:
        yield
    finally:
        _chain = compiled
        use_compiled_chain(compiled)


def session_of(request: TraceRequest) -> str:
    """The flow a request belongs to for fair sharing and sticky routing: its first two
    prefix ids (the shared system prompt and the conversation or document that follows it)."""
    return "/".join(map(str, request.hash_ids[:2]))


def node_capacities(
    scenario: Scenario, trace: Sequence[TraceRequest], fraction: float | None = None, pages: int | None = None
) -> list[dict[Tier, int]]:
    """Tier sizes of every node: the scenario's own, or device + host over the whole cluster
    = ``pages`` or ``fraction`` of the trace's unique pages, shared among nodes in
    proportion to their own device + host, every tier of a node keeping its ratio to them."""
    nodes = scenario.node_scenarios()
    if fraction is not None and pages is not None:
        raise ConfigError("give --capacity-fraction or --capacity, not both")
    if fraction is not None:
        if not 0 < fraction <= 100:
            raise ConfigError(f"capacity fraction must be in (0, 100], got {fraction}")
        pages = max(1, round(fraction * unique_blocks(list(trace))))
    if pages is None:
        return [n.capacities() for n in nodes]
    if pages <= 0:
        raise ConfigError(f"capacity must be a positive number of pages, got {pages}")
    fast = [sum(c for t, c in n.capacities().items() if t in (Tier.DEVICE, Tier.HOST)) for n in nodes]
    if not all(fast):
        bare = next(n.name for n, f in zip(nodes, fast) if not f)
        raise ConfigError(f"node {bare!r} of scenario {scenario.name!r} has neither a device nor a host tier to size")
    total = sum(fast)
    return [n.scaled(max(1, round(pages * f / total))) for n, f in zip(nodes, fast)]


class Router:
    """The scenario's front end (:class:`~kvray.scenario.RouterSpec`): a node index per
    request, or None when the cluster policy alone routes.

    Example::

        router = Router(RouterSpec(kind="sticky", skew=1.0), nodes=4)
        router.land("7/12") == router.land("7/12")     # True: a session stays put
    """

    def __init__(self, spec: RouterSpec, nodes: int) -> None:
        self.spec = spec
        self.nodes = nodes
        weights = [(i + 1) ** -spec.skew for i in range(nodes)]
        total = sum(weights)
        self._cumulative = list(np.cumsum(weights) / total)
        self._next = 0

    def land(self, session: str) -> int | None:
        if self.spec.kind == "none":
            return None
        if self.spec.kind == "round-robin":
            node = self._next
            self._next = (node + 1) % self.nodes
            return node
        draw = zlib.crc32(f"{self.spec.seed}:{session}".encode()) / 2**32  # stable across processes
        return min(bisect.bisect_right(self._cumulative, draw), self.nodes - 1)


class SimNode:
    """One node: its cache manager and policy, prefill engines, links and the paths pages
    take between its tiers.

    Example::

        node = SimNode(0, load_scenario("h100-llama8b"), make_policy("lru"), queued=True)
        node.move_path[Tier.HOST, Tier.DISK]     # (nvme_write,)
    """

    def __init__(
        self,
        index: int,
        scenario: Scenario,
        policy: PlacementPolicy,
        capacities: Mapping[Tier, int] | None = None,
        queued: bool = True,
        window_ms: float = 1000.0,
    ) -> None:
        self.index = index
        self.name = scenario.name
        self.cost = CostModel(scenario)
        self.page_nbytes = self.cost.page_nbytes
        self.queue = PrefillQueue(scenario.compute.servers)
        self.engines = scenario.compute.servers
        self.manager = CacheManager(capacities or scenario.capacities(), policy, page_nbytes=self.page_nbytes)
        self.policy = policy
        self.tier_cost = self.cost.tier_cost(self.manager.slots)
        self._allocators = [(t.label, a) for t, a in sorted(self.manager.slots.items())]
        self.clock = 0.0  # modeled time of the moves the manager asks for now
        self.background_ms = 0.0  # modeled time of the moves between tiers (their links' busy time)
        tiers = {TIER_BY_NAME[name]: spec for name, spec in scenario.tiers.items()}
        self.disk_write_gbps = tiers[Tier.DISK].write_gbps if Tier.DISK in tiers else 0.0  # NodeView's
        self.access_ms = [tiers[t].latency_us / 1e3 if t in tiers else 0.0 for t in TIERS]
        engines = scenario.compute.servers

        def link(name: str, gbps: float, latency_us: float = 0.0, lanes: int = 1) -> Link:
            return Link(f"{self.name}/{name}", gbps, latency_us, lanes, queued, window_ms)

        host = tiers.get(Tier.HOST)
        self.h2d = link("pcie_h2d", host.read_gbps if host else PCIE_GBPS, lanes=engines)
        self.d2h = link("pcie_d2h", host.write_gbps if host else PCIE_GBPS, lanes=engines)
        self.nic_in = link("nic_in", scenario.network_gbps, scenario.network_latency_us)
        self.nic_out = link("nic_out", scenario.network_gbps)
        self.links = [self.h2d, self.d2h, self.nic_in, self.nic_out]
        to_host: dict[Tier, tuple[Link, ...]] = {Tier.HOST: ()}
        from_host: dict[Tier, tuple[Link, ...]] = {Tier.HOST: ()}
        self.load_path: dict[Tier, tuple[Link, ...]] = {Tier.HOST: (self.h2d,)}
        if Tier.DEVICE in tiers:
            hbm = link("hbm", tiers[Tier.DEVICE].read_gbps, lanes=engines)
            self.links.append(hbm)
            to_host[Tier.DEVICE], from_host[Tier.DEVICE] = (self.d2h,), (self.h2d,)
            self.load_path[Tier.DEVICE] = (hbm,)
        if Tier.DISK in tiers:
            disk = tiers[Tier.DISK]
            self.nvme_read, self.nvme_write = link("nvme_read", disk.read_gbps), link("nvme_write", disk.write_gbps)
            self.links += [self.nvme_read, self.nvme_write]
            read, write = (self.nvme_read,), (self.nvme_write,)
            if disk.shared_channel:  # one queue both directions book, never the bottleneck of either
                drive = link("nvme", max(disk.read_gbps, disk.write_gbps))
                self.links.append(drive)
                read, write = (self.nvme_read, drive), (self.nvme_write, drive)
            to_host[Tier.DISK], from_host[Tier.DISK] = read, write
            self.load_path[Tier.DISK] = (*read, self.h2d)
        if Tier.REMOTE in tiers:  # single-node scenarios: peers' memory as a tier, over the network
            remote = tiers[Tier.REMOTE]
            read = link("remote_read", min(remote.read_gbps, scenario.network_gbps), scenario.network_latency_us)
            write = link("remote_write", remote.write_gbps)
            self.links += [read, write]
            to_host[Tier.REMOTE], from_host[Tier.REMOTE] = (read,), (write,)
            self.load_path[Tier.REMOTE] = (read, self.h2d)
        self.to_host, self.from_host = to_host, from_host
        self.move_path = {(s, d): to_host[s] + from_host[d] for s in to_host for d in from_host if s != d}
        self.move_path.update({(Tier.DEVICE, d): (self.d2h,) + from_host[d] for d in from_host if d != Tier.DEVICE})
        # a new page leaves the engine's GPU: nothing moves when it stays in the device tier
        self.store_path = {t: (self.d2h,) + from_host[t] for t in from_host if t != Tier.DEVICE}
        self.store_path[Tier.DEVICE] = ()
        self._moves = {}  # (src, dst) -> path, duration, kind: the mover's per-page constants
        for (src, dst), path in self.move_path.items():
            latency = self.access_ms[src] + self.access_ms[dst]
            self._moves[src, dst] = (path, transfer_ms(path, self.page_nbytes, latency), "demote" if dst > src else "promote")
        self._stores = {t: (path, transfer_ms(path, self.page_nbytes, self.access_ms[t])) for t, path in self.store_path.items()}
        self.write: Callable[[int, int, Tier, int, int], int] = self._write_local

    def mover(self, handle: int, src: Tier, src_slot: int, dst: Tier, dst_slot: int) -> None:
        """The manager's data plane here: the move occupies the links between the two tiers."""
        path, duration, kind = self._moves[src, dst]
        book(path, self.clock, duration, self.page_nbytes, kind)
        self.background_ms += duration

    def store_chain(
        self,
        keys: Sequence[int],
        write: Callable[[int, int, Tier, int, int], int],
        *,
        parent: int = ROOT,
        tenant: str = "",
        start: int = 0,
        stop: int | None = None,
    ) -> int:
        """``manager.store_chain`` of ``keys`` with this node's mover: in C (:mod:`kvray.sim._chain`,
        a transcription of the manager's chain writer, LRU's hooks and the links' bookings, one
        call per request instead of ~60 Python calls per stored page) where it is exact (no page
        kept from outside, no disk write budget; LRU's hooks run in C, any other policy's are
        called from C as the manager calls them, unless its ``compiled_chain`` is false), else
        the manager's Python, which is the reference: both give the same replays to the bit
        (tests/sim/test_replay_fingerprint.py, tests/sim/test_chain.py)."""
        manager = self.manager
        stop = len(keys) if stop is None else stop
        if _chain is not None and manager.chain_compilable:
            local = None if write == self._write_local else write
            if type(self.policy) is LRUPolicy:
                return _chain.store_chain(manager, self, keys, local, parent, start, stop)
            # the manager's part in C, the policy's hooks called as Python calls them
            return _chain.store_chain(manager, self, keys, local, parent, start, stop, tenant, True, *native(self.policy))
        return manager.store_chain(keys, self.mover, write, parent=parent, tenant=tenant, start=start, stop=stop)

    def _write_local(self, depth: int, key: int, tier: Tier, slot: int, parent: int) -> int:
        """A page computed by this node's engine goes into ``tier`` here (checksum 0: no bytes)."""
        path, duration = self._stores[tier]
        book(path, self.clock, duration, self.page_nbytes, "store")
        return 0

    def view(self, now_ms: float) -> NodeView:
        return NodeView(
            name=self.name,
            backlog_ms=self.queue.backlog_ms(now_ms),
            free_share={label: 1.0 - a.used / a.capacity for label, a in self._allocators},
            nic_in_util=self.nic_in.utilisation(now_ms),
            nic_out_util=self.nic_out.utilisation(now_ms),
            pcie_util=max(self.h2d.utilisation(now_ms), self.d2h.utilisation(now_ms)),
            disk_read_util=self.nvme_read.utilisation(now_ms) if Tier.DISK in self.to_host else 0.0,
            disk_write_util=self.nvme_write.utilisation(now_ms) if Tier.DISK in self.to_host else 0.0,
            disk_write_gbps=self.disk_write_gbps,
        )


TIER_BY_NAME = {t.label: t for t in Tier}
PCIE_GBPS = 50.0  # a node without a host tier still has PCIe (Gen5 x16, ~50 GB/s copies)
