"""``kvray status``: the metrics of a running kvray runtime, read through its controller.

The same figures are exported to Prometheus by the actors (:mod:`kvray.cluster.metrics`);
this reads them directly so a user needs no scraper to look.
"""

from __future__ import annotations

import ray
from rich.console import Console
from rich.table import Table

from kvray.cluster.runtime import CALL_TIMEOUT_S, RayConnection
from kvray.cluster.shards import ControllerShards, merge_snapshots
from kvray.core.errors import ClusterError


def fetch_status(address: str | None, name: str) -> dict:
    """The status of runtime ``name`` on an existing cluster (``address``, ``RAY_ADDRESS`` or
    the one on this machine): shard 0's (with the stores'), its cluster figures merged with
    the other controller shards'; every failure is a one-line ClusterError."""
    with RayConnection(address=address or "auto"):
        shards = ControllerShards.find(name, CALL_TIMEOUT_S)
        try:
            status = ray.get(shards.handles[0].status.remote(), timeout=CALL_TIMEOUT_S)
            others = ray.get([shard.snapshot.remote() for shard in shards.handles[1:]], timeout=CALL_TIMEOUT_S)
            return resolve_status({**status, "cluster": merge_snapshots([status["cluster"], *others])})
        except (ray.exceptions.RayError, TimeoutError) as exc:
            raise ClusterError(f"the controller of kvray runtime {name!r} did not answer: {type(exc).__name__}") from None


def resolve_status(status: dict, timeout_s: float = 10.0) -> dict:
    """The controller's ``status()`` with each store's stats awaited here, for at most
    ``timeout_s`` in all: a store that does not answer shows as an error, not a hang."""
    refs = status["stores"]
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    per_node = {}
    for node, ref in refs.items():
        try:
            per_node[node] = ray.get(ref) if ref in ready else {"error": "no answer"}
        except ray.exceptions.RayError as exc:
            per_node[node] = {"error": type(exc).__name__}
    return {"cluster": status["cluster"], "stores": per_node}


def print_status(snapshot: dict, console: Console) -> None:
    c = snapshot["cluster"]
    hits = ", ".join(f"{t} {n}" for t, n in sorted(c["hit_pages_by_tier"].items())) or "-"
    console.print(
        f"nodes {len(c['nodes'])}  controller shards {len(c['shards'])}  indexed pages {c['indexed_pages']}  page hit rate {c['page_hit_rate']:.3f}  "
        f"hits per tier: {hits}  bytes between nodes {c['bytes_between_nodes']}  lost pages {c['lost_pages']}"
    )
    table = Table(title="kvray stores")
    for col in ("node", "tier", "used / capacity", "occupancy", "fragmentation", "load p99 ms", "bytes moved"):
        table.add_column(col)
    for node, stats in snapshot["stores"].items():
        if "error" in stats:
            table.add_row(node[:12], "-", stats["error"], "", "", "", "")
            continue
        p99 = stats["swap_latency"].get("load", {}).get("p99_s", 0.0) * 1e3
        for tier, occ in stats["tiers"].items():
            table.add_row(
                node[:12],
                tier,
                f"{occ['used']} / {occ['capacity']}",
                f"{occ['occupancy']:.2f}",
                f"{occ['fragmentation']:.2f}",
                f"{p99:.2f}",
                str(stats["bytes_moved"]),
            )
    console.print(table)
    if len(c["shards"]) > 1:
        shards = Table(title="kvray controller shards")
        for col in ("shard", "indexed pages", "index bytes", "lookups", "open leases", "rebuilt pages"):
            shards.add_column(col)
        for s in c["shards"]:
            shards.add_row(
                *map(str, (s["shard"], s["indexed_pages"], s["index_bytes"], s["lookups"], s["open_leases"], s["rebuilt_pages"]))
            )
        console.print(shards)
