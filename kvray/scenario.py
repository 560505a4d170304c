"""Scenarios: the serving system a replay models, and how its requests queue for prefill.

A scenario (``simulations/*.yaml``) names a page layout, tiers (each a size in pages and
how fast pages get in and out of it), network, prefill compute, and for a cluster its kinds
of node, switch, links and front-end router. It is validated once here by pydantic;
afterwards every figure is trusted. Bandwidths are GB/s (1e9 bytes/s), latencies
microseconds. A tier's ``read_gbps`` is the rate at which a page reaches the engine's memory
from that tier (for disk and remote that includes the last PCIe hop), ``write_gbps`` the
rate at which a page is written into it. :class:`PrefillQueue` is its prefill engines
(``compute.servers``) serving requests first come, first served.

It sits below the simulator, the policies, training and the applications alike: the
simulator's cost model (:mod:`kvray.sim.cost`) turns a scenario into modeled time, the
adaptive policy (:mod:`kvray.policy.experts`) queues its shadow caches' prefills, and
``kvray run`` sizes a runtime from a scenario (docs/design.md, "Layers").

Example::
    from kvray.core.tiers import Tier
    from kvray.scenario import PrefillQueue, load_scenario

    scenario = load_scenario("h100-llama8b")     # a shipped scenario, or a YAML path
    assert scenario.capacities()[Tier.HOST] > 0
    queue = PrefillQueue(servers=1)
    assert (queue.serve(arrival_ms=0, service_ms=10), queue.serve(arrival_ms=5, service_ms=10)) == (0, 5)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from kvray.core.config import FrozenModel, PageLayout, load_yaml
from kvray.core.errors import ConfigError
from kvray.core.tiers import TIER_BY_LABEL, Tier
from kvray.resources import shipped_or_given


class TierSpec(FrozenModel):
    """One tier: its size in pages and how fast pages get in and out of it.

    ``shared_channel`` (the disk tier only): reads and writes take turns on the drive, as on
    an NVMe drive under mixed load, where writes (demotions, new pages) delay the loads that
    read it; False keeps the two directions apart (the scenarios' first model). Under a
    shared channel the cluster policy's NVMe write budget buys load time directly."""

    capacity_pages: int = Field(gt=0)
    read_gbps: float = Field(gt=0)
    write_gbps: float = Field(gt=0)
    latency_us: float = Field(default=0.0, ge=0)
    shared_channel: bool = False


class ComputeSpec(FrozenModel):
    """Prefill cost: a fixed launch overhead plus a cost per prompt token that is not cached."""

    prefill_us_per_token: float = Field(gt=0)
    prefill_overhead_ms: float = Field(default=0.0, ge=0)
    servers: int = Field(default=1, gt=0, le=4096)


def _check_tiers(tiers: dict[str, TierSpec]) -> None:
    unknown = sorted(set(tiers) - set(TIER_BY_LABEL))
    if unknown:
        raise ValueError(f"unknown tier(s) {', '.join(unknown)}; expected {', '.join(TIER_BY_LABEL)}")
    if not tiers:
        raise ValueError("a scenario needs at least one tier")
    shared = sorted(label for label, t in tiers.items() if t.shared_channel and label != "disk")
    if shared:
        raise ValueError(f"shared_channel is a drive's: tier(s) {', '.join(shared)} cannot take it, only disk")


class NodeSpec(FrozenModel):
    """A kind of node of a cluster scenario, ``count`` of them; what it leaves out is the
    scenario's (``tiers``, ``compute``, ``network_gbps``, ``network_latency_us``).
    ``compute.servers`` is its number of prefill engines (one GPU each: one PCIe lane each)."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    count: int = Field(default=1, gt=0, le=4096)
    tiers: dict[str, TierSpec] | None = None
    compute: ComputeSpec | None = None
    network_gbps: float | None = Field(default=None, gt=0)
    network_latency_us: float | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _known_tiers(self) -> NodeSpec:
        if self.tiers is not None:
            _check_tiers(self.tiers)
            if "remote" in self.tiers:
                raise ValueError("a cluster node has no remote tier: other nodes are the remote memory")
        return self


class SwitchSpec(FrozenModel):
    """A switch every cross-node byte crosses (aggregate bandwidth), when it is the bottleneck."""

    gbps: float = Field(gt=0)
    latency_us: float = Field(default=1.0, ge=0)


class LinkSpec(FrozenModel):
    """How links behave: ``queued`` (transfers wait for each other; the default of scenarios
    with ``nodes``) or not (single-node scenarios, as the first simulator modeled them), and
    the window (ms) over which a policy sees their utilisation."""

    queued: bool
    window_ms: float = Field(default=1000.0, gt=0)


class RouterSpec(FrozenModel):
    """The front end that lands each request on a node before the cluster policy's ``route``:
    ``sticky`` (a session stays on one node; node i draws sessions in proportion to
    ``1 / (i + 1) ** skew``), ``round-robin``, or ``none`` (the cluster policy alone decides)."""

    kind: Literal["sticky", "round-robin", "none"] = "sticky"
    skew: float = Field(default=0.0, ge=0)
    seed: int = 0


class Scenario(FrozenModel):
    """A node (or one engine's share of it), or a cluster of them: page layout, tiers,
    network and compute.

    Tiers are named ``device``, ``host``, ``disk``, ``remote``; an absent tier does not
    exist. ``remote`` pages cross the network: ``network_gbps`` caps their read rate.
    With ``nodes`` the scenario is a cluster (kvray.sim.cluster): each entry a kind of node,
    the top-level ``tiers``, ``compute`` and network settings their defaults; without it,
    one node of the top-level settings.
    """

    name: str = Field(min_length=1)
    description: str = ""
    layout: PageLayout
    tiers: dict[str, TierSpec]
    network_gbps: float = Field(default=25.0, gt=0)
    network_latency_us: float = Field(default=5.0, ge=0)
    compute: ComputeSpec
    nodes: list[NodeSpec] | None = Field(default=None, min_length=1)
    switch: SwitchSpec | None = None
    links: LinkSpec | None = None
    router: RouterSpec = RouterSpec()
    view_refresh_ms: float = Field(default=0.0, ge=0)  # policies' views recomputed at most this often

    @model_validator(mode="after")
    def _known_tiers(self) -> Scenario:
        _check_tiers(self.tiers)
        if self.nodes is not None:
            names = [n.name for n in self.nodes]
            if len(set(names)) != len(names):
                raise ValueError(f"node names must be unique, got {', '.join(names)}")
        return self

    @property
    def links_queued(self) -> bool:
        return self.links.queued if self.links is not None else self.nodes is not None

    @property
    def window_ms(self) -> float:
        return self.links.window_ms if self.links is not None else 1000.0

    def node_scenarios(self) -> list[Scenario]:
        """One single-node scenario per node (named ``kind`` or ``kind-i`` when counted),
        in the scenario's order; a scenario without ``nodes`` is its own one node."""
        if self.nodes is None:
            return [self]
        out = []
        for spec in self.nodes:
            node = self.model_copy(
                update={
                    "tiers": spec.tiers if spec.tiers is not None else self.tiers,
                    "compute": spec.compute or self.compute,
                    "network_gbps": spec.network_gbps or self.network_gbps,
                    "network_latency_us": (
                        spec.network_latency_us if spec.network_latency_us is not None else self.network_latency_us
                    ),
                    "nodes": None,
                }
            )
            for i in range(spec.count):
                out.append(node.model_copy(update={"name": spec.name if spec.count == 1 else f"{spec.name}-{i}"}))
        return out

    def capacities(self) -> dict[Tier, int]:
        return {TIER_BY_LABEL[name]: spec.capacity_pages for name, spec in self.tiers.items()}

    def with_bandwidth(self, scale: float) -> Scenario:
        """This scenario with every link ``scale`` times as fast (each tier's read and write
        rate, the network, the switch, every kind of node's overrides), named for it: the
        held-out bandwidths of the learned policy's generalisation protocol (docs/sim-eval).

        Example::

            load_scenario("h100-llama8b").with_bandwidth(0.5).tiers["disk"].read_gbps   # 3.5
        """
        if not scale > 0:
            raise ValueError(f"bandwidth scale must be positive, got {scale}")
        scaled = self._with_tiers(
            f"{self.name}@bandwidth-x{scale:g}",
            lambda name, t: t.model_copy(update={"read_gbps": t.read_gbps * scale, "write_gbps": t.write_gbps * scale}),
            lambda n: {"network_gbps": None if n.network_gbps is None else n.network_gbps * scale},
        )
        switch = None if self.switch is None else self.switch.model_copy(update={"gbps": self.switch.gbps * scale})
        return scaled.model_copy(update={"network_gbps": self.network_gbps * scale, "switch": switch})

    def with_shared_disk(self) -> Scenario:
        """This scenario with every drive's reads and writes on one channel
        (:attr:`TierSpec.shared_channel`), named for it: the drive model under which the
        cluster policy's write budget pays most (docs/sim-eval, "The NVMe write budget head").

        Example::

            load_scenario("h100-4node-skewed").with_shared_disk().tiers["disk"].shared_channel   # True
        """
        if not any("disk" in n.tiers for n in self.node_scenarios()):
            raise ConfigError(f"scenario {self.name!r} has no disk tier: no drive to share a channel (--shared-disk)")
        return self._with_tiers(
            f"{self.name}@shared-disk",
            lambda name, t: t.model_copy(update={"shared_channel": True}) if name == "disk" else t,
            lambda n: {},
        )

    def _with_tiers(self, name: str, tier: Callable[[str, TierSpec], TierSpec], node: Callable[[NodeSpec], dict]) -> Scenario:
        """A copy named ``name`` with ``tier`` applied to every tier spec, the scenario's and
        each kind of node's overrides, and ``node``'s other updates to each kind of node."""

        def tiers(specs: dict[str, TierSpec]) -> dict[str, TierSpec]:
            return {label: tier(label, t) for label, t in specs.items()}

        nodes = None
        if self.nodes is not None:
            nodes = [n.model_copy(update={"tiers": None if n.tiers is None else tiers(n.tiers), **node(n)}) for n in self.nodes]
        return self.model_copy(update={"name": name, "tiers": tiers(self.tiers), "nodes": nodes})

    def scaled(self, fast_pages: int) -> dict[Tier, int]:
        """Tier sizes with device + host = ``fast_pages``, every tier keeping its ratio to them."""
        caps = self.capacities()
        fast = caps.get(Tier.DEVICE, 0) + caps.get(Tier.HOST, 0)
        if fast == 0:
            raise ValueError(f"scenario {self.name!r} has neither a device nor a host tier to size")
        scale = fast_pages / fast
        sized = {t: max(1, round(c * scale)) for t, c in caps.items()}
        if Tier.DEVICE in sized and Tier.HOST in sized:
            sized[Tier.HOST] = max(1, fast_pages - sized[Tier.DEVICE])
        return sized


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario YAML (a path, or the name of a shipped scenario);
    errors (ConfigError) name the file and field."""
    return load_yaml(shipped_or_given(path, "simulations", ".yaml"), Scenario)


DEFAULT_SCENARIO = "h100-llama8b"  # shipped in simulations/ (kvray.resources)
DEFAULT_CLUSTER_SCENARIO = "simulations/h100-2node-train.yaml"  # what cluster training replays (never an evaluated cluster)


class PrefillQueue:
    """First-come first-served prefill engines: requests wait while every engine is busy.

    Replaying the trace's real arrival times through it is what makes a policy's saved
    prefill time show up as less queueing under load, as it does on a busy server.
    ``busy_ms`` sums the time engines spent on requests (from a request's start to its
    end, loads included): over a replay's span and engines, how loaded they were.

    Example::

        queue = PrefillQueue(servers=1)
        queue.serve(arrival_ms=0, service_ms=10), queue.serve(arrival_ms=5, service_ms=10)  # (0, 5)
        queue.busy_ms                                                                       # 20.0
    """

    def __init__(self, servers: int) -> None:
        self._free_at = [0.0] * servers
        self.busy_ms = 0.0

    def serve(self, arrival_ms: float, service_ms: float) -> float:
        """Run a request on the earliest free engine; returns how long it waited."""
        i, start = self.start(arrival_ms)
        self.finish(i, start, start + service_ms)
        return start - arrival_ms

    def start(self, arrival_ms: float) -> tuple[int, float]:
        """The earliest free engine and when it starts a request arriving at ``arrival_ms``;
        :meth:`finish` says when it is free again (when loads decide the service time)."""
        i = min(range(len(self._free_at)), key=self._free_at.__getitem__)
        return i, max(arrival_ms, self._free_at[i])

    def finish(self, engine: int, start_ms: float, end_ms: float) -> None:
        """Engine ``engine`` ran a request from ``start_ms`` (as :meth:`start` said) to ``end_ms``."""
        self._free_at[engine] = end_ms
        self.busy_ms += end_ms - start_ms

    def backlog_ms(self, now_ms: float) -> float:
        """Work still queued ahead of a request arriving at ``now_ms`` (the load signal)."""
        return max(0.0, min(self._free_at) - now_ms)
