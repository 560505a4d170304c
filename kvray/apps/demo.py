"""``kvray demo``: the real conversation trace on local Ray nodes, two policies side by side.

It replays a slice (from request 1000 on) of the bundled Mooncake conversation trace on ``nodes``
local Ray nodes (one engine and one store per node), once per contender, and prints a
table of what was measured: token hit rate, hits per tier, mean and p99 time to first
token, bytes moved. The contenders are LRU and ARC. Results go to ``<out>/demo.json`` and ``<out>/demo.png``.
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvray.cluster.config import RuntimeConfig
from kvray.apps.replay import ReplayResult, ReplaySettings, replay_on_runtime
from kvray.cluster.runtime import RayConnection
from kvray.core.config import TierSizes
from kvray.traces import read_trace

DEMO_TRACE = "conversation_trace_first30min.jsonl"  # shipped in data/traces (kvray.resources)
DEMO_HOST_PAGES = 1200  # per node, 512 KiB pages: ~0.6 GiB of host tier per node
DEMO_START = 1000  # ~5 minutes in: conversations already under way come back for more turns
TIER_ORDER = ("device", "host", "disk", "remote")


def contenders() -> dict[str, RuntimeConfig]:
    """LRU against ARC, with the same host tier."""
    tiers = TierSizes(host=DEMO_HOST_PAGES)
    return {policy: RuntimeConfig(name=f"demo-{policy}", policy=policy, tiers=tiers) for policy in ("lru", "arc")}


def run_demo(requests: int, nodes: int, out_dir: str | Path, console: Console) -> dict[str, ReplayResult]:
    trace = read_trace(DEMO_TRACE)[DEMO_START : DEMO_START + requests]
    results: dict[str, ReplayResult] = {}
    console.print(
        f"replaying requests {DEMO_START}..{DEMO_START + len(trace) - 1} of {DEMO_TRACE} on {nodes} local Ray nodes"
    )
    with RayConnection(nodes=nodes, object_store_mb=150):
        for label, config in contenders().items():
            settings = ReplaySettings(name=f"demo-{nodes}-nodes", nodes=nodes, runtime=config)
            results[label] = replay_on_runtime(trace, settings, progress=True)
    print_results(results, console)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "demo.json").write_text(json.dumps({k: r.as_dict() for k, r in results.items()}, indent=2))
    plot_results(results, out / "demo.png")
    console.print(f"saved {out / 'demo.json'} and {out / 'demo.png'}")
    return results


def print_results(results: dict[str, ReplayResult], console: Console) -> None:
    table = Table(title="kvray on Ray: measured replay (TTFT = lookup + load + prefill of misses)")
    for col in ("policy", "requests", "token hit rate", "hits per tier (tokens)", "mean TTFT ms", "p99 TTFT ms", "bytes moved"):
        table.add_column(col, justify="left" if col in ("policy", "hits per tier (tokens)") else "right")
    for label, result in results.items():
        r = result.as_dict()
        tiers = ", ".join(f"{t} {r['hit_tokens_by_tier'][t]}" for t in TIER_ORDER if t in r["hit_tokens_by_tier"])
        table.add_row(label, str(r["requests"]), f"{r['token_hit_rate']:.3f}", tiers or "-", f"{r['mean_ttft_ms']:.1f}",
                      f"{r['p99_ttft_ms']:.1f}", f"{r['bytes_moved'] / 2**20:.1f} MiB")
    console.print(table)


def plot_results(results: dict[str, ReplayResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(results)
    rows = [results[k].as_dict() for k in labels]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    bottom = [0.0] * len(labels)
    for tier in TIER_ORDER:
        share = [r["hit_tokens_by_tier"].get(tier, 0) / r["tokens"] if r["tokens"] else 0 for r in rows]
        if any(share):
            axes[0].bar(labels, share, bottom=bottom, label=tier)
            bottom = [b + s for b, s in zip(bottom, share)]
    axes[0].set_title("token hit rate by tier")
    axes[0].legend()
    for ax, key, title in ((axes[1], "mean_ttft_ms", "mean TTFT (ms)"), (axes[2], "p99_ttft_ms", "p99 TTFT (ms)")):
        ax.bar(labels, [r[key] for r in rows], color="tab:gray")
        ax.set_title(title)
    fig.suptitle("kvray demo: measured on local Ray nodes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
