"""A vLLM engine replaying timed requests, driven line by line: the served benchmark's engine.

Runs in vLLM's environment (see :mod:`kvray.engines.vllm_runs`) as a long-lived process::

    python -m kvray.engines.vllm_replay '{"model": "bench-llama", "block_size": 64, "kv_cache_bytes": 33554432,
                                         "max_model_len": 1600, "prefix_caching": true, "kvray": {"host_pages": 512}}'

It starts one engine (``kvray``: the connector's ``kv_connector_extra_config``, or null for
vLLM alone), answers ``{"ready": ...}``, then reads one JSON job a line from stdin and
answers one JSON line each, on the stdout it was started with (everything vLLM prints goes
to stderr):

- ``{"op": "replay", "start_at": <epoch s>, "max_tokens": n, "requests": [{"id", "tokens", "arrival_s"}]}``:
  from wall-clock ``start_at`` on, each request enters the engine at its ``arrival_s``
  (open loop: whether or not earlier ones are done) and the engine steps until all are
  finished. Each request's TTFT is its first output token's time minus its arrival, so
  it includes queueing. Answers per-request ``ttft_s``, ``done_s``, ``cached_tokens``
  (prompt tokens the engine did not compute: its own prefix cache's and kvray's) and the
  connector's counters and kvray hits by tier over the replay.
- ``{"op": "reset"}``: empties vLLM's own prefix cache (kvray's tiers keep their pages).
- ``{"op": "close"}``: shuts the engine down and exits.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter, deque

from kvray.engines.vllm_runs import close_llm, connector_of, make_llm

RESULT_PREFIX = "KVRAY-RESULT "


def kvray_hits_by_tier(connector) -> Counter:
    """Pages the connector's kvray store has served so far, by tier (empty without kvray)."""
    store = getattr(connector, "store", None) if connector is not None else None
    if store is None:
        return Counter()
    return Counter(store.stats().get("hit_pages_by_tier", {}))


def replay(llm, connector, job: dict) -> dict:
    """Replay ``job["requests"]`` at their arrival offsets (see the module docstring)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, detokenize=False, ignore_eos=True)
    pending = deque(sorted(job["requests"], key=lambda r: r["arrival_s"]))
    arrival = {r["id"]: r["arrival_s"] for r in pending}
    counters_before = dict(connector.counters) if connector is not None else {}
    tiers_before = kvray_hits_by_tier(connector)
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
    counters = {k: v - counters_before.get(k, 0) for k, v in connector.counters.items()} if connector is not None else {}
    tiers = kvray_hits_by_tier(connector)
    tiers.subtract(tiers_before)
    return {
        "requests": [
            {"id": rid, "ttft_s": first[rid] - at, "done_s": done[rid], "arrival_s": at, "cached_tokens": cached[rid]}
            for rid, at in arrival.items()
        ],
        "counters": counters,
        "kvray_pages_by_tier": {tier: n for tier, n in tiers.items() if n},
    }


def serve(spec: dict, jobs, answer) -> None:
    """Start the engine of ``spec``, then answer each job read from ``jobs``."""
    if "omp_threads_bind" in spec:  # read by vLLM's CPU worker when the engine starts
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = spec["omp_threads_bind"]
    try:
        llm = make_llm(
            spec["model"],
            spec.get("kvray"),
            spec["prefix_caching"],
            spec["block_size"],
            kv_cache_bytes=spec["kv_cache_bytes"],
            max_model_len=spec["max_model_len"],
        )
    except Exception as exc:  # reported to the driver, which records why this contender did not run
        answer({"error": f"{type(exc).__name__}: {exc}"})
        return
    connector = connector_of(llm) if spec.get("kvray") is not None else None
    answer({"ready": True, "pid": os.getpid()})
    for line in jobs:
        job = json.loads(line)
        if job["op"] == "replay":
            answer(replay(llm, connector, job))
        elif job["op"] == "reset":
            answer({"reset": bool(llm.reset_prefix_cache())})
        elif job["op"] == "close":
            break
        else:
            answer({"error": f"unknown op {job['op']!r}: use replay, reset or close"})
    close_llm(llm)
    answer({"closed": True})


def main(argv: list[str]) -> None:
    results = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # vLLM's own prints must not mix with answers

    def answer(obj: dict) -> None:
        results.write(RESULT_PREFIX + json.dumps(obj) + "\n")
        results.flush()

    serve(json.loads(argv[1]), sys.stdin, answer)


if __name__ == "__main__":
    main(sys.argv)
