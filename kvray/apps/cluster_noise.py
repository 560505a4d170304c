"""``kvray cluster-eval --noise N``: how far a cluster cell moves when one request changes, and
where each candidate sits within that, under each cluster policy a candidate runs under.

Near saturation a queued cluster replay is chaotic: on the 4- and 8-node scenarios at
``--load 0.85`` the best heuristic's mean TTFT moves by up to 108% when one request of a
thousand is left out (docs/sim-eval, "A disk hit slower than recomputing"), so one replay
cannot say whether a candidate 5% behind it is behind. Per (scenario, trace) and per cluster
policy ``C`` that a candidate runs under, the reference is the best heuristic under ``C``
(:data:`~kvray.apps.cluster_eval.HEURISTICS`; LRU where none runs under ``C``, e.g.
``cost-prefetch``). It and every candidate under ``C`` are replayed on N copies of the cell's
trace (scaled to its load), each less one request
(:func:`~kvray.apps.evaluate.without_one_request`, seeds 0..N-1). The band is the reference's
largest mean TTFT over its least, minus 1, over the whole trace and its copies (N >= 2); a
candidate is beyond it where its ratio to the
reference on the whole trace exceeds ``1 + max(band, 1%)`` (the per-page issue's rule). Each
candidate's ratio copy by copy (median, least, largest) and its NVMe bytes written over the
reference's are reported beside it.

Example::

    rows = evaluate(scenarios, traces, 0.05, candidates=[("reuse", "cost-router")], load=0.85)
    bands = noise_bands(scenarios, traces, 0.05, rows, copies=4)
    write_noise(bands, Path("results/cluster"), "kvray cluster-eval ... --noise 4")
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from kvray.apps.evaluate import without_one_request
from kvray.policy.cluster import make_cluster_policy
from kvray.report import ReplayResult, link_totals
from kvray.scenario import Scenario
from kvray.sim.cluster import ClusterSimulator
from kvray.sim.load import scaled
from kvray.sim.node import node_capacities
from kvray.traces import TraceRequest

MIN_BAND = 0.01  # a band narrower than this counts as 1% (the per-page issue's "or 1%, whichever is larger")


def noise_bands(
    scenarios: Mapping[str, Scenario],
    traces: Mapping[str, Sequence[TraceRequest]],
    fraction: float,
    rows: Sequence[dict],
    copies: int,
    progress: Callable[[str], None] | None = None,
) -> list[dict]:
    """One entry per (scenario, trace, cluster policy of a candidate) of ``rows`` (what
    :func:`~kvray.apps.cluster_eval.evaluate` returned for the same scenarios and traces);
    ``copies`` >= 2, checked where the command is read (``run_cluster_eval``)."""
    out = []
    for scenario_name, scenario in scenarios.items():
        for trace_name, whole in traces.items():
            cell = [r for r in rows if (r["scenario"], r["trace"]) == (scenario_name, trace_name)]
            if not any(r["candidate"] for r in cell):
                continue
            capacities = node_capacities(scenario, whole, fraction)
            load = cell[0].get("load")
            trace = scaled(whole, load["arrival_scale"]) if load else list(whole)
            trace_copies = [without_one_request(trace, k) for k in range(copies)]

            def replay(policy: str, cluster: str, requests: Sequence[TraceRequest]) -> ReplayResult:
                if progress is not None:
                    progress(f"{scenario_name} / {trace_name} / noise: {policy} + {cluster}")
                return ClusterSimulator(scenario, policy, make_cluster_policy(cluster), capacities).replay(requests)

            for cluster in dict.fromkeys(r["cluster_policy"] for r in cell if r["candidate"]):
                heuristics = [
                    r for r in cell if not r["candidate"] and r["policy"] != "oracle" and r["cluster_policy"] == cluster
                ]
                if heuristics:
                    ref = min(heuristics, key=lambda r: r["mean_ttft_ms"])
                else:  # no heuristic runs under this cluster policy: LRU's whole replay too
                    result = replay("lru", cluster, trace)
                    gib, busiest = link_totals(result)
                    ref = {"policy": "lru", "mean_ttft_ms": result.mean_ttft_ms, "link_gib": gib, "link_utilisation_max": busiest}
                ref_copies = [replay(ref["policy"], cluster, c).mean_ttft_ms for c in trace_copies]
                moves = [ref["mean_ttft_ms"], *ref_copies]
                band = max(moves) / min(moves) - 1.0
                shares = ref["link_utilisation_max"]
                entry = {
                    "scenario": scenario_name,
                    "trace": trace_name,
                    "cluster_policy": cluster,
                    "reference": ref["policy"],
                    "reference_mean_ttft_ms": ref["mean_ttft_ms"],
                    "reference_nvme_write_gib": ref["link_gib"].get("nvme_write", 0.0),
                    "reference_busiest_link": max(shares, key=shares.__getitem__) if shares else "",
                    "band": band,
                    "candidates": {},
                }
                for r in (r for r in cell if r["candidate"] and r["cluster_policy"] == cluster):
                    ratios = [replay(r["policy"], cluster, c).mean_ttft_ms / b for c, b in zip(trace_copies, ref_copies)]
                    ratio = r["mean_ttft_ms"] / ref["mean_ttft_ms"]
                    nvme = r["link_gib"].get("nvme_write", 0.0)
                    entry["candidates"][r["policy"]] = {
                        "ratio": ratio,
                        "beyond_band": ratio > 1.0 + max(band, MIN_BAND),
                        "copies_median": statistics.median(ratios),
                        "copies_least": min(ratios),
                        "copies_largest": max(ratios),
                        "nvme_write_vs_reference": nvme / entry["reference_nvme_write_gib"]
                        if entry["reference_nvme_write_gib"]
                        else None,
                    }
                out.append(entry)
    return out


def write_noise(bands: Sequence[dict], out: Path, command: str) -> list[Path]:
    """noise.json and noise.md: per cell and cluster policy, the band and each candidate's place in it."""
    out.mkdir(parents=True, exist_ok=True)
    data = out / "noise.json"
    data.write_text(json.dumps({"command": command, "bands": list(bands)}, indent=2))
    lines = [
        "# Cluster cells: the noise band, and each candidate against the best heuristic under its cluster policy",
        "",
        f"Reproduce: `{command}`",
        "",
        "Band: the reference's (best heuristic under that cluster policy; LRU where none runs under it)",
        "largest mean TTFT over its least on the whole trace and copies of it each less one request, minus 1.",
        "Per candidate: mean TTFT over the reference's on the whole trace (**bold** beyond the band, or",
        "1% where the band is narrower), the same copy by copy (median [least-largest]), and NVMe",
        "bytes written over the reference's (the reference's busiest kind of link named).",
        "",
        "| scenario | trace | cluster policy | reference, mean TTFT ms (busiest link) | band | candidate: x, copies, NVMe x |",
        "|---|---|---|---|---:|---|",
    ]
    beyond: dict[str, list[int]] = {}
    for b in bands:
        cells = []
        for name, c in b["candidates"].items():
            x = f"**{c['ratio']:.3f}**" if c["beyond_band"] else f"{c['ratio']:.3f}"
            nvme = "-" if c["nvme_write_vs_reference"] is None else f"{c['nvme_write_vs_reference']:.2f}"
            cells.append(f"{name}: {x}, {c['copies_median']:.3f} [{c['copies_least']:.3f}-{c['copies_largest']:.3f}], {nvme}")
            counts = beyond.setdefault(f"{name} + {b['cluster_policy']}", [0, 0])
            counts[0] += c["beyond_band"]
            counts[1] += 1
        lines.append(
            f"| {b['scenario']} | {b['trace']} | {b['cluster_policy']} | {b['reference']}, "
            f"{b['reference_mean_ttft_ms']:.1f} ({b['reference_busiest_link']}) | {b['band']:.1%} | " + "; ".join(cells) + " |"
        )
    lines += ["", *(f"- {pair}: beyond the band in {n} of {total} cells." for pair, (n, total) in beyond.items()), ""]
    table = out / "noise.md"
    table.write_text("\n".join(lines))
    return [data, table]
