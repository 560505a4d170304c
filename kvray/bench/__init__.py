"""Side-by-side benchmarks: every figure kvray reports stands beside a baseline measured in
the same run (memcpy, raw file I/O, a plain dict walk, raw xxh3, ...), with their ratio.

A benchmark is a function ``fn(quick: bool) -> list[BenchResult]`` registered with
:func:`benchmark` in one of the modules listed in :data:`MODULES`. ``ratio`` is always
``kvray / baseline`` in the benchmark's unit; ``goal`` says which way is good
(``">= 0.8"`` for a throughput, ``"<= 1.5"`` for a time).

Example::

    @benchmark("host_tier_write_vs_memcpy")
    def host_write(quick: bool) -> list[BenchResult]:
        ...
        return [BenchResult("host_tier_write_vs_memcpy[2MiB]", kvray=gbps, baseline=memcpy_gbps, unit="GB/s", goal=">= 0.8")]
"""

from __future__ import annotations

import importlib
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from kvray.core.errors import ClusterError

MODULES = (
    "kvray.bench.core",
    "kvray.bench.fresh",
    "kvray.bench.vs_lmcache",
    "kvray.bench.load",
    "kvray.bench.policy",
    "kvray.bench.engines",
    "kvray.bench.runtime",
    "kvray.bench.serve",
    "kvray.bench.gpu",
    "kvray.bench.long_context",
    "kvray.bench.concurrency",
)


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
    def register(fn: Bench) -> Bench:
        REGISTRY[name] = fn
        return fn

    return register


def alternating_medians(*fns: Callable[[], object], repeats: int, warmup: int = 1) -> list[float]:
    """Median wall time of each of ``fns``, run in turn within every repetition so that all
    see the same machine state (other load, caches, frequency) and their ratios are fair."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, sink in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            sink.append(time.perf_counter() - t0)
    return [statistics.median(sink) for sink in times]


def paired_medians(
    kvray: Callable[[], object], baseline: Callable[[], object], repeats: int, warmup: int = 1
) -> tuple[float, float]:
    """Median wall times of ``kvray`` and ``baseline``, run alternately (:func:`alternating_medians`)."""
    ours, base = alternating_medians(kvray, baseline, repeats=repeats, warmup=warmup)
    return ours, base


def child_env(**extra: str) -> dict[str, str]:
    """Environment for a benchmark's child interpreter: this checkout first on its path,
    so a fresh process measures the same code as its parent."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


def run_benchmarks(only: list[str], quick: bool, progress: bool) -> list[BenchResult]:
    """Run the chosen kvray.bench. One that cannot get its Ray cluster (Ray did not start on
    a loaded machine) is skipped with one line on stderr; the others still run."""
    for module in MODULES:
        importlib.import_module(module)
    chosen = [(n, fn) for n, fn in REGISTRY.items() if not only or any(o in n for o in only)]
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
