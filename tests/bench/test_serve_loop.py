"""The served benchmark's closed loop and arithmetic: a session's next prompt waits for its
answer, the offered rate paces the sessions, goodput is the SLO criterion over a sweep, and
the rows carry kvray's figure beside the baseline's."""

from __future__ import annotations

import math
import time
from collections import Counter

import pytest

from kvray.bench.serve_loop import (
    Answer,
    PolicyRouter,
    RoundRobin,
    Sticky,
    arrival_slots,
    goodput,
    is_lower_bound,
    run_closed_loop,
    served_share,
    summarize,
)
from kvray.bench.serve_workload import Session, conversations
from kvray.policy.cluster import make_cluster_policy


class FifoServers:
    """Engines that answer each request ``service_s`` after it reaches the front of its
    engine's queue: a served workload with a known service time, in process."""

    def __init__(self, engines: int, service_s: float) -> None:
        self.free_at = [0.0] * engines
        self.service_s = service_s
        self.pending: list[dict] = []

    def submit(self, engine: int, request: dict) -> None:
        start = max(time.time(), self.free_at[engine])
        self.free_at[engine] = start + self.service_s
        self.pending.append({**request, "engine": engine, "done_at": start + self.service_s})

    def drain(self, wait_s: float) -> list[dict]:
        deadline = time.time() + wait_s
        while True:
            now = time.time()
            ready = [r for r in self.pending if r["done_at"] <= now]
            if ready or now >= deadline:
                break
            time.sleep(0.001)
        self.pending = [r for r in self.pending if r["done_at"] > now]
        return [
            {"id": r["id"], "sent_at": r["sent_at"], "ttft_s": r["done_at"] - r["sent_at"], "done_at": r["done_at"],
             "prompt_tokens": len(r["tokens"]), "cached_tokens": 0}
            for r in ready
        ]  # fmt: skip


def assert_closed_loop(sessions: list[Session], answers: list[Answer]) -> None:
    by_session: dict[str, list[Answer]] = {}
    for a in answers:
        by_session.setdefault(a.session, []).append(a)
    for s in sessions:
        turns = sorted(by_session[s.name], key=lambda a: a.turn)
        assert [a.turn for a in turns] == list(range(len(s.prompts)))
        for before, after in zip(turns, turns[1:]):
            assert after.sent_at >= before.done_at + s.gap_s - 1e-6, "a next prompt went out before its answer"


def test_a_session_sends_its_next_prompt_only_after_the_answer_and_its_gap():
    sessions = [Session(f"u{i}", ((1, 2, 3),) * 3, gap_s=0.02) for i in range(4)]
    answers = run_closed_loop(sessions, FifoServers(2, 0.01), RoundRobin(2), float("inf"))
    assert len(answers) == 12
    assert_closed_loop(sessions, answers)


def test_the_offered_rate_paces_sessions():
    """At 40 requests/s over 4 sessions, each session sends at most every 0.1 s: 12 requests
    take about 0.3 s however fast the engines answer."""
    sessions = [Session(f"u{i}", ((1,),) * 3, 0.0) for i in range(4)]
    answers = run_closed_loop(sessions, FifoServers(2, 0.001), Sticky(2), rate=40.0)
    sent = sorted(a.sent_at for a in answers)
    assert 0.25 <= sent[-1] - sent[0] <= 0.6
    for s in sessions:
        times = sorted(a.sent_at for a in answers if a.session == s.name)
        assert all(b - a >= 0.1 - 1e-3 for a, b in zip(times, times[1:]))


def test_sessions_with_arrivals_are_paced_by_the_workloads_own_order():
    """Two sessions whose turns interleave in a trace: at 20 requests/s the n-th arrival goes
    out no sooner than n / 20 s, whatever the session, and a turn still waits for its
    answer; a session with sparse turns is not spread one pace apart per turn."""
    a = Session("a", ((1,), (2,), (3,)), 0.0, arrivals=(0.0, 900.0, 901.0))
    b = Session("b", ((4,), (5,)), 0.0, arrivals=(100.0, 902.0))
    answers = run_closed_loop([a, b], FifoServers(2, 0.001), RoundRobin(2), rate=20.0)
    assert_closed_loop([a, b], answers)
    start = min(x.sent_at for x in answers)
    sent = {(x.session, x.turn): x.sent_at - start for x in answers}
    order = [("a", 0), ("b", 0), ("a", 1), ("a", 2), ("b", 1)]
    assert sorted(sent, key=sent.get) == order  # the trace's order, not one pace per session
    for n, key in enumerate(order):
        # no sooner than its slot; the upper bound leaves room for a loaded machine's scheduling
        # (0.05 s, a pace, was exceeded by 0.11 s under load 8)
        assert n / 20 - 1e-3 <= sent[key] <= n / 20 + 0.5
    assert arrival_slots([a, b]) == [[0, 2, 3], [1, 4]]
    assert arrival_slots([a, Session("c", ((1,),), 0.0)]) is None  # one session without: paced per session


