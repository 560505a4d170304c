"""Prometheus export of kvray's counters through Ray's metrics API.

Each store actor exports its node's tiers (occupancy, fragmentation, swap latency, bytes
moved between tiers) and the controller exports the cluster's hit rate, hits per tier and
bytes moved between nodes. Ray's metrics agent on every node serves them in Prometheus
format next to Ray's own metrics (``ray metrics launch-prometheus`` or any scraper pointed
at the node's metrics export port). All kvray series start with ``kvray_``.

Example::

    export_store_stats(node_id, store.stats())       # inside a store actor
    export_cluster_stats(controller_snapshot)          # inside the controller
"""

from __future__ import annotations

from functools import cache

from ray.util.metrics import Gauge

_SERIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "kvray_hit_rate": ("Fraction of looked-up pages served from a cache tier", ("shard",)),
    "kvray_hit_pages": ("Pages served per tier (remote = from another node)", ("tier", "shard")),
    "kvray_lookup_pages": ("Pages looked up by requests", ("shard",)),
    "kvray_bytes_moved": (
        "Bytes moved between tiers of a node (path tiers), out of them to engines (loads), into them (stores), between nodes",
        ("node", "path"),
    ),
    "kvray_occupancy": ("Used fraction of a tier's page slots", ("node", "tier")),
    "kvray_fragmentation": ("1 - longest free run / free slots of a tier", ("node", "tier")),
    "kvray_swap_latency_seconds": ("Latency of page loads, stores and tier moves", ("node", "op", "stat")),
    "kvray_indexed_pages": ("Pages in the controller's global prefix index", ("shard",)),
}


@cache
def _gauge(name: str) -> Gauge:
    description, tags = _SERIES[name]
    return Gauge(name, description=description, tag_keys=tags)


def export_store_stats(node: str, stats: dict) -> None:
    """Publish one store actor's :meth:`PageStore.stats` snapshot."""
    for path, key in (("tiers", "bytes_moved"), ("loads", "bytes_loaded"), ("stores", "bytes_stored")):
        _gauge("kvray_bytes_moved").set(stats[key], {"node": node, "path": path})
    for tier, occ in stats["tiers"].items():
        _gauge("kvray_occupancy").set(occ["occupancy"], {"node": node, "tier": tier})
        _gauge("kvray_fragmentation").set(occ["fragmentation"], {"node": node, "tier": tier})
    for op, summary in stats["swap_latency"].items():
        for stat in ("mean_s", "p50_s", "p99_s"):
            _gauge("kvray_swap_latency_seconds").set(summary[stat], {"node": node, "op": op, "stat": stat})


def export_cluster_stats(snapshot: dict) -> None:
    """Publish one controller shard's counters, tagged with its shard (sum over ``shard``
    for the cluster's; a hit rate is per shard)."""
    shard = str(snapshot["shard"])
    _gauge("kvray_hit_rate").set(snapshot["page_hit_rate"], {"shard": shard})
    _gauge("kvray_lookup_pages").set(snapshot["lookup_pages"], {"shard": shard})
    _gauge("kvray_indexed_pages").set(snapshot["indexed_pages"], {"shard": shard})
    for tier, pages in snapshot["hit_pages_by_tier"].items():
        _gauge("kvray_hit_pages").set(pages, {"tier": tier, "shard": shard})
    _gauge("kvray_bytes_moved").set(snapshot["bytes_between_nodes"], {"node": f"cluster-shard{shard}", "path": "nodes"})
