"""The rows of ``kvray bench --only serve``, from a result of the shape run_serve writes: each
names kvray's figure and the baseline's from the same run, with their ratio and goal."""

from __future__ import annotations

import math

import pytest

from kvray.bench.serve import (
    BASE,
    FULL,
    INPROC,
    KVRAY,
    LMCACHE,
    QUICK,
    ROUTE,
    RR,
    STICKY,
    chosen_workloads,
    contenders_of,
    workloads,
)
from kvray.bench.serve_engines import INSTANCES, MAX_PAGES, PAGE, VLLM_KV_PAGES
from kvray.bench.serve_loop import goodput, is_lower_bound, repeat_attainments
from kvray.bench.serve_report import rows
from kvray.bench.serve_workload import WORKLOADS_ENV, kv_pages
from kvray.core.errors import ConfigError


def workload(goodputs: dict[str, float], ttft_ms: dict[str, float]) -> dict:
    keys = ("saturation_rps", "slo_ttft_ms", "kv_pages", "vllm_kv_pages", "kvray_host_pages", "kv_over_vllm",
            "kv_over_host", "reuse_ceiling_tokens", "measured_requests")  # fmt: skip
    split = {"mean_ttft_parts_ms": {"wait": 1.0}, "served_share": {"computed": 1.0}, "slo_attainment": 1.0}
    return {
        **dict.fromkeys(keys, 1.0),
        "goodput_rps": goodputs,
        "goodput_by_repeat_rps": {c: [g, g] for c, g in goodputs.items()},
        "cpu_ms_per_request": {c: {"engines": 100.0 if c == BASE else 30.0, "total": 100.0 if c == BASE else 30.0}
                               for c in (BASE, KVRAY) if c in goodputs},
        "at_saturation": {},
        "median": {c: {"0.25": {"mean_ttft_ms": 1.0, "reuse_share": 0.1, **split},
                       "0.75": {"mean_ttft_ms": t, "reuse_share": 0.9, **split}}
                   for c, t in ttft_ms.items()},
    }  # fmt: skip


def test_rows_have_kvray_beside_the_baseline_and_their_ratio():
    everyone = (BASE, INPROC, RR, STICKY, ROUTE, LMCACHE)
    assert KVRAY == RR  # the rows' kvray figure: the runtime behind a round-robin router
    out = {
        "errors": {},
        "workloads": {
            "multiround": workload(
                {BASE: 1.0, INPROC: 2.0, RR: 3.0, STICKY: 2.8, ROUTE: 3.6, LMCACHE: 2.0},
                dict(zip(everyone, (800, 400, 200, 250, 300, 500))),
            ),
            "agentic": workload({BASE: 0.5, RR: 2.0}, {BASE: 900, RR: 100}),
        },
        "long_document": {
            "host": {"cold_ttft_ms": 500.0, "hit_ttft_ms": 100.0},
            "disk": {"cold_ttft_ms": 500.0, "hit_ttft_ms": 250.0},
        },
    }
    by_name = {r.name: r for r in rows(out)}
    assert set(by_name) == {
        "serve_multiround_ttft_vs_vllm",
        "serve_multiround_goodput_vs_vllm",
        "serve_multiround_goodput[in-process vs vllm]",
        "serve_agentic_goodput_vs_vllm",
        "serve_multiround_cpu_per_request_vs_vllm",
        "serve_agentic_cpu_per_request_vs_vllm",
        "serve_router_goodput_vs_round_robin",
        "serve_router_ttft_vs_round_robin",
        "serve_sticky_goodput_vs_round_robin",
        "serve_vs_lmcache_goodput",
        "serve_vs_lmcache_ttft",
        "serve_longdoc_hit_vs_cold[host]",
        "serve_longdoc_hit_vs_cold[disk]",
    }
    ttft = by_name["serve_multiround_ttft_vs_vllm"]
    assert (ttft.kvray, ttft.baseline, ttft.ratio, ttft.meets_goal) == (200, 800, 0.25, True)  # at 0.75 x saturation
    assert by_name["serve_multiround_goodput_vs_vllm"].ratio == 3.0 and by_name["serve_multiround_goodput_vs_vllm"].meets_goal
    assert by_name["serve_agentic_goodput_vs_vllm"].ratio == 4.0
    cpu = by_name["serve_agentic_cpu_per_request_vs_vllm"]  # CPU-ms per request at saturation, kvray's over vLLM's
    assert (cpu.kvray, cpu.baseline, cpu.ratio, cpu.meets_goal) == (30.0, 100.0, 0.3, True)
    assert math.isclose(by_name["serve_router_goodput_vs_round_robin"].ratio, 1.2)
    assert by_name["serve_router_ttft_vs_round_robin"].ratio == 1.5  # 300 against 200 ms at 0.75 x saturation
    split = by_name["serve_router_goodput_vs_round_robin"].params["ttft_and_tokens_by_rate"]
    assert set(split) == {RR, ROUTE} and split[ROUTE]["0.75"]["mean_ttft_ms"] == 300  # where each router's TTFT went
    assert by_name["serve_vs_lmcache_goodput"].ratio == 1.5 and by_name["serve_vs_lmcache_ttft"].ratio == 0.4
    assert by_name["serve_longdoc_hit_vs_cold[host]"].ratio == 0.2 and by_name["serve_longdoc_hit_vs_cold[host]"].meets_goal
    assert not by_name["serve_longdoc_hit_vs_cold[disk]"].meets_goal  # 2x faster: LMCache's gate is 2.3x
    assert all(r.goal is None or r.unit for r in by_name.values())