def test_summarize_averages_the_parts_an_engine_splits_a_ttft_into():
    answers = [Answer("s", i, 0, 0.0, 1.0, 0.3, 10, 0, True, {"wait": 0.1 * i, "step": 0.2}) for i in range(3)]
    parts = summarize(answers, slo_s=1.0)["mean_ttft_parts_ms"]
    assert math.isclose(parts["wait"], 100.0) and math.isclose(parts["step"], 200.0)
    assert summarize(answers[:1] + [Answer("s", 9, 0, 0.0, 1.0, 0.3, 10, 0, True)], 1.0)["mean_ttft_parts_ms"]["step"] == 100.0


def test_sticky_keeps_a_session_on_one_engine_and_round_robin_spreads_it():
    sessions = conversations(6, 3, 16, 512, 0, 1, 1, warmup=0)
    sticky = run_closed_loop(sessions, FifoServers(3, 0.001), Sticky(3), float("inf"))
    assert all(len({a.engine for a in sticky if a.session == s.name}) == 1 for s in sessions)
    assert sorted(Counter(a.engine for a in sticky).values()) == [6, 6, 6]  # 2 sessions of 3 prompts each
    spread = run_closed_loop(sessions, FifoServers(3, 0.001), RoundRobin(3), float("inf"))
    assert {a.engine for a in spread} == {0, 1, 2}


def test_the_route_verb_follows_the_cached_pages_and_counts_backlog():
    """cost-router on two nodes: a prompt whose 4 pages sit on b goes to b; with b's backlog
    high enough, to a."""
    where = {"hot": ["b"] * 4, "cold": []}
    router = PolicyRouter(["a", "b"], make_cluster_policy("cost-router"), lambda t: ([1, 2, 3, 4], where[t[0]]), 10.0)
    assert router.pick("r1", "s", ["hot"]) == 1
    assert router.backlog_pages == [0, 1]
    for i in range(10):
        router.pick(f"busy{i}", "s", ["cold"])  # cold prompts: least backlog first
    router.done("r1")
    assert sum(router.backlog_pages) == 10 * 5
    with pytest.raises(ValueError, match="one engine per node"):
        PolicyRouter(["a", "a"], make_cluster_policy("cost-router"), lambda t: ([], []), 1.0)


def test_the_route_verb_prices_an_outstanding_request_beyond_its_pages():
    """b holds the session's 4 pages and serves one request of 1 page to compute: priced by
    its page alone (10 ms) b still wins (a would fetch 4 pages, 0.5 x 10 ms each); priced
    with the rest of its engine time (100 ms: its decode steps), a does."""
    where = {"hot": ["b"] * 4, "busy": ["b"] * 4}

    def route(request_ms: float) -> tuple[int, list[float]]:
        policy = make_cluster_policy("cost-router")
        router = PolicyRouter(["a", "b"], policy, lambda t: ([1, 2, 3, 4], where[t[0]]), 10.0, request_ms=request_ms)
        assert router.pick("r0", "other", ["busy"]) == 1
        backlog = [router.backlog_ms(0), router.backlog_ms(1)]
        return router.pick("r1", "s", ["hot"]), backlog

    assert route(0.0) == (1, [0.0, 10.0])  # its partial last page: its 4 full ones are cached on b
    assert route(100.0) == (0, [0.0, 110.0])
    router = PolicyRouter(["a", "b"], make_cluster_policy("cost-router"), lambda t: ([1], []), 10.0, request_ms=100.0)
    router.pick("r0", "s", ["x"])
    router.done("r0")
    assert router.backlog_ms(0) == router.backlog_ms(1) == 0.0  # an answered request costs nothing more


