"""What ``kvray bench --only serve`` reports of a run of :func:`kvray.bench.serve.run_serve`:
its rows (kvray's figure beside the baseline's from the same run, their ratio and goal) and a
plot per workload (``serve-<workload>.png`` beside ``serve.json``: mean, p90 and p99 TTFT
against the offered rate). Kept apart from the run so that the rows are checked from a
result's shape alone (tests/bench/test_serve_rows.py), with no engine started.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvray.bench import BenchResult, benchmark
from kvray.bench.serve import BASE, FULL, INPROC, KVRAY, LMCACHE, PRIMARY, QUICK, ROUTE, RR, STICKY, run_serve
from kvray.bench.serve_workload import TRACE_ENV


def plot(name: str, workload: dict, path: Path) -> Path:
    """Mean, p90 and p99 TTFT against the offered rate, a line per contender, the SLO marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (stat, label) in zip(axes, (("mean_ttft_ms", "mean"), ("p90_ttft_ms", "p90"), ("p99_ttft_ms", "p99"))):
        for contender, by_rate in workload["median"].items():
            rates = [workload["rates"][m] for m in by_rate]
            ax.plot(rates, [v[stat] / 1e3 for v in by_rate.values()], marker="o", label=contender)
        ax.axhline(workload["slo_ttft_ms"] / 1e3, color="grey", linestyle="--", label="TTFT SLO")
        ax.axvline(workload["saturation_rps"], color="grey", linestyle=":", label="vLLM alone's saturation")
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("offered rate (requests/s)")
        ax.set_ylabel(f"{label} TTFT (s)")
        ax.set_title(f"{name}: {label} TTFT")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def point_near(workload: dict, contender: str, stat: str, multiple: float) -> float:
    """``stat`` of ``contender`` at the swept rate nearest ``multiple`` x saturation (nan if it did not run)."""
    by_rate = workload["median"].get(contender)
    if not by_rate:
        return float("nan")
    m = min(by_rate, key=lambda k: abs(float(k) - multiple))
    return by_rate[m][stat]


@benchmark("serve")
def serve(quick: bool) -> list[BenchResult]:
    out_dir = Path(os.environ.get("KVRAY_BENCH_OUT", "results"))
    out = run_serve(QUICK if quick else FULL, out_dir, os.environ.get(TRACE_ENV))
    out["plots"] = [str(plot(name, w, out_dir / f"serve-{name}.png")) for name, w in out["workloads"].items()]
    return rows(out)


def rows(out: dict) -> list[BenchResult]:
    """The rows of ``kvray bench --only serve``: kvray's figure (:data:`KVRAY`'s),
    the baseline's from the same run, their ratio; each row's params say where they came from.
    The CPU row's goal is the goodput goal's (3x) where every core is busy: a third of the CPU
    time per request."""
    nan = float("nan")
    results = []
    for name, w in out["workloads"].items():
        params = {k: w[k] for k in ("saturation_rps", "slo_ttft_ms", "kv_pages", "vllm_kv_pages", "kvray_host_pages",
                                    "kv_over_vllm", "kv_over_host", "reuse_ceiling_tokens", "measured_requests",
                                    "goodput_rps", "goodput_by_repeat_rps")}  # fmt: skip
        params["reuse_share_at_0.75"] = {c: point_near(w, c, "reuse_share", 0.75) for c in w["median"]}
        params["errors"] = out["errors"]
        good = w["goodput_rps"]
        if name in PRIMARY:
            results.append(BenchResult(f"serve_{name}_ttft_vs_vllm", point_near(w, KVRAY, "mean_ttft_ms", 0.75),
                                       point_near(w, BASE, "mean_ttft_ms", 0.75), "ms", "<= 0.30", params))  # fmt: skip
        results.append(BenchResult(f"serve_{name}_goodput_vs_vllm", good.get(KVRAY, nan), good[BASE], "req/s", ">= 3.0", params))
        cpu = w["cpu_ms_per_request"]
        results.append(
            BenchResult(f"serve_{name}_cpu_per_request_vs_vllm", cpu.get(KVRAY, {}).get("total", nan), cpu[BASE]["total"],
                        "CPU-ms", "<= 0.33", {"by_role_ms": cpu, "at_saturation": w["at_saturation"]})
        )  # fmt: skip
        if name in PRIMARY:
            results.append(
                BenchResult(f"serve_{name}_goodput[in-process vs vllm]", good.get(INPROC, nan), good[BASE], "req/s", None, params)
            )
            split = {c: {m: {k: v[k] for k in ("mean_ttft_ms", "mean_ttft_parts_ms", "served_share", "slo_attainment")}
                         for m, v in w["median"][c].items()} for c in (RR, ROUTE) if c in w["median"]}  # fmt: skip
            results.append(
                BenchResult(
                    "serve_router_goodput_vs_round_robin", good.get(ROUTE, nan), good.get(RR, nan), "req/s", ">= 1.2",
                    {**params, "ttft_and_tokens_by_rate": split},
                )
            )  # fmt: skip
            results.append(BenchResult("serve_router_ttft_vs_round_robin", point_near(w, ROUTE, "mean_ttft_ms", 0.75),
                                       point_near(w, RR, "mean_ttft_ms", 0.75), "ms", None, params))  # fmt: skip
            if STICKY in good:
                results.append(BenchResult("serve_sticky_goodput_vs_round_robin", good[STICKY], good[RR], "req/s", None, params))
            if LMCACHE in w["median"]:
                results.append(
                    BenchResult("serve_vs_lmcache_goodput", good.get(KVRAY, nan), good[LMCACHE], "req/s", ">= 1.0", params)
                )
                results.append(BenchResult("serve_vs_lmcache_ttft", point_near(w, KVRAY, "mean_ttft_ms", 0.75),
                                           point_near(w, LMCACHE, "mean_ttft_ms", 0.75), "ms", "<= 1.0", params))  # fmt: skip
    goals = {"host": "<= 0.233", "disk": "<= 0.435"}  # LMCache's CI: a hit >= 4.3x (host) / 2.3x (disk) faster than cold
    for tier, figures in out.get("long_document", {}).items():
        results.append(BenchResult(f"serve_longdoc_hit_vs_cold[{tier}]", figures["hit_ttft_ms"], figures["cold_ttft_ms"], "ms",
                                   goals[tier], {**figures, "errors": out["errors"]}))  # fmt: skip
    return results
