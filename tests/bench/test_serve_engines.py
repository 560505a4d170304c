"""The served benchmark's engines for real: one vLLM engine (bench-llama, vLLM's
environment) in a :class:`~kvray.harness.vllm_serving.ServingEngine` actor on the
session's Ray cluster, played closed loop, with kvray in process or on a kvray runtime. Without the vLLM environment it fails saying
how to make it (``make vllm-env``); it never skips."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import ray

from kvray.bench.serve_cpu import CpuMeter, per_request_ms
from kvray.bench.serve_engines import MAX_PAGES, MODEL, PAGE, RUNTIME_NAME, EngineGroup, group_specs
from kvray.bench.serve_loop import Sticky, run_closed_loop, summarize
from kvray.bench.serve_workload import Session, conversations
from kvray.cluster import Runtime, RuntimeConfig
from kvray.cluster.runtime import alive_nodes
from kvray.core.config import TierSizes
from kvray.engines.hf import checkpoint_layout
from kvray.harness.tiny import model_dir
from tests.bench.test_serve_loop import assert_closed_loop

pytestmark = pytest.mark.slow


def test_a_real_engine_answers_closed_loop_and_hits_a_users_history(ray_cluster):
    """Two users of three rounds on one engine with kvray's in-process tiers: every next
    prompt leaves after the previous answer, and later rounds find their history cached."""
    disk = Path(tempfile.mkdtemp(prefix="kvray-serve-test-"))
    spec, env = group_specs("in-process", host_pages=64, disk_pages=0, disk_root=disk)[0]
    group = EngineGroup("in-process", alive_nodes()[:1], [(spec, env)], None)
    try:
        assert group.ready(timeout_s=600) is None
        sessions = conversations(2, 2, PAGE, 8192, seed=0, shared_pages=1, own_pages=2, warmup=1)
        assert max(len(p) for s in sessions for p in s.prompts) <= MAX_PAGES * PAGE
        meter = CpuMeter(group.actors)  # read by the engine's own process, on vLLM's interpreter
        before = meter.read()
        answers = run_closed_loop(sessions, group, Sticky(1), rate=float("inf"))
        cpu = per_request_ms(before, meter.read(), len(answers))
        assert 0 < cpu["engines"] == cpu["total"] < 60e3  # the prefills and decode steps, not the idle engine
        assert len(answers) == 6
        assert_closed_loop(sessions, answers)
        later = [a for a in answers if a.turn > 0]
        assert all(a.cached_tokens >= 3 * PAGE for a in later)  # shared + own context at least
        point = summarize(later, slo_s=60.0)
        assert point["requests"] == 4 and point["slo_attainment"] == 1.0 and point["mean_ttft_ms"] > 0
        counters = group.stats()[0]["counters"]
        assert counters["lookups"] >= 6 and counters["lookup_us"] > 0 and counters["load_us"] > 0
        for a in answers:  # the engine's split of each TTFT adds up to it
            assert set(a.ttft_parts_s) == {"transit", "wait", "step"} and min(a.ttft_parts_s.values()) >= 0
            assert abs(sum(a.ttft_parts_s.values()) - a.ttft_s) < 1e-3
    finally:
        group.kill()


def test_an_engine_on_the_runtime_is_woken_as_its_lookups_and_loads_end(ray_cluster):
    """One engine on a kvray runtime: a user's later rounds load their history from it, and
    the connector wakes the engine thread as each lookup and each load ends (rather than the
    thread stepping vLLM empty every 2 ms to find out); the runtime's actors' CPU counts."""
    disk = Path(tempfile.mkdtemp(prefix="kvray-serve-test-"))
    layout = checkpoint_layout(model_dir(MODEL), PAGE)
    runtime = Runtime.start(
        RuntimeConfig(name=RUNTIME_NAME, layout=layout, model_name=str(model_dir(MODEL)), tiers=TierSizes(host=64, disk=0),
                      disk_root=disk, max_request_pages=MAX_PAGES + 1)
    )  # fmt: skip
    group = EngineGroup("runtime", alive_nodes()[:1], group_specs("runtime", 64, 0, disk)[:1], None)
    try:
        assert group.ready(timeout_s=600) is None
        meter = CpuMeter(group.actors, runtime)
        prompts = conversations(1, 3, PAGE, 8192, seed=1, shared_pages=1, own_pages=3)[0].prompts
        before, cpu_before = group.stats()[0], meter.read()
        answers = []
        for prompt in prompts:  # each round after vLLM's own cache was emptied and the last round's pages stored
            answers += run_closed_loop([Session("user", (prompt,), 0.0)], group, Sticky(1), rate=float("inf"))
            group.stats()  # waits for the engine's stores in flight
            assert ray.get(group.actors[0].reset.remote(), timeout=60)
        after, cpu = group.stats()[0], per_request_ms(cpu_before, meter.read(), len(answers))
        later = answers[1:]
        assert len(answers) == len(prompts) and all(a.cached_tokens >= 4 * PAGE for a in later)
        assert after["counters"]["loaded_pages"] - before["counters"]["loaded_pages"] >= 4 * len(later)  # from kvray
        steps = {k: n - before["steps"][k] for k, n in after["steps"].items()}
        assert steps["wakes"] >= len(answers) + len(later)  # every lookup, and every hit's load
        assert cpu["engines"] > 0 and cpu["runtime"] > 0  # the lookups, pins and stores cost the runtime's actors
    finally:
        group.kill()
        runtime.close()
