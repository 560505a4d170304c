"""``kvray cluster-eval``: every heuristic and the oracle on cluster scenarios, as tables.

For each scenario and trace it replays every heuristic of :data:`HEURISTICS` (a per-node
placement policy under a cluster policy) and the oracle (:mod:`kvray.sim.oracle`), and writes
one markdown table per (scenario, trace) with mean and p99 TTFT, token hit rate, GiB moved
per kind of link (summed over nodes) and each kind's utilisation on its busiest node, then
the oracle's headroom over the best heuristic (1 - oracle mean TTFT / best mean TTFT);
headroom under 10% is named as such. ``candidates`` (the learned or adaptive policies,
e.g. ``("rl", "cost-router")``) are replayed beside them and reported against the best
heuristic, mean and p99, never counted as one. Results also go to ``cluster.json`` and a
bar plot. With ``load`` each (scenario, trace) replays its trace with the arrival gaps
scaled so that LRU keeps the prefill engines busy that share of the time
(:mod:`kvray.sim.load`); the rows and the table's heading record the factor.

Example::

    rows = evaluate({"h100-4node-skewed": scenario}, {"synthetic": trace}, fraction=0.05)
    write_markdown(rows, Path("results/cluster/cluster.md"), command="kvray cluster-eval ...")
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from kvray.apps.cluster_compare import REFERENCE, write_comparison
from kvray.core.errors import ConfigError
from kvray.policy.cluster import make_cluster_policy
from kvray.report import link_totals
from kvray.scenario import Scenario
from kvray.sim.cluster import ClusterSimulator
from kvray.sim.load import find_load
from kvray.sim.node import node_capacities
from kvray.sim.oracle import oracle_replay
from kvray.traces import TraceRequest

# (per-node policy, cluster policy): every heuristic of the baselines; each expert of the
# adaptive policies (kvray.policy.experts) under the cost router too, the cluster policy
# they are evaluated under, so that they are compared with each of their experts there
HEURISTICS: tuple[tuple[str, str], ...] = (
    ("lru", "local-first"),
    ("arc", "local-first"),
    ("lecar", "local-first"),
    ("s3fifo", "local-first"),
    ("sieve", "local-first"),
    ("selective-write", "local-first"),
    ("threshold", "local-first"),
    ("lru", "cost-router"),
    ("arc", "cost-router"),
    ("threshold", "cost-router"),
    ("lru", "always-prefetch"),
    ("lru", "replicate-hot"),
)
LINK_KINDS = ("pcie_h2d", "pcie_d2h", "nvme_read", "nvme_write", "nic_in", "nic_out", "switch")
SMALL_HEADROOM = 0.10


def evaluate(
    scenarios: Mapping[str, Scenario],
    traces: Mapping[str, Sequence[TraceRequest]],
    fraction: float,
    heuristics: Sequence[tuple[str, str]] = HEURISTICS,
    progress: Callable[[str], None] | None = None,
    candidates: Sequence[tuple[str, str]] = (),
    load: float | None = None,
    oracle: bool = True,
) -> list[dict]:
    """One row per (scenario, trace, heuristic, candidate or oracle; the oracle left out when ``oracle`` is false)."""
    rows = []
    for scenario_name, scenario in scenarios.items():
        for trace_name, trace in traces.items():
            capacities = node_capacities(scenario, trace, fraction)
            loaded = {}
            if load is not None:
                if progress is not None:
                    progress(f"{scenario_name} / {trace_name} / load {load:g}")
                found = find_load(trace, scenario, load, capacities)
                trace, loaded = found.trace, {"load": found.as_dict()}
            pairs = [*heuristics, *candidates, *([("oracle", "oracle")] if oracle else [])]
            for i, (policy, cluster) in enumerate(pairs):
                if progress is not None:
                    progress(f"{scenario_name} / {trace_name} / {policy} + {cluster}")
                if policy == "oracle":
                    result = oracle_replay(trace, scenario, capacities)
                else:
                    result = ClusterSimulator(scenario, policy, make_cluster_policy(cluster), capacities).replay(trace)
                gib, busiest = link_totals(result)
                rows.append(
                    {
                        "scenario": scenario_name,
                        "trace": trace_name,
                        "requests": result.requests,
                        "capacity_fraction": fraction,
                        "policy": policy,
                        "cluster_policy": cluster,
                        "mean_ttft_ms": result.mean_ttft_ms,
                        "p99_ttft_ms": result.p99_ttft_ms,
                        "token_hit_rate": result.token_hit_rate,
                        "link_gib": gib,
                        "link_utilisation_max": busiest,
                        "oracle_setting": result.extra.get("oracle_setting"),
                        # by position: a pair given as a candidate and also a heuristic is replayed as each
                        "candidate": len(heuristics) <= i < len(heuristics) + len(candidates),
                        **loaded,
                    }
                )
    return rows


def headroom(rows: Sequence[dict]) -> dict[tuple[str, str], tuple[dict, dict, float]]:
    """Per (scenario, trace): the best heuristic's row, the oracle's and 1 - oracle/best mean TTFT."""
    out = {}
    for key in dict.fromkeys((r["scenario"], r["trace"]) for r in rows):
        cell = [r for r in rows if (r["scenario"], r["trace"]) == key]
        best = min((r for r in cell if r["policy"] != "oracle" and not r["candidate"]), key=lambda r: r["mean_ttft_ms"])
        oracle = next(r for r in cell if r["policy"] == "oracle")
        out[key] = (best, oracle, 1.0 - oracle["mean_ttft_ms"] / best["mean_ttft_ms"])
    return out


def headroom_share(row: dict, best: dict, oracle: dict) -> float:
    """The share of the oracle's lead over the best heuristic that ``row`` captures (mean
    TTFT; negative when it is slower than the best heuristic)."""
    return (best["mean_ttft_ms"] - row["mean_ttft_ms"]) / (best["mean_ttft_ms"] - oracle["mean_ttft_ms"])


def write_markdown(rows: Sequence[dict], path: Path, command: str) -> Path:
    lines = [
        "# Cluster scenarios: every heuristic and the oracle (modeled)",
        "",
        f"Reproduce: `{command}`",
        "",
        "Columns: mean and p99 TTFT; token hit rate; GiB moved over each kind of link, summed over",
        "nodes (pcie_h2d/d2h: host-device PCIe, nvme_read/write, nic_in/out, the shared switch);",
        "utilisation: the busy share of that kind of link on its busiest node over the replay",
        "(1.0: busy all the time). The oracle is Belady on every node with the best of routing",
        "by the front end or the cost router x prefetch on/off x hot-prefix replication never,",
        "after 2 or after 8 requests (its setting is named); headroom = 1 - oracle mean TTFT /",
        "best heuristic mean TTFT.",
        "",
    ]
    small = []
    for (scenario, trace), (best, oracle, room) in headroom(rows).items():
        cell = [r for r in rows if (r["scenario"], r["trace"]) == (scenario, trace)]
        kinds = [k for k in LINK_KINDS if any(r["link_gib"].get(k) for r in cell)]
        load = cell[0].get("load")
        loaded = f", load {load['target']:g}: arrival gaps x{load['arrival_scale']:.4g}" if load else ""
        lines += [
            f"## {scenario}, {trace} ({cell[0]['requests']} requests, capacity {cell[0]['capacity_fraction']:g}{loaded})",
            "",
            "| policy | cluster policy | mean TTFT ms | p99 TTFT ms | hit rate | "
            + " | ".join(f"{k} GiB" for k in kinds)
            + " | "
            + " | ".join(f"{k} util" for k in kinds)
            + " |",
            "|---|---|---:|---:|---:|" + "---:|" * (2 * len(kinds)),
        ]
        for r in cell:
            name = "oracle" if r["policy"] == "oracle" else r["policy"]
            cluster = r["oracle_setting"] if r["policy"] == "oracle" else r["cluster_policy"]
            lines.append(
                f"| {name} | {cluster} | {r['mean_ttft_ms']:.1f} | {r['p99_ttft_ms']:.1f} | {r['token_hit_rate']:.4f} | "
                + " | ".join(f"{r['link_gib'].get(k, 0.0):.0f}" for k in kinds)
                + " | "
                + " | ".join(f"{r['link_utilisation_max'].get(k, 0.0):.3f}" for k in kinds)
                + " |"
            )
        verdict = " (under 10%)" if room < SMALL_HEADROOM else ""
        lines += [
            "",
            f"Best heuristic: {best['policy']} + {best['cluster_policy']}, {best['mean_ttft_ms']:.1f} ms; oracle "
            f"{oracle['mean_ttft_ms']:.1f} ms: headroom {room:.1%}{verdict}.",
            "",
        ]
        for r in (r for r in cell if r["candidate"]):
            lines += [
                f"{r['policy']} + {r['cluster_policy']}: mean TTFT {r['mean_ttft_ms'] / best['mean_ttft_ms']:.3f}x, "
                f"p99 {r['p99_ttft_ms'] / best['p99_ttft_ms']:.3f}x the best heuristic's; the oracle: mean "
                f"{oracle['mean_ttft_ms'] / best['mean_ttft_ms']:.3f}x, p99 {oracle['p99_ttft_ms'] / best['p99_ttft_ms']:.3f}x"
                + (f"; {headroom_share(r, best, oracle):.1%} of the oracle's headroom." if room > 0 else "."),
                "",
            ]
        if room < SMALL_HEADROOM:
            small.append(f"{scenario} / {trace}")
    lines += [
        "## Headroom under 10%",
        "",
        ("Scenarios where the oracle is within 10% of the best heuristic: " + "; ".join(small) + ".")
        if small
        else "None: the oracle leads the best heuristic by 10% or more everywhere.",
        "",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return path


def write_results(rows: Sequence[dict], out: Path, command: str) -> list[Path]:
    """cluster.json, cluster.md and cluster.png (mean TTFT per policy, one panel per cell)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    data = out / "cluster.json"
    data.write_text(json.dumps({"command": command, "rows": list(rows)}, indent=2))
    table = write_markdown(rows, out / "cluster.md", command)
    cells = list(headroom(rows))
    fig, axes = plt.subplots(1, len(cells), figsize=(4.5 * len(cells), 4.5), squeeze=False)
    for ax, key in zip(axes[0], cells):
        cell = [r for r in rows if (r["scenario"], r["trace"]) == key]
        labels = ["oracle" if r["policy"] == "oracle" else f"{r['policy']}\n{r['cluster_policy']}" for r in cell]
        ax.bar(
            range(len(cell)), [r["mean_ttft_ms"] for r in cell], color=["C3" if r["policy"] == "oracle" else "C0" for r in cell]
        )
        ax.set_xticks(range(len(cell)), labels, rotation=90, fontsize=7)
        ax.set_title(f"{key[0]}\n{key[1]}", fontsize=9)
        ax.set_ylabel("mean TTFT (ms, modeled)")
    fig.tight_layout()
    plot = out / "cluster.png"
    fig.savefig(plot, dpi=110)
    plt.close(fig)
    return [data, table, plot]