def test_without_lmcache_its_rows_are_absent_and_a_trace_names_its_rows():
    out = {
        "errors": {"lmcache": "not installed"},
        "workloads": {
            "trace": workload(
                {BASE: 1.0, INPROC: 1.0, RR: 1.0, ROUTE: 1.0},
                dict.fromkeys((BASE, INPROC, RR, ROUTE), 100.0),
            )
        },  # fmt: skip
    }
    names = [r.name for r in rows(out)]
    assert "serve_trace_ttft_vs_vllm" in names and "serve_trace_goodput_vs_vllm" in names
    assert not any("lmcache" in n or "sticky" in n for n in names)  # contenders that did not run have no row
    assert next(r for r in rows(out) if r.name == "serve_trace_goodput_vs_vllm").params["errors"] == {"lmcache": "not installed"}


def test_each_repeats_goodput_counts_a_once_rate_in_every_repeat_and_a_skipped_one_as_failed():
    def point(repeat: int, share: float) -> dict:
        return {"repeat": repeat, "slo_attainment": share}

    # 0.25x runs once; repeat 1 (the second) failed 0.75x and 1.25x and skipped 2x
    by_rate = {0.25: [point(0, 1.0)], 0.75: [point(0, 1.0), point(1, 0.5)], 1.25: [point(0, 0.95), point(1, 0.4)],
               2.0: [point(0, 0.8)], 3.0: [], 4.0: []}  # fmt: skip
    first, second = repeat_attainments(by_rate, 2.0, FULL.repeats, FULL.once, FULL.rates)
    assert first == {0.5: 1.0, 1.5: 1.0, 2.5: 0.95, 4.0: 0.8}
    assert second == {0.5: 1.0, 1.5: 0.5, 2.5: 0.4, 4.0: 0.0}


def test_a_quick_baseline_that_fails_its_first_rate_by_a_slow_point_keeps_the_rate_it_passes_above():
    """The quick sweep stops at a first failure; a contender that failed its first rate runs the
    fallback rates, one below the grid and one between its first two rates, so one slow 0.75x
    point does not read as a goodput below 0.75x (which would inflate kvray's ratios)."""
    first, second = QUICK.rates[:2]
    assert any(m < first for m in QUICK.fallback) and any(first < m < second for m in QUICK.fallback)
    between = next(m for m in QUICK.fallback if first < m < second)
    attainment = {0.25: 1.0, first: 0.78, between: 1.0}  # the agents' vLLM alone, one quick run: 78%, then 100%
    assert goodput(attainment) == between and is_lower_bound(attainment)


@pytest.mark.parametrize("size", [QUICK, FULL], ids=["quick", "full"])
def test_every_workload_fits_the_engines_and_outsizes_vllms_cache_and_kvrays_host_tier(size):
    for name, factory in workloads(size, 8192, None).items():
        sessions = factory(0)
        assert max(len(p) for s in sessions for p in s.prompts) <= MAX_PAGES * PAGE, name  # the engines' window
        pages = kv_pages(sessions, PAGE)
        assert pages >= 5 * INSTANCES * VLLM_KV_PAGES and pages > INSTANCES * size.host_pages, name  # the rule
        assert len(sessions) % INSTANCES == 1, name  # round-robin moves a session between engines (module comment)


def test_a_run_of_one_workload_sweeps_its_contenders_only(monkeypatch):
    everything = ("vllm", "in-process", "runtime", "lmcache")
    monkeypatch.delenv(WORKLOADS_ENV, raising=False)
    assert chosen_workloads(None) == ["multiround", "agentic", "longdoc"] and chosen_workloads("t.jsonl")[0] == "trace"
    monkeypatch.setenv(WORKLOADS_ENV, "agentic")
    assert chosen_workloads(None) == ["agentic"]
    assert contenders_of("agentic", QUICK, everything, True) == [BASE, KVRAY]
    assert STICKY not in contenders_of("multiround", QUICK, everything, True)
    assert ROUTE not in contenders_of("multiround", FULL, everything, False) and STICKY in contenders_of(
        "multiround", FULL, everything, True
    )
    monkeypatch.setenv(WORKLOADS_ENV, "agentic,docs")
    with pytest.raises(ConfigError, match="docs"):
        chosen_workloads(None)
    out = {"errors": {}, "workloads": {"agentic": workload({BASE: 1.0, RR: 3.0}, {BASE: 300, RR: 100})}}
    assert [r.name for r in rows(out)] == [
        "serve_agentic_goodput_vs_vllm",
        "serve_agentic_cpu_per_request_vs_vllm",
    ]  # no primary rows
