"""Side-by-side benchmarks: every figure kvray reports stands beside a baseline measured in
the same run (memcpy, raw file I/O, a plain dict walk, raw xxh3, ...), with their ratio.

A benchmark is a function ``fn(quick: bool) -> list[BenchResult]`` registered with
:func:`benchmark` under a name :data:`BENCHMARKS` lists for its module. ``ratio`` is always
``kvray / baseline`` in the benchmark's unit; ``goal`` says which way is good
(``">= 0.8"`` for a throughput, ``"<= 1.5"`` for a time).

Example::

    @benchmark("host_tier_vs_memcpy")
    def host_write(quick: bool) -> list[BenchResult]:
        ...
        return [BenchResult("host_tier_vs_memcpy[2MiB]", kvray=gbps, baseline=memcpy_gbps, unit="GB/s", goal=">= 0.8")]
"""

from __future__ import annotations

import importlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from kvray.core.errors import ClusterError, ConfigError

# Each module of benchmarks and the names it registers, in the order they run: `kvray bench
# --help` lists them and `--only` is checked against them without importing the modules (some
# start Ray or load torch); :func:`benchmark` refuses a name not listed here.
BENCHMARKS: dict[str, tuple[str, ...]] = {
    "kvray.bench.core": ("host_tier_vs_memcpy", "disk_tier_vs_raw_file", "index_lookup", "key_hashing"),
    "kvray.bench.fresh": ("host_store_fresh_process",),
    "kvray.bench.vs_lmcache": ("lmcache",),
    "kvray.bench.load": ("load_clients",),
    "kvray.bench.policy": (
        "sim_replay_requests_per_s",
        "sim_cluster_replay",
        "rl_policy_decision",
        "reuse_replay",
        "rl_router_decision",
    ),
    "kvray.bench.engines": ("hf_ttft", "vllm_ttft_kvray_hit_vs_vllm_prefix_cache"),
    "kvray.bench.runtime": (
        "same_node_load_vs_memcpy",
        "cross_node_transfer_vs_loopback_tcp",
        "cross_node_store_vs_loopback_tcp",
        "controller_lookup_vs_empty_call",
        "runtime_start_vs_empty_actors",
        "controller_memory_per_page",
        "controller_shard_spread",
    ),
    "kvray.bench.serve_report": ("serve",),
    "kvray.bench.serve_routers": ("router_vs_prefix_affinity",),
    "kvray.bench.gpu": ("gpu_device_tier", "gpu_vllm_ttft"),
    "kvray.bench.long_context": ("long_context",),
    "kvray.bench.concurrency": ("concurrency",),
}
NAMES = tuple(name for names in BENCHMARKS.values() for name in names)


@dataclass
class BenchResult:
    name: str
    kvray: float
    baseline: float
    unit: str
    goal: str | None = None
    params: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.kvray / self.baseline if self.baseline else float("nan")

    @property
    def meets_goal(self) -> bool | None:
        if self.goal is None:
            return None
        op, target = self.goal.split()
        return self.ratio >= float(target) if op == ">=" else self.ratio <= float(target)

    def as_dict(self) -> dict:
        return {**asdict(self), "ratio": self.ratio, "meets_goal": self.meets_goal}


Bench = Callable[[bool], list[BenchResult]]
REGISTRY: dict[str, Bench] = {}


def benchmark(name: str) -> Callable[[Bench], Bench]:
    if name not in NAMES:
        raise ValueError(f"benchmark {name!r} is not listed in kvray.bench.BENCHMARKS")

    def register(fn: Bench) -> Bench:
        REGISTRY[name] = fn
        return fn

    return register


def alternating_medians(
    *fns: Callable[[], object], repeats: int, warmup: int = 1, clock: Callable[[], float] = time.perf_counter
) -> list[float]:
    """Median time of each of ``fns`` (wall, or ``clock``: ``time.process_time`` for CPU
    time, what a shared machine keeps fair), run in turn within every repetition so that all
    see the same machine state (other load, caches, frequency) and their ratios are fair."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, sink in zip(fns, times):
            t0 = clock()
            fn()
            sink.append(clock() - t0)
    return [statistics.median(sink) for sink in times]


def paired_medians(
    kvray: Callable[[], object],
    baseline: Callable[[], object],
    repeats: int,
    warmup: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[float, float]:
    """Median times of ``kvray`` and ``baseline``, run alternately (:func:`alternating_medians`)."""
    ours, base = alternating_medians(kvray, baseline, repeats=repeats, warmup=warmup, clock=clock)
    return ours, base


def child_env(**extra: str) -> dict[str, str]:
    """Environment for a benchmark's child interpreter: this checkout first on its path,
    so a fresh process measures the same code as its parent."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def chosen_names(only: Sequence[str]) -> list[str]:
    """The benchmarks ``--only`` picks (every one when empty): those whose name contains one
    of ``only``; a value that picks none is refused, with the names it could pick."""
    unmatched = [o for o in only if not any(o in n for n in NAMES)]
    if unmatched:
        raise ConfigError(f"--only {unmatched[0]!r} matches no benchmark; names: {', '.join(NAMES)}")
    return [n for n in NAMES if not only or any(o in n for o in only)]


def run_benchmarks(only: Sequence[str], quick: bool, progress: bool) -> list[BenchResult]:
    """Run the chosen kvray.bench. One that cannot get its Ray cluster (Ray did not start on
    a loaded machine) is skipped with one line on stderr; the others still run."""
    names = chosen_names(only)
    for module, registered in BENCHMARKS.items():
        if set(registered) & set(names):
            importlib.import_module(module)
    chosen = [(n, REGISTRY[n]) for n in names]
    results: list[BenchResult] = []
    if not progress:
        for name, fn in chosen:
            results.extend(_run_one(name, fn, quick))
        return results
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task("benchmarks", total=len(chosen))
        for name, fn in chosen:
            bar.update(task, description=name)
            results.extend(_run_one(name, fn, quick))
            bar.advance(task)
    return results


def _run_one(name: str, fn: Bench, quick: bool) -> list[BenchResult]:
    try:
        return fn(quick)
    except ClusterError as exc:
        print(f"kvray bench: {name} skipped: {exc}", file=sys.stderr)
        return []