def run_cluster_eval(
    scenario_paths: Sequence[Path],
    trace_paths: Sequence[Path],
    generated: int,
    limit: int | None,
    fraction: float,
    out: Path,
    pairs: Sequence[str],
    command: str,
    progress: Callable[[str], None] | None = None,
    load: float | None = None,
    notify: Callable[[str], None] | None = None,
    bandwidth_scales: Sequence[float] = (1.0,),
    compare: bool = False,
    shared_disk: bool = False,
    noise: int = 0,
) -> tuple[int, list[Path]]:
    """What ``kvray cluster-eval`` does: every cluster scenario x trace (the files, and a
    generated chat workload of about ``generated`` requests), the ``pairs``
    (``NODE_POLICY+CLUSTER_POLICY``) beside the heuristics; returns the number of tables
    and the files written into ``out``. Every name is checked before any replay. With ``load``
    each scenario and trace is replayed at that busy share (``notify`` hears the factor found).
    Each scenario is replayed at every ``bandwidth_scales`` (its links that many times as
    fast: :meth:`~kvray.scenario.Scenario.with_bandwidth`), with its drives' reads and writes
    on one channel if ``shared_disk`` (:meth:`~kvray.scenario.Scenario.with_shared_disk`). With ``compare`` only the pairs and
    :data:`~kvray.apps.cluster_compare.REFERENCE` are replayed, no other heuristic and no oracle,
    and the table compares the pairs (:mod:`kvray.apps.cluster_compare`). With ``noise`` N each
    cell's best heuristic under each pair's cluster policy and the pairs are also replayed on N
    copies of its trace less one request (:mod:`kvray.apps.cluster_noise`: noise.md, noise.json)."""
    from kvray.policy import make_policy
    from kvray.scenario import load_scenario
    from kvray.sim.workloads import WorkloadSpec, generate
    from kvray.traces import read_trace

    scenarios = {}
    for path in scenario_paths:
        scenario = load_scenario(path)
        if len(scenario.node_scenarios()) == 1:
            raise ConfigError(
                f"--scenario {path}: scenario {scenario.name!r} has one node; cluster-eval compares cluster policies"
            )
        for scale in bandwidth_scales:
            scaled = scenario if scale == 1.0 else scenario.with_bandwidth(scale)
            if shared_disk:
                scaled = scaled.with_shared_disk()
            scenarios[scaled.name] = scaled
    traces = {t.stem: read_trace(t, limit=limit) for t in trace_paths}
    if generated:
        spec = WorkloadSpec(sessions=max(1, generated // 4), system_prompt_pages=1, document_probability=0.5)
        traces[f"generated-{generated}"] = generate(spec, seed=0)
    if not traces:
        raise ConfigError("give at least one --trace or --generated N")
    candidates = []
    for pair in pairs:
        node_policy, plus, cluster_policy = pair.partition("+")
        if not plus or not node_policy or not cluster_policy:
            raise ConfigError(f"--policy {pair!r}: expected NODE_POLICY+CLUSTER_POLICY, e.g. rl+cost-router")
        make_policy(node_policy), make_cluster_policy(cluster_policy)  # unknown names fail before any replay
        candidates.append((node_policy, cluster_policy))
    if compare and not candidates:
        raise ConfigError("--compare compares the --policy pairs: give at least one")
    if noise and not candidates:
        raise ConfigError("--noise N places the --policy pairs within each cell's noise band: give at least one")
    if noise == 1:
        raise ConfigError("--noise 1: the band needs at least 2 copies of a trace")
    heuristics = (REFERENCE,) if compare else HEURISTICS
    rows = evaluate(scenarios, traces, fraction, heuristics, progress, candidates, load, oracle=not compare)
    if notify is not None:
        from kvray.sim.load import describe

        for row in {(r["scenario"], r["trace"]): r for r in rows if "load" in r}.values():
            notify(f"{row['scenario']} / {row['trace']}: {describe(row['load'])}")
    written = write_comparison(rows, out, command) if compare else write_results(rows, out, command)
    if noise:
        from kvray.apps.cluster_noise import noise_bands, write_noise

        written += write_noise(noise_bands(scenarios, traces, fraction, rows, noise, progress), out, command)
    return len(scenarios) * len(traces), written
