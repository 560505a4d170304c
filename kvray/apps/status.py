"""``kvray status``: the metrics of a running kvray runtime, read through its controller.

Each store's loads count every page it handed out, including those an engine on its node
copied out of the shared host tier itself and reported afterwards (with the copy's time):
most same-node hits never reach the store as a call.

The same figures are exported to Prometheus by the actors (:mod:`kvray.cluster.metrics`);
this reads them directly so a user needs no scraper to look.
"""

from __future__ import annotations

import ray
from rich.console import Console

from kvray.cluster.runtime import CALL_TIMEOUT_S, RayConnection
from kvray.cluster.shards import ControllerShards, merge_snapshots
from kvray.core.errors import ClusterError
from kvray.report import format_bytes, format_duration, print_table


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
    """The cluster's figures on one line, then a table of each store's traffic (hits, the
    latency and bytes of its loads, its stores and moves between tiers), a table of the tiers'
    occupancy and, with several controller shards, one of the shards."""
    c = snapshot["cluster"]
    hits = ", ".join(f"{t} {n}" for t, n in sorted(c["hit_pages_by_tier"].items())) or "-"
    console.print(
        f"nodes {len(c['nodes'])}  controller shards {len(c['shards'])}  indexed pages {c['indexed_pages']}  page hit rate {c['page_hit_rate']:.3f}  "
        f"hits per tier: {hits}  bytes between nodes {format_bytes(c['bytes_between_nodes'])}  lost pages {c['lost_pages']}"
    )
    traffic, tiers = [], []
    for node, stats in snapshot["stores"].items():
        if "error" in stats:
            traffic.append((node[:12], stats["error"], *["-"] * 5))
            continue
        load = stats["swap_latency"].get("load")
        traffic.append(
            (
                node[:12],
                str(stats["hit_pages"]),
                format_duration(load["p99_s"]) if load else "-",
                format_bytes(stats["bytes_loaded"]),
                format_bytes(stats["bytes_stored"]),
                format_bytes(stats["bytes_moved"]),
                f"{format_bytes(stats['sent_bytes'])} / {format_bytes(stats['received_bytes'])}",
            )
        )
        for tier, occ in stats["tiers"].items():
            tiers.append(
                (node[:12], tier, f"{occ['used']} / {occ['capacity']}", f"{occ['occupancy']:.2f}", f"{occ['fragmentation']:.2f}")
            )
    print_table(
        console,
        "kvray stores: traffic since they started",
        ("node", "hit pages", "load p99", "loaded", "stored", "between tiers", "to / from other nodes"),
        traffic,
        text=("node",),
    )
    print_table(
        console, "kvray tiers", ("node", "tier", "used / capacity", "occupancy", "fragmentation"), tiers, text=("node", "tier")
    )
    if len(c["shards"]) > 1:
        print_table(
            console,
            "kvray controller shards",
            ("shard", "indexed pages", "index bytes", "lookups", "open leases", "rebuilt pages"),
            [
                (str(s["shard"]), str(s["indexed_pages"]), format_bytes(s["index_bytes"]), str(s["lookups"]))
                + (str(s["open_leases"]), str(s["rebuilt_pages"]))
                for s in c["shards"]
            ],
        )
