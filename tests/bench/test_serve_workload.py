"""The served benchmark's workload and scoring: the trace's structure measured, sessions with
real token ids that share exactly what their block ids share, and the figures the goals use."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvray.bench.serve import BASE, BASE_AGAIN, CLUSTER, HOST, PAGE, baseline, judge, summarize
from kvray.bench.serve_workload import ServeRequest, TraceShape, reuse_share, serve_workload, trace_shape
from kvray.traces import TraceRequest, read_trace
from tests.properties import examples

SHAPE = TraceShape(
    system_prompts=2,
    system_prompt_pages=2,
    documents=40,
    document_pages=5,
    document_probability=0.3,
    mean_turns=1.4,
    mean_turn_pages=3.0,
    sessions=400,
)


def test_trace_shape_finds_system_prompt_turns_and_documents():
    """A hand-made trace: one shared system block, session A with two turns (the second
    extends the first's full blocks), and B and C reading the same document."""
    trace = [
        TraceRequest(0, 3 * 512 + 100, 10, (0, 1, 2, 3)),  # A turn 1: system 0, blocks 1-2 full, 3 partial
        TraceRequest(1, 5 * 512, 10, (0, 1, 2, 4, 5)),  # A turn 2: extends A's full blocks (0, 1, 2)
        TraceRequest(2, 4 * 512, 10, (0, 6, 7, 8)),  # B: document 6-7, then its question
        TraceRequest(3, 4 * 512, 10, (0, 6, 7, 9)),  # C: same document, another question
    ]
    shape = trace_shape(trace)
    assert shape.system_prompts == 1 and shape.system_prompt_pages == 1
    assert shape.sessions == 3 and abs(shape.mean_turns - 4 / 3) < 1e-9
    assert shape.mean_turn_pages == 2  # turn 2 added blocks 4 and 5
    assert shape.documents == 1 and shape.document_pages == 2
    assert abs(shape.document_probability - 2 / 3) < 1e-9


def test_shape_of_the_bundled_conversation_trace():
    shape = trace_shape(read_trace("conversation_trace_first30min.jsonl"))
    assert shape.system_prompts >= 1 and shape.system_prompt_pages >= 1
    assert 1.0 < shape.mean_turns < 3.0 and shape.sessions > 1000


@settings(max_examples=examples(25), deadline=None)
@given(requests=st.integers(1, 80), max_pages=st.integers(4, 24), turns=st.floats(1.0, 8.0), seed=st.integers(0, 1000))
def test_equal_block_ids_mean_equal_tokens_and_prompts_fit(requests, max_pages, turns, seed):
    workload = serve_workload(SHAPE, requests, PAGE, max_pages, vocab=8192, mean_turns=turns, seed=seed)
    assert 0 < len(workload) <= requests
    pages: dict[int, list[int]] = {}
    for r in workload:
        assert len(r.blocks) <= max_pages and len(r.tokens) > (len(r.blocks) - 1) * PAGE
        assert all(3 <= t < 8192 for t in r.tokens)
        for i, block in enumerate(r.blocks[: len(r.tokens) // PAGE]):
            page = r.tokens[i * PAGE : (i + 1) * PAGE]
            assert pages.setdefault(block, page) == page  # a block id always carries the same tokens
    assert serve_workload(SHAPE, requests, PAGE, max_pages, 8192, turns, seed=seed) == workload


def test_more_turns_mean_more_reuse():
    chat = serve_workload(SHAPE, 120, PAGE, 24, 8192, mean_turns=1.0)
    agent = serve_workload(SHAPE, 120, PAGE, 24, 8192, mean_turns=6.0)
    assert reuse_share(agent, PAGE) > reuse_share(chat, PAGE) + 0.1


def answer(ttfts: list[float], cached: list[int], loaded_pages: int = 0, tiers: dict | None = None) -> dict:
    return {
        "requests": [
            {"id": str(i), "ttft_s": t, "arrival_s": np.float64(i), "done_s": i + t + 0.5, "cached_tokens": c}
            for i, (t, c) in enumerate(zip(ttfts, cached))
        ],
        "counters": {"loaded_pages": loaded_pages},
        "kvray_pages_by_tier": tiers or {},
    }


def test_summary_counts_slo_throughput_and_splits_hits_by_tier():
    requests = [ServeRequest(i, 0.0, [5] * 100, (i,)) for i in range(4)]
    answers = [answer([0.5, 3.0], [128, 0], loaded_pages=1, tiers={"host": 1}), answer([1.0, 0.2], [64, 64])]
    summary = summarize(answers, requests, slo_s=1.0)
    assert summary["requests"] == 4 and summary["prompt_tokens"] == 400
    span = (1 + 3.0 + 0.5) - 0.0  # first arrival 0, last answer: request 1 of the first engine
    assert abs(summary["replay_s"] - span) < 1e-9
    assert abs(summary["throughput_at_slo_rps"] - 3 / span) < 1e-9 and summary["slo_attainment"] == 0.75
    assert all(type(summary[k]) is float for k in ("mean_ttft_ms", "p99_ttft_ms", "throughput_rps", "throughput_at_slo_rps"))
    assert summary["hit_tokens"] == 256 and summary["hit_tokens_by_tier"] == {"vllm": 256 - PAGE, "host": PAGE}


def test_goals_use_the_faster_baseline_run_and_say_why_a_contender_is_missing():
    def run(mean_ms: float, slo_rps: float, hits: int) -> dict:
        return {
            "mean_ttft_ms": mean_ms,
            "throughput_at_slo_rps": slo_rps,
            "hit_tokens": hits,
            "prompt_tokens": 1000,
            "slo_attainment": 0.5,
            "p50_ttft_ms": mean_ms,
        }

    runs = {BASE: run(900, 0.2, 100), HOST: run(500, 0.4, 200), CLUSTER: run(300, 0.7, 320), BASE_AGAIN: run(800, 0.25, 100)}
    assert baseline(runs) == BASE_AGAIN
    goals = {g["name"]: g for g in judge({"contenders": runs, "errors": {}, "baseline": baseline(runs)})}
    assert goals["serve_mean_ttft"]["met"] and abs(goals["serve_mean_ttft"]["ratio"] - 300 / 800) < 1e-9
    assert not goals["serve_throughput_at_slo"]["met"]  # 0.7 / 0.25 = 2.8 < 3
    assert goals["serve_hit_tokens"]["met"] and "320 vs 200" in goals["serve_hit_tokens"]["reason"]
    del runs[CLUSTER]
    missing = judge({"contenders": runs, "errors": {CLUSTER: "ConfigError: layout"}, "baseline": BASE_AGAIN})
    assert not any(g["met"] for g in missing) and all("ConfigError: layout" in g["reason"] for g in missing)
