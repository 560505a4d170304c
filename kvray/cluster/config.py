"""Settings of the Ray runtime, validated once where they enter (CLI, scenario YAML).

Example::

    cfg = RuntimeConfig(tiers=TierSizes(host=128, disk=512), disk_root="/tmp/kvray", policy="lru")
    cfg.store_config("node-a").disk_dir          # /tmp/kvray/kvray-node-a
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from kvray.cluster.keepalive import Keepalive
from kvray.cluster.observe import LinkSpeeds
from kvray.core.config import FrozenModel, PageLayout, StoreConfig, TierSizes
from kvray.core.errors import PolicyError
from kvray.core.keys import ModelFingerprint
from kvray.core.placement import PlacementPolicy
from kvray.core.tiers import TIER_BY_LABEL, Tier
from kvray.policy import make_policy
from kvray.policy.cluster import ClusterPolicy, make_cluster_policy

# The default page: 512 tokens (one Mooncake trace block) of a 2-layer slice of a
# Qwen2.5-0.5B-shaped KV (2 KV heads, head dim 64, fp16): 512 KiB, small enough that a
# demo replays hundreds of requests with real bytes on a 2-core, 24 GiB machine.
DEFAULT_LAYOUT = PageLayout(layers=2, kv_heads=2, head_dim=64, page_tokens=512, dtype="float16")


NAMESPACE = "kvray"  # the Ray namespace of every kvray actor
NAME_CHARS = 40  # the longest a runtime name (RuntimeConfig.name) may be


def controller_name(name: str, shard: int = 0) -> str:
    """Shard 0 keeps the unsharded name, so a runtime is found by it whatever its shard count."""
    return f"{name}-controller" if shard == 0 else f"{name}-controller-{shard}"


def store_name(name: str, node_id: str) -> str:
    return f"{name}-store-{node_id[:16]}"


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class RuntimeConfig(FrozenModel):
    """What every store actor and the controller of one kvray runtime share.

    ``tiers`` are per node. The node of each new page is the ``cluster_policy``'s choice
    (:mod:`kvray.policy.cluster`); the default, ``local-first``, keeps a request's pages on
    the requesting engine's node when the request fits in ``local_pages_limit`` pages
    (default: the node's host tier) and otherwise spreads them over all nodes by consistent
    hashing. The policy sees link utilisations as shares of ``links`` over the last
    ``observe_window_s``; each node's placement policy is told, as a request arrives, the
    engine's backlog and ``tier_cost`` (each tier's page load time relative to recomputing
    the page, as ``kvray calibrate`` measured it; ``kvray run`` takes it from a simulator
    scenario; None leaves the policy its own constants), and, where ``page_prefill_ms`` (the
    engine's time to recompute one page) is given, the request's arrival, that time and the
    node's ``prefill_engines``: adaptive policies then weigh modeled waiting time, as in
    training (:mod:`kvray.policy.experts`), rather than pages. Cross-node loads go by direct TCP
    to the peer's page server when ``tcp`` is on (no Ray call on the way), or by NIXL for the
    peers it has moved pages from faster (``nixl``: True tries it wherever the ``nixl``
    package is installed, ``"auto"`` only on nodes with an RDMA NIC, False never); otherwise runs
    of at least ``collective_min_bytes`` use the collective path (gloo on CPU) where the
    runtime formed a collective group (``collective``), smaller ones and the rest Ray's object
    store. ``collective`` is off by default: with TCP on no load takes that path, and Ray's
    collective loads torch in every store (~2.7 s more per runtime start on 2 cores); a
    deployment whose clients turn TCP off turns it on. A lease (the controller's pins of one request's cached
    prefix) ends at ``release`` or after ``lease_ttl_s``, whichever comes first; it should
    outlast a client's calls of one request (``KvrayClient`` waits ``timeout_s`` per call).
    The metadata is split over ``controller_shards`` controller actors, each owning the
    chains whose page at depth ``controller_route_depth`` hashes to it (0: the root page;
    d: the first page past a shared prompt of d pages, which every shard then indexes, so
    traffic under one prompt spreads; :mod:`kvray.core.partition`, :mod:`kvray.cluster.shards`;
    README: sizing shards).

    No wait of the runtime is unbounded. :meth:`Runtime.start <kvray.cluster.runtime.Runtime.start>`
    gives up after ``start_timeout_s`` (a store that cannot be placed, say: its node's
    ``store_resources`` are taken), naming the stores that did not come up. A store waits at
    most ``peer_timeout_s`` for another kvray process: an actor's answer, a peer's send or
    receive on the collective path, a page-server client in the middle of a request.
    ``keepalive`` probes idle page-server connections, so one whose client host died is
    closed (:class:`~kvray.cluster.keepalive.Keepalive`).
    """

    name: str = Field(default="kvray", pattern=rf"^[A-Za-z0-9_-]{{1,{NAME_CHARS}}}$")
    layout: PageLayout = DEFAULT_LAYOUT
    model_name: str = "kvray-replay"
    model_revision: str | None = Field(default=None, min_length=1, max_length=256)  # see StoreConfig
    tiers: TierSizes = TierSizes(host=256)
    policy: str = "lru"
    cluster_policy: str = "local-first"
    links: LinkSpeeds = LinkSpeeds()
    observe_window_s: float = Field(default=1.0, gt=0)
    tier_cost: dict[str, float] | None = None
    page_prefill_ms: float | None = Field(default=None, gt=0)
    prefill_engines: int = Field(default=1, gt=0, le=4096)
    disk_root: Path | None = None
    checksum_memory: bool = False
    tcp: bool = True
    collective: bool = False  # a fallback behind TCP that costs every store a torch import
    collective_min_bytes: int = Field(default=1 << 20, ge=0)  # measured: gloo beats the object store from 2 MiB up
    nixl: bool | Literal["auto"] = "auto"  # see kvray.cluster.paths.nixl_wanted; chosen per peer only where it moved pages faster
    local_pages_limit: int | None = Field(default=None, ge=0)
    max_request_pages: int = Field(default=256, gt=0)
    lease_ttl_s: float = Field(default=120.0, gt=0)
    controller_shards: int = Field(default=1, ge=1, le=256)
    controller_route_depth: int = Field(default=0, ge=0, le=1024)
    store_resources: dict[str, float] = {}
    start_timeout_s: float = Field(default=120.0, gt=0)
    peer_timeout_s: float = Field(default=60.0, gt=0)
    keepalive: Keepalive = Keepalive()

    @model_validator(mode="after")
    def _known_policies(self) -> RuntimeConfig:
        try:
            make_policy(self.policy)
            make_cluster_policy(self.cluster_policy)
        except PolicyError as exc:
            raise ValueError(str(exc)) from None
        return self

    @model_validator(mode="after")
    def _known_tier_costs(self) -> RuntimeConfig:
        unknown = sorted(set(self.tier_cost or {}) - set(TIER_BY_LABEL))
        if unknown:
            raise ValueError(f"tier_cost: unknown tier(s) {', '.join(unknown)}; expected {', '.join(TIER_BY_LABEL)}")
        if any(cost < 0 for cost in (self.tier_cost or {}).values()):
            raise ValueError("tier_cost: a tier's cost relative to recomputing a page must be >= 0")
        return self

    @model_validator(mode="after")
    def _fits(self) -> RuntimeConfig:
        if self.tiers.disk and self.disk_root is None:
            raise ValueError("tiers.disk > 0 needs disk_root")
        need = (self.tiers.host + self.tiers.device) * self.layout.page_nbytes
        have = physical_memory_bytes()
        if need > have:
            raise ValueError(
                f"tiers: host+device of {self.tiers.host + self.tiers.device} pages x "
                f"{self.layout.page_nbytes} bytes = {need / 2**30:.1f} GiB per node exceeds "
                f"this machine's memory ({have / 2**30:.1f} GiB)"
            )
        return self

    @property
    def local_limit(self) -> int:
        return self.tiers.host if self.local_pages_limit is None else self.local_pages_limit

    def make_placement_policy(self) -> PlacementPolicy:
        """A node store's placement policy, built from ``policy`` (each store its own)."""
        return make_policy(self.policy)

    def make_cluster_policy(self) -> ClusterPolicy:
        """The controller's cluster policy, keeping requests of up to ``local_limit`` pages local."""
        return make_cluster_policy(self.cluster_policy, local_limit=self.local_limit)

    def tier_costs(self) -> dict[Tier, float] | None:
        """``tier_cost`` by tier, as :class:`~kvray.core.placement.RequestInfo` carries it."""
        return None if self.tier_cost is None else {TIER_BY_LABEL[t]: c for t, c in self.tier_cost.items()}

    def fingerprint(self) -> ModelFingerprint:
        """What every page key of this runtime binds: the stores' and the clients' alike."""
        return ModelFingerprint.of(self.layout, self.model_name, self.model_revision)

    def store_config(self, node_id: str, host_shared_memory: str | None = None) -> StoreConfig:
        """One node store's settings; ``host_shared_memory`` names its shared host segment."""
        disk_dir = self.disk_root / f"{self.name}-{node_id[:16]}" if self.disk_root else None
        return StoreConfig(
            layout=self.layout,
            model_name=self.model_name,
            model_revision=self.model_revision,
            tiers=self.tiers,
            disk_dir=disk_dir,
            checksum_memory=self.checksum_memory,
            max_request_tokens=self.max_request_pages * self.layout.page_tokens,
            host_shared_memory=host_shared_memory,
        )
