"""The controller shards of one runtime, seen as one: routing by chain and merged views.

A runtime runs ``RuntimeConfig.controller_shards`` controller actors
(:class:`~kvray.cluster.controller.Controller`, each over its
:class:`~kvray.core.partition.Partition`), named ``controller_name(name, shard)``; shard 0
keeps the unsharded name, and its ``runtime_config`` says how many there are.
:class:`ControllerShards` holds their handles: a request's calls go to the shard owning its
chain (:meth:`ControllerShards.of`: one call per request, as with one controller),
membership changes go to every shard (every shard places pages on every node), as do
the stores' reports of pages they evicted (a store does not know which chain, hence
which shard, an evicted page belonged to; a write that evicted nothing sends none), and
:meth:`ControllerShards.snapshot` merges the shards' counters into the one snapshot a
single controller gives, with each shard's own figures under ``shards``.

Example::

    shards = ControllerShards.find("kvray")
    plan = ray.get(shards.for_keys(keys).lookup_pin.remote(keys, node_id, lease))
    shards.snapshot()["indexed_pages"]      # over all shards
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import ray

from kvray.cluster.config import NAMESPACE, controller_name
from kvray.core.errors import ClusterError
from kvray.core.partition import route_key, shard_of, short_prefix_shards

CALL_TIMEOUT_S = 60.0  # a controller shard that does not answer a metadata call within this is stuck
SUMMED = (
    "indexed_pages",
    "index_bytes",
    "lookups",
    "local_lookups",
    "lookup_pages",
    "bytes_between_nodes",
    "lost_pages",
    "open_leases",
    "expired_leases",
    "doomed_pages",
    "replica_locations",
    "rebuilt_pages",
)
PER_SHARD = ("indexed_pages", "index_bytes", "lookups", "open_leases", "rebuilt_pages", "rebuild_s")


class ControllerShards:
    """Handles of a runtime's controller shards, in shard order; see the module docstring.

    Example::

        shards = ControllerShards([controller])  # one shard: the unsharded runtime
        shards.of(keys)                          # 0
    """

    def __init__(self, handles: Sequence[ray.actor.ActorHandle], route_depth: int = 0) -> None:
        self.handles = list(handles)
        self.route_depth = route_depth  # RuntimeConfig.controller_route_depth

    @classmethod
    def find(cls, name: str, timeout_s: float = CALL_TIMEOUT_S) -> ControllerShards:
        """The shards of the runtime ``name`` on the connected cluster, or a ClusterError."""
        first = _named(name, 0)
        try:
            config = ray.get(first.runtime_config.remote(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise ClusterError(f"the kvray controller did not answer runtime_config within {timeout_s:g} s") from None
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
            raise ClusterError(f"the kvray controller is unavailable ({type(exc).__name__})") from None
        shards = [first, *(_named(name, shard) for shard in range(1, config.controller_shards))]
        return cls(shards, config.controller_route_depth)

    def __len__(self) -> int:
        return len(self.handles)

    def route_key(self, keys: Sequence[int]) -> int:
        """The key a request's chain ``keys`` (root first) is routed by (its page at the
        routing depth): what a caller storing the chain in parts sends with each part."""
        return route_key(keys, self.route_depth)

    def owner(self, route: int) -> int:
        """The shard chains routed by the key ``route`` go to."""
        return shard_of(route, len(self.handles))

    def of(self, keys: Sequence[int]) -> int:
        """The shard a request's chain ``keys`` (root first) is routed to."""
        return self.owner(self.route_key(keys))

    def short_prefix_owners(self, keys: Sequence[int]) -> dict[int, int]:
        """Shard -> the longest prefix of ``keys`` (root first) of at most ``route_depth``
        pages whose lookup asks it (:func:`~kvray.core.partition.short_prefix_shards`)."""
        return short_prefix_shards(keys, len(self.handles), self.route_depth)

    def for_keys(self, keys: Sequence[int]) -> ray.actor.ActorHandle:
        return self.handles[self.of(keys)]

    def broadcast(self, method: str, *args) -> list[ray.ObjectRef]:
        """``method(*args)`` on every shard (membership: every shard places on every node)."""
        return [getattr(handle, method).remote(*args) for handle in self.handles]

    def snapshot(self, timeout_s: float = CALL_TIMEOUT_S) -> dict:
        """Every shard's snapshot, merged (:func:`merge_snapshots`)."""
        return merge_snapshots(ray.get(self.broadcast("snapshot"), timeout=timeout_s))

    def pages_by_node(self, timeout_s: float = CALL_TIMEOUT_S) -> dict[str, int]:
        total: Counter = Counter()
        for counts in ray.get(self.broadcast("pages_by_node"), timeout=timeout_s):
            total.update(counts)
        return dict(total)

    def kill(self) -> None:
        """Stop every shard for good (the runtime is closing)."""
        for handle in self.handles:
            ray.kill(handle, no_restart=True)


def merge_snapshots(snaps: Sequence[dict]) -> dict:
    """One cluster snapshot from the shards' (``Controller.snapshot``): counters summed,
    nodes those any shard knows, the hit rate over all lookups, the slowest rebuild, and
    each shard's own figures under ``shards``."""
    merged = {**snaps[0], **{key: sum(s[key] for s in snaps) for key in SUMMED}}  # other keys: shard 0's
    pages_by_node: Counter = Counter()
    hits: Counter = Counter()
    for snap in snaps:
        pages_by_node.update(snap["pages_by_node"])
        hits.update(snap["hit_pages_by_tier"])
    merged.update(
        nodes=list(dict.fromkeys(node for s in snaps for node in s["nodes"])),
        pages_by_node=dict(pages_by_node),
        hit_pages_by_tier=dict(hits),
        page_hit_rate=sum(hits.values()) / merged["lookup_pages"] if merged["lookup_pages"] else 0.0,
        rebuild_s=max(s["rebuild_s"] for s in snaps),
        shards=[{"shard": s["shard"], **{k: s[k] for k in PER_SHARD}} for s in snaps],
    )
    return merged


def _named(name: str, shard: int) -> ray.actor.ActorHandle:
    try:
        return ray.get_actor(controller_name(name, shard), namespace=NAMESPACE)
    except ValueError:
        what = "no kvray runtime" if shard == 0 else f"no controller shard {shard} of the kvray runtime"
        raise ClusterError(
            f"{what} named {name!r} is running on this Ray cluster (start one with `kvray up --name {name}`)"
        ) from None