def test_the_route_verb_weighs_a_page_from_the_other_node_at_its_measured_fetch_cost():
    """b holds the session's 4 pages and serves a request (15 ms of backlog). At the cost
    router's guess, half a page of prefill (5 ms) a page fetched, a costs 10 + 20 = 30 ms
    against b's 25; at a measured 0.5 ms a page, 12: a serves."""
    where = {"hot": ["b"] * 4, "busy": ["b"] * 4}

    def route(fetch_ms: float) -> int:
        policy = make_cluster_policy("cost-router")
        locate = lambda t: ([1, 2, 3, 4], where[t[0]])  # noqa: E731
        router = PolicyRouter(["a", "b"], policy, locate, 10.0, request_ms=5.0, page_fetch_ms=fetch_ms)
        assert router.pick("r0", "other", ["busy"]) == 1
        return router.pick("r1", "s", ["hot"])

    assert route(0.0) == 1 and route(0.5) == 0


def test_the_route_verb_counts_what_an_engine_still_holds_in_its_own_cache():
    """The runtime reports nothing cached (its stores not yet written). A session's first
    turn lands on b (a is busy); once both are idle its next turn goes by the tie (a)
    without the engines' own caches, and back to b, whose engine still holds the first
    turn's 3 pages, with them: b's backlog then counts the new page and the partial one only."""
    keys = {"busy": [9], "turn1": [1, 2, 3], "turn2": [1, 2, 3, 4]}

    def second_turn(engine_pages: int) -> tuple[int, list[int]]:
        router = PolicyRouter(["a", "b"], make_cluster_policy("cost-router"), lambda t: (keys[t[0]], []), 10.0, engine_pages)
        assert router.pick("r0", "other", ["busy"]) == 0 and router.pick("r1", "s", ["turn1"]) == 1
        router.done("r0")
        router.done("r1")
        return router.pick("r2", "s", ["turn2"]), router.backlog_pages

    assert second_turn(0) == (0, [5, 0])
    assert second_turn(16) == (1, [0, 2])


def test_goodput_is_the_highest_rate_meeting_the_slo_share_interpolated():
    # 95% at 2/s, 85% at 4/s: the 90% crossing lies halfway between them
    assert math.isclose(goodput({1.0: 1.0, 2.0: 0.95, 4.0: 0.85, 8.0: 0.2}), 3.0)
    assert math.isclose(goodput({1.0: 1.0, 2.0: 0.95, 4.0: 0.6}), 2.0 + 2.0 * 0.05 / 0.35)
    assert goodput({1.0: 0.5, 2.0: 0.1}) == 0.0  # no rate met it
    # a failed rate below a passed one (another process slowed that point) does not lower it
    assert math.isclose(goodput({1.0: 0.9, 3.0: 0.95, 2.0: 0.5, 4.0: 0.85}), 3.5)
    # a little more attainment moves the figure a little, not by a whole sweep step
    assert 3.0 < goodput({1.0: 1.0, 2.0: 0.95, 4.0: 0.87}) < 3.5
    assert goodput({1.0: 1.0, 2.0: 0.95}) == 2.0 and is_lower_bound({1.0: 1.0, 2.0: 0.95})  # a lower bound
    assert not is_lower_bound({1.0: 1.0, 2.0: 0.5}) and is_lower_bound({1.0: 0.5, 2.0: 0.95})


def test_summarize_ttft_percentiles_and_slo_share():
    answers = [Answer("s", i, 0, 0.0, 1.0 + i, (i + 1) / 10, 100, 40, True) for i in range(10)]
    point = summarize(answers, slo_s=0.5)
    assert math.isclose(point["mean_ttft_ms"], 550.0) and point["slo_attainment"] == 0.5
    assert point["p90_ttft_ms"] > point["p50_ttft_ms"] and point["requests"] == 10
    assert math.isclose(point["throughput_rps"], 10 / 10.0) and point["cached_tokens"] == 400
    assert math.isclose(point["request_goodput_rps"], 5 / 10.0)  # vLLM's --goodput: within the SLO per second


def test_a_points_prompt_tokens_split_into_vllms_own_cache_kvrays_sources_and_computed():
    """Cached tokens kvray did not load were vLLM's own; the rest of the prompt was computed."""
    point = {"prompt_tokens": 1000, "cached_tokens": 700}
    share = served_share(point, {"local store": 320, "remote": 192})
    assert share == {"vllm own cache": 0.188, "kvray local store": 0.32, "kvray remote": 0.192, "computed": 0.3}
