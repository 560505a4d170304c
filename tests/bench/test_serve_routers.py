"""The routing anchor's client side (kvray.bench.serve_routers): closed-loop sessions over a
Serve handle, whose router (not the client) picks the replica, and its rows."""

from __future__ import annotations

import math
import threading
import time

from kvray.bench.serve_loop import run_closed_loop, summarize
from kvray.bench.serve_routers import HandlePool, ServeRouted, rows
from kvray.bench.serve_workload import Session


class Request:
    def __init__(self, tokens: list[int]) -> None:
        self.prompt_token_ids, self.max_tokens = tokens, 4


class FakeResponse:
    def __init__(self, tokens: list[int], service_s: float, lock: threading.Lock) -> None:
        self.tokens, self.service_s, self.lock = tokens, service_s, lock

    def result(self, timeout_s: float) -> dict:
        with self.lock:  # one replica: one request at a time
            time.sleep(self.service_s)
        return {"num_cached_tokens": len(self.tokens) // 2, "node": "n"}


class FakeHandle:
    """``handle.generate.remote(request)``, as a Serve DeploymentHandle is called."""

    def __init__(self, service_s: float) -> None:
        self.generate = self
        self.service_s, self.lock, self.requests = service_s, threading.Lock(), []

    def remote(self, request) -> FakeResponse:
        self.requests.append(request)
        return FakeResponse(request.prompt_token_ids, self.service_s, self.lock)


def test_sessions_over_a_serve_handle_wait_for_their_answers_and_queue_at_the_replica():
    handle = FakeHandle(service_s=0.05)
    sessions = [Session(f"u{i}", ((1, 2, 3, 4), (1, 2, 3, 4, 5, 6)), 0.0) for i in range(3)]
    answers = run_closed_loop(sessions, HandlePool(handle, Request), ServeRouted(), float("inf"))
    assert len(answers) == 6 and len(handle.requests) == 6
    assert sorted(len(r.prompt_token_ids) for r in handle.requests) == [4, 4, 4, 6, 6, 6]
    for s in ("u0", "u1", "u2"):  # a session's second prompt went out after its first answer
        first, second = sorted((a for a in answers if a.session == s), key=lambda a: a.turn)
        assert second.sent_at >= first.done_at
    # three sessions on one replica at once: the last of the first three waited for two others
    assert max(a.ttft_s for a in answers if a.turn == 0) >= 3 * 0.05 * 0.9
    point = summarize(answers, slo_s=0.12)
    assert 0 < point["slo_attainment"] < 1 and point["cached_tokens"] == 3 * 2 + 3 * 3


def test_rows_put_kvrays_router_beside_prefix_affinity():
    point = {"0.5": {"mean_ttft_ms": 50.0}, "1.0": {"mean_ttft_ms": 80.0}, "2.0": {"mean_ttft_ms": 900.0}}
    out = {
        "goodput_rps": {"kvray": 6.0, "prefix_affinity": 4.0},
        "points": {"kvray": point, "prefix_affinity": {**point, "1.0": {"mean_ttft_ms": 160.0}}},
    }
    goodput, latency = rows(out)
    assert goodput.name == "serve_router_goodput_vs_prefix_affinity" and math.isclose(goodput.ratio, 1.5)
    assert goodput.meets_goal
    assert (latency.kvray, latency.baseline, latency.ratio) == (80.0, 160.0, 0.5)  # at the anchor's saturation
