"""A vLLM engine replaying timed requests: the served benchmark's engine, in a Ray actor.

:class:`ReplayEngine` is the body of an actor that runs vLLM's environment's interpreter
(Ray's ``runtime_env={"py_executable": ...}``; see :mod:`kvray.bench.serve`), so the engine
lives in the actor's process on the actor's node, and a connector that names a kvray
runtime uses that process's Ray connection and node. It serves one engine
(``kvray``: the connector's ``kv_connector_extra_config``, or None for vLLM alone):

- :meth:`ReplayEngine.replay`: from wall-clock ``start_at`` on, each request enters the
  engine at its ``arrival_s`` (open loop: whether or not earlier ones are done) and the
  engine steps until all are finished. Each request's TTFT is its first output token's
  time minus its arrival, so it includes queueing. Answers per-request ``ttft_s``,
  ``done_s``, ``cached_tokens`` (prompt tokens the engine did not compute: its own prefix
  cache's and kvray's) and the connector's counters and kvray hits by tier over the replay.
- :meth:`ReplayEngine.reset`: empties vLLM's own prefix cache (kvray's tiers keep their pages).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter, deque

from kvray.harness.vllm_engine import close_llm, connector_of, counters_of, make_llm

# where a runtime connector's pages came from (its load paths, kvray.cluster.client) -> tier label
PATH_TIERS = {"mapped": "host", "local": "local store", "tcp": "remote", "collective": "remote", "object_store": "remote"}


def kvray_hits(llm, connector) -> tuple[dict[str, int], Counter]:
    """The connector's counters (both halves) and the pages kvray served so far by tier:
    an in-process store's own tier counts, or a runtime client's load paths (pages from
    this node's mapped host tier, from its store actor, from another node)."""
    if connector is None:
        return {}, Counter()
    counters, store = counters_of(llm), connector.scheduler.store
    if store is not None:
        return counters, Counter(store.stats().get("hit_pages_by_tier", {}))
    tiers: Counter = Counter()
    for path, tier in PATH_TIERS.items():
        tiers[tier] += counters.get(f"{path}_pages", 0)
    return counters, tiers


def replay(llm, connector, job: dict) -> dict:
    """Replay ``job["requests"]`` at their arrival offsets (see the module docstring)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, detokenize=False, ignore_eos=True)
    pending = deque(sorted(job["requests"], key=lambda r: r["arrival_s"]))
    arrival = {r["id"]: r["arrival_s"] for r in pending}
    counters_before, tiers_before = kvray_hits(llm, connector)
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    cached: dict[str, int] = {}
    t0 = time.perf_counter() + max(0.0, job["start_at"] - time.time())
    while time.perf_counter() < t0:
        time.sleep(min(0.01, t0 - time.perf_counter()))
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while pending and pending[0]["arrival_s"] <= now:
            request = pending.popleft()
            engine.add_request(request["id"], TokensPrompt(prompt_token_ids=request["tokens"]), params)
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(0.005, pending[0]["arrival_s"] - now)))
            continue
        for out in engine.step():
            t = time.perf_counter() - t0
            if out.request_id not in first and out.outputs and out.outputs[0].token_ids:
                first[out.request_id] = t
                cached[out.request_id] = int(out.num_cached_tokens or 0)
            if out.finished:
                done[out.request_id] = t
    counters, tiers = kvray_hits(llm, connector)
    counters = {k: v - counters_before.get(k, 0) for k, v in counters.items()}
    tiers.subtract(tiers_before)
    return {
        "requests": [
            {"id": rid, "ttft_s": first[rid] - at, "done_s": done[rid], "arrival_s": at, "cached_tokens": cached[rid]}
            for rid, at in arrival.items()
        ],
        "counters": counters,
        "kvray_pages_by_tier": {tier: n for tier, n in tiers.items() if n},
    }


class ReplayEngine:
    """One vLLM engine (see the module docstring); ``spec`` holds :func:`make_llm`'s settings.

    Example::

        engine = ray.remote(num_cpus=0)(ReplayEngine).options(runtime_env={"py_executable": vllm_python}).remote(
            {"model": "bench-llama", "block_size": 64, "kv_cache_bytes": 32 << 20, "max_model_len": 1088,
             "prefix_caching": True, "kvray": {"host_pages": 512}})
        ray.get(engine.replay.remote({"start_at": 0, "max_tokens": 4, "requests": [{"id": "0", "tokens": [5] * 100, "arrival_s": 0}]}))
    """

    def __init__(self, spec: dict) -> None:
        # Ray starts workers at niceness 15 (RAY_worker_niceness): an engine serving requests
        # would then yield its cores to any other process on the node. Back to normal where
        # this process may raise its priority; as it is elsewhere.
        with contextlib.suppress(PermissionError):
            os.setpriority(os.PRIO_PROCESS, 0, 0)
        self.llm = make_llm(
            spec["model"],
            spec.get("kvray"),
            spec["prefix_caching"],
            spec["block_size"],
            kv_cache_bytes=spec["kv_cache_bytes"],
            max_model_len=spec["max_model_len"],
        )
        self.connector = connector_of(self.llm) if spec.get("kvray") is not None else None

    def replay(self, job: dict) -> dict:
        return replay(self.llm, self.connector, job)

    def reset(self) -> bool:
        return bool(self.llm.reset_prefix_cache())

    def close(self) -> None:
        close_llm(self.llm)
