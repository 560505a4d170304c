"""CPU time per request of the processes that serve it: the served benchmark's
``serve_<workload>_cpu_per_request_vs_vllm`` rows (:mod:`kvray.bench.serve`).

Why a CPU row beside goodput: on the shared 2-core machine the wall-clock figures move with
which share of the cores each contender's knee happened to get (one full agentic run's two
repeats read 1.61x and 4.53x), while the CPU seconds a contender's processes spend per
completed request hardly move with the machine's load (two runs at load 13-67 agreed within
3%); on a machine whose cores are all busy they bound the throughput ratio.

Counted: each engine actor's process (vLLM with its OpenMP threads, and kvray's connector
with its threads and runtime client, which live in it) and, for a contender on the kvray
runtime, every actor of the runtime (controller shards, store actors); each process reads
its own CPU time (``time.process_time``: all of its threads), so the figure holds on a
cluster of several machines too. Not counted: the closed-loop client, the same for every
contender, and Ray's own daemons (raylet, GCS).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence

import ray

from kvray.cluster import Runtime


def process_cpu_s(actors: Sequence) -> list[float]:
    """Each actor's process CPU time so far (s), as the process reads it."""
    return ray.get([a.__ray_call__.remote(lambda _actor: time.process_time()) for a in actors], timeout=120)


class CpuMeter:
    """The CPU seconds of a contender's processes so far, summed by role (``engines``,
    ``runtime``); two readings around a run give what the run cost."""

    def __init__(self, engines: Sequence, runtime: Runtime | None = None) -> None:
        self.roles: dict[str, list] = {"engines": list(engines)}
        if runtime is not None:
            self.roles["runtime"] = [*runtime.shards.handles, *runtime.stores.values()]

    def read(self) -> dict[str, float]:
        actors = [(role, a) for role, handles in self.roles.items() for a in handles]
        spent = dict.fromkeys(self.roles, 0.0)
        for (role, _), seconds in zip(actors, process_cpu_s([a for _, a in actors])):
            spent[role] += seconds
        return spent


def per_request_ms(before: Mapping[str, float], after: Mapping[str, float], requests: int) -> dict[str, float]:
    """CPU milliseconds per request between two readings, by role and in ``total``."""
    out = {role: 1e3 * (after[role] - before[role]) / max(1, requests) for role in before}
    out["total"] = sum(out.values())
    return out


def median_per_request(runs: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The runs' median of each part (the median ``total`` is not the parts' sum in general)."""
    return {part: statistics.median(r[part] for r in runs) for part in runs[0]}
