"""``kvray demo``: what kvray buys, measured, then the real conversation trace on local Ray
nodes, without and with kvray.

It leads with a small closed-loop multi-round QA on two engines (:mod:`kvray.apps.multiround`):
time to first token per round without a cache and with kvray, printed and plotted
(``<out>/multiround_ttft.png``). Then it replays a slice (from request 1000 on) of the bundled Mooncake conversation trace on ``nodes``
local Ray nodes (one engine and one store per node), once per contender, and prints a
table of what was measured: token hit rate, hits per tier, mean and p99 time to first
token, bytes moved. The contenders are the same engines recomputing every prompt (no
cache: what an engine without kvray does) and with kvray's tiers under LRU, so the table
shows what kvray buys. Results go to ``<out>/demo.json`` and ``<out>/demo.png``. The last
line says what kvray bought in the QA and how that was measured.
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from kvray.apps.multiround import run_multiround, summary_line
from kvray.apps.replay import ReplayResult, ReplaySettings, replay_on_runtime
from kvray.apps.results import TIER_ORDER, print_results
from kvray.cluster.config import RuntimeConfig
from kvray.cluster.runtime import RayConnection
from kvray.core.config import TierSizes
from kvray.traces import read_trace

DEMO_TRACE = "conversation_trace_first30min.jsonl"  # shipped in data/traces (kvray.resources)
DEMO_HOST_PAGES = 1200  # per node, 512 KiB pages: ~0.6 GiB of host tier per node
DEMO_START = 1000  # ~5 minutes in: conversations already under way come back for more turns
NO_CACHE = "no cache"
KVRAY = "kvray (lru)"


def contenders(nodes: int) -> dict[str, ReplaySettings]:
    """The same engines recomputing every prompt, and with kvray's host tier under LRU
    (the no-cache runtime gets one page per node: it is never asked for any)."""
    return {
        label: ReplaySettings(
            name=f"demo-{nodes}-nodes",
            nodes=nodes,
            cache=cache,
            runtime=RuntimeConfig(name=f"demo-{runtime}", tiers=TierSizes(host=host)),
        )
        for label, runtime, host, cache in ((NO_CACHE, "nocache", 1, False), (KVRAY, "kvray", DEMO_HOST_PAGES, True))
    }


def run_demo(
    requests: int, nodes: int, out_dir: str | Path, console: Console, rounds: int = 4, users: int = 2
) -> dict[str, ReplayResult]:
    """The multi-round QA (``users`` x ``rounds``; 0 rounds: skipped), then the replay of
    ``requests`` trace requests on ``nodes`` local Ray nodes; ends with the QA's summary line."""
    out = Path(out_dir)
    qa = run_multiround(users, rounds, out, console) if rounds else []
    trace = read_trace(DEMO_TRACE)[DEMO_START : DEMO_START + requests]
    results: dict[str, ReplayResult] = {}
    console.print(f"replaying requests {DEMO_START}..{DEMO_START + len(trace) - 1} of {DEMO_TRACE} on {nodes} local Ray nodes")
    with RayConnection(nodes=nodes, object_store_mb=150):
        for label, settings in contenders(nodes).items():
            results[label] = replay_on_runtime(trace, settings, progress=True)
    print_results(results, console, title="kvray on Ray: measured replay (TTFT = lookup + load + prefill of misses)")
    out.mkdir(parents=True, exist_ok=True)
    (out / "demo.json").write_text(json.dumps({k: r.as_dict() for k, r in results.items()}, indent=2))
    plot_results(results, out / "demo.png")
    console.print(f"saved {out / 'demo.json'} and the plot {out / 'demo.png'}", soft_wrap=True)
    if qa:
        console.print(summary_line(qa), soft_wrap=True)
    return results


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
