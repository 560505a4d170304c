"""The served benchmark's client: closed-loop sessions at an offered rate, routed over engines.

:func:`run_closed_loop` plays :class:`~kvray.bench.serve_workload.Session` s against a
:class:`Pool` of engines. A session's next prompt is sent once its previous answer is
back and its think gap has passed, and not before the session's pace allows: at an
offered rate of ``rate`` requests/s over ``U`` sessions each session sends at most one
prompt every ``U / rate`` seconds (LMCache's multi-round QA paces users the same way), so
the offered rate is ``rate`` until the engines fall behind, and then the closed loop
slows the clients down instead of queueing without bound. Sessions with ``arrivals`` (a
trace's) are paced by the workload's own arrival order instead: the n-th prompt in that
order goes out no sooner than n / ``rate`` seconds after the start (and, as always, not
before its session's previous answer), so a session whose turns are far apart in the
trace does not stretch a run. ``rate=inf`` sends as fast as the answers come: the
engines' saturation.

Routers pick an engine per request: :class:`RoundRobin`, :class:`Sticky` (a session's
requests on one engine) and :class:`PolicyRouter`, which asks a kvray cluster policy's
``route`` verb (:mod:`kvray.policy.cluster`) with the runtime's answer to where the
prompt's cached pages are and each engine's backlog, as the simulator replays it.

:func:`goodput`, :func:`summarize`, :func:`served_share` and :func:`repeat_attainments`
are the sweep's arithmetic, pure.
"""

from __future__ import annotations

import heapq
import math
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from kvray.bench.serve_workload import Session
from kvray.engines.vllm.routing import EngineCaches
from kvray.policy.cluster import ClusterPolicy, ClusterView, NodeView, RequestView

SLO_SHARE = 0.9  # goodput: the share of requests that must meet the TTFT SLO


class Pool(Protocol):
    """Engines the client sends to: ``submit`` one request to engine ``engine``; ``drain``
    the answers (each with ``id``, ``sent_at``, ``ttft_s``, ``done_at``, ``prompt_tokens``,
    ``cached_tokens``) that came back, waiting up to ``wait_s`` for one."""

    def submit(self, engine: int, request: dict) -> None: ...

    def drain(self, wait_s: float) -> list[dict]: ...


class Router(ABC):
    """Picks the engine of each request; told when a request was answered."""

    name = "router"

    @abstractmethod
    def pick(self, request_id: str, session: str, tokens: Sequence[int]) -> int:
        """The engine (index) that serves this request."""

    def done(self, request_id: str) -> None:
        """The request was answered (routers that track backlogs forget it)."""


class RoundRobin(Router):
    """Request i on engine i mod n: a session's turns and a document's readers land on every engine."""

    name = "round-robin"

    def __init__(self, engines: int) -> None:
        self.engines, self.sent = engines, 0

    def pick(self, request_id: str, session: str, tokens: Sequence[int]) -> int:
        self.sent += 1
        return (self.sent - 1) % self.engines


class Sticky(Router):
    """Every request of a session on one engine, sessions dealt to the engines in turn as
    they first appear: what a front end that keeps sessions together and balances them
    does, and the best an engine without a shared cache can get (a hash of the session's
    name split 16 sessions 10 / 6 in a trial, overloading one engine)."""

    name = "session-sticky"

    def __init__(self, engines: int) -> None:
        self.engines = engines
        self.engine_of: dict[str, int] = {}

    def pick(self, request_id: str, session: str, tokens: Sequence[int]) -> int:
        return self.engine_of.setdefault(session, len(self.engine_of) % self.engines)


Locate = Callable[[Sequence[int]], tuple[list[int], list[str]]]  # tokens -> (page keys, node of each cached page)


class PolicyRouter(Router):
    """A kvray cluster policy's ``route`` verb: ``locate`` asks the runtime for the prompt's
    page keys and the node of each cached page; with ``engine_pages`` (each engine's own
    KV space, in pages) the pages an engine still holds in its own prefix cache, as far as
    the routes sent to it tell (:class:`~kvray.engines.vllm.routing.EngineCaches`), count
    as its node's, device tier; each engine's backlog is what its outstanding requests
    still cost it: the pages they must prefill, at ``page_ms`` each, and ``request_ms``
    each for the rest of a request's engine time (its answer's decode steps), both
    measured at warm-up. Counting pages alone priced an outstanding request at its 1-2
    computed pages, a fraction of what it holds the engine for, so the route verb kept
    sessions where their pages were until one engine served 22 requests to the other's 16
    and was the knee. ``page_fetch_ms``, where measured, is what loading a page from
    the other node costs (the view's, which the cost router weighs remote pages by in
    place of its guess of half a page of prefill)."""

    def __init__(
        self,
        nodes: Sequence[str],
        policy: ClusterPolicy,
        locate: Locate,
        page_ms: float,
        engine_pages: int = 0,
        request_ms: float = 0.0,
        page_fetch_ms: float = 0.0,
    ) -> None:
        if len(set(nodes)) != len(nodes):
            raise ValueError(f"the route verb needs one engine per node; engines' nodes: {list(nodes)}")
        self.nodes, self.policy, self.locate, self.page_ms = list(nodes), policy, locate, page_ms
        self.request_ms, self.page_fetch_ms = request_ms, page_fetch_ms
        self.name = f"route ({policy.name})"
        self.backlog_pages = [0] * len(nodes)
        self.backlog_requests = [0] * len(nodes)
        self.pending: dict[str, tuple[int, int]] = {}
        self.engine_caches = EngineCaches(engine_pages) if engine_pages > 0 else None

    def pick(self, request_id: str, session: str, tokens: Sequence[int]) -> int:
        keys, hit_nodes = self.locate(tokens)
        tiers: tuple[str, ...] = ()
        if self.engine_caches is not None:
            hit_nodes, tiers = self.engine_caches.merge(keys, hit_nodes)
        view = ClusterView(
            tuple(NodeView(n, backlog_ms=self.backlog_ms(i)) for i, n in enumerate(self.nodes)),
            page_prefill_ms=self.page_ms,
            page_fetch_ms=self.page_fetch_ms,
        )
        request = RequestView(tuple(keys), None, tuple(hit_nodes), session, tiers)
        engine = self.nodes.index(self.policy.route(request, view))
        work = len(keys) + 1 - sum(1 for n in hit_nodes if n == self.nodes[engine])  # + the partial last page
        if self.engine_caches is not None:
            self.engine_caches.served(self.nodes[engine], keys)
        self.backlog_pages[engine] += work
        self.backlog_requests[engine] += 1
        self.pending[request_id] = (engine, work)
        return engine

    def backlog_ms(self, engine: int) -> float:
        """What engine ``engine``'s outstanding requests still cost it (see the class docstring)."""
        return self.backlog_pages[engine] * self.page_ms + self.backlog_requests[engine] * self.request_ms

    def done(self, request_id: str) -> None:
        engine, work = self.pending.pop(request_id)
        self.backlog_pages[engine] -= work
        self.backlog_requests[engine] -= 1


@dataclass(frozen=True)
class Answer:
    """One measured request: its session, turn, engine and times (wall clock, s)."""

    session: str
    turn: int
    engine: int
    sent_at: float
    done_at: float
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    measured: bool
    ttft_parts_s: dict[str, float] = field(default_factory=dict)  # the engine's split of the TTFT, if it gives one


def run_closed_loop(
    sessions: Sequence[Session],
    pool: Pool,
    router: Router,
    rate: float,
    on_answer: Callable[[int], None] | None = None,
) -> list[Answer]:
    """Play ``sessions`` closed loop at offered ``rate`` requests/s (see the module docstring);
    every answer, warm-up ones included (``measured`` False). ``on_answer(n)``: n answers so far."""
    pace = len(sessions) / rate if math.isfinite(rate) and rate > 0 else 0.0
    start = time.time()
    slots = arrival_slots(sessions)
    if slots is not None:  # the workload's own order: the n-th prompt no sooner than n / rate
        pace = 0.0
        release = [[start + n / rate if math.isfinite(rate) and rate > 0 else start for n in ns] for ns in slots]
    else:  # staggered first prompts, then one prompt per session every `pace` seconds
        release = [[start + i * pace / len(sessions)] + [start] * (len(s.prompts) - 1) for i, s in enumerate(sessions)]
    due = [(release[i][0], i) for i in range(len(sessions))]
    heapq.heapify(due)
    turn = [0] * len(sessions)
    last_sent = [-math.inf] * len(sessions)
    outstanding: dict[str, tuple[int, int]] = {}
    answers: list[Answer] = []
    while due or outstanding:
        now = time.time()
        while due and due[0][0] <= now:
            _, s = heapq.heappop(due)
            session, k = sessions[s], turn[s]
            request_id = f"{s}.{k}"
            tokens = list(session.prompts[k])
            last_sent[s] = time.time()  # before routing: a router's own time is part of the request's
            engine = router.pick(request_id, session.name, tokens)
            outstanding[request_id] = (s, engine)
            pool.submit(engine, {"id": request_id, "tokens": tokens, "sent_at": last_sent[s]})
        wait = max(0.0, due[0][0] - time.time()) if due else 1.0
        for a in pool.drain(min(wait, 0.05) if outstanding else wait):
            s, engine = outstanding.pop(a["id"])
            router.done(a["id"])
            k = turn[s]
            session = sessions[s]
            answers.append(
                Answer(session.name, k, engine, a["sent_at"], a["done_at"], a["ttft_s"], a["prompt_tokens"],
                       a["cached_tokens"], k >= session.warmup, a.get("ttft_parts_s", {}))
            )  # fmt: skip
            if on_answer:
                on_answer(len(answers))
            turn[s] = k + 1
            if turn[s] < len(session.prompts):
                heapq.heappush(due, (max(a["done_at"] + session.gap_s, last_sent[s] + pace, release[s][turn[s]]), s))
    return answers


def arrival_slots(sessions: Sequence[Session]) -> list[list[int]] | None:
    """Each prompt's rank in the sessions' joint arrival order, or None unless every
    session gives its arrivals."""
    if not sessions or not all(len(s.arrivals) == len(s.prompts) for s in sessions):
        return None
    order = sorted((t, i, k) for i, s in enumerate(sessions) for k, t in enumerate(s.arrivals))
    slots = [[0] * len(s.prompts) for s in sessions]
    for n, (_, i, k) in enumerate(order):
        slots[i][k] = n
    return slots


def summarize(answers: Sequence[Answer], slo_s: float) -> dict:
    """A sweep point's figures over its measured answers: TTFT mean and percentiles, the
    share within the SLO, the throughput achieved, prompt and cached tokens, and the mean
    of each part of the TTFT the engines split it into. ``request_goodput_rps`` is vLLM's
    ``benchmark_serving --goodput`` figure at this rate: requests within the SLO per second."""
    measured = [a for a in answers if a.measured]
    ttft = np.array([a.ttft_s for a in measured])
    span = max(a.done_at for a in measured) - min(a.sent_at for a in measured)
    parts = sorted({p for a in measured for p in a.ttft_parts_s})
    return {
        "mean_ttft_parts_ms": {p: float(np.mean([a.ttft_parts_s.get(p, 0.0) for a in measured]) * 1e3) for p in parts},
        "requests": len(measured),
        "mean_ttft_ms": float(ttft.mean() * 1e3),
        "p50_ttft_ms": float(np.percentile(ttft, 50) * 1e3),
        "p90_ttft_ms": float(np.percentile(ttft, 90) * 1e3),
        "p99_ttft_ms": float(np.percentile(ttft, 99) * 1e3),
        "slo_attainment": float((ttft <= slo_s).mean()),
        "throughput_rps": len(measured) / span if span > 0 else float("nan"),
        "request_goodput_rps": int((ttft <= slo_s).sum()) / span if span > 0 else float("nan"),  # vLLM's, at this rate
        "prompt_tokens": sum(a.prompt_tokens for a in measured),
        "cached_tokens": sum(a.cached_tokens for a in measured),
        "requests_per_engine": dict(Counter(a.engine for a in measured)),
    }


def served_share(point: dict, kvray_tokens: dict[str, int]) -> dict[str, float]:
    """Where a point's prompt tokens came from, as shares of them: vLLM's own prefix cache
    on the serving engine (cached tokens kvray did not load), each kvray tier (for the
    runtime: ``host`` is the serving node's mapped host tier, ``local store`` its store
    actor, ``remote`` another node), and computed."""
    prompt = max(1, point["prompt_tokens"])
    loaded = sum(kvray_tokens.values())
    share = {"vllm own cache": max(0, point["cached_tokens"] - loaded) / prompt}
    share.update({f"kvray {tier}": n / prompt for tier, n in kvray_tokens.items()})
    share["computed"] = (point["prompt_tokens"] - point["cached_tokens"]) / prompt
    return share


def repeat_attainments(
    by_rate: dict[float, list[dict]], saturation: float, repeats: int, once: Sequence[float], rates: Sequence[float]
) -> list[dict[float, float]]:
    """Each repeat's SLO share by offered rate (``by_rate``: points by multiple of
    ``saturation``, each with its ``repeat``), for the goodput of each repeat beside the
    median's: a rate in ``once`` (run in the first repeat only) counts in every repeat, one
    of ``rates`` the repeat skipped (past its failed rates) as failed."""
    out = []
    for r in range(repeats):
        shares = {}
        for m, pts in by_rate.items():
            mine = [p for p in pts if p["repeat"] == r] or [p for p in pts if m in once]
            if mine:
                shares[m * saturation] = mine[0]["slo_attainment"]
            elif pts and m in rates:
                shares[m * saturation] = 0.0
        out.append(shares)
    return [a for a in out if a]


def goodput(attainment_by_rate: dict[float, float], share: float = SLO_SHARE) -> float:
    """The highest offered rate at which ``share`` of the requests met the SLO: DistServe's
    goodput (the maximum rate that meets an SLO-attainment target) over a sweep whose
    points are each what vLLM's ``benchmark_serving --goodput`` measures at one rate.
    Between the highest swept rate that met ``share`` and the next (which did not), the
    crossing is interpolated linearly, so the figure moves with the attainment and not by
    a whole sweep step. A failed rate below a passed one does not lower it: on a shared
    machine other work only slows a point, so a pass shows what the system serves and a
    failure below it shows the interference. 0 when no rate met ``share``; the highest
    swept rate, a lower bound, when it met it (:func:`is_lower_bound`)."""
    rates = sorted(attainment_by_rate)
    passed = [i for i, rate in enumerate(rates) if attainment_by_rate[rate] >= share]
    if not passed:
        return 0.0
    i = passed[-1]
    if i == len(rates) - 1:
        return rates[i]
    (low, above), (high, below) = ((r, attainment_by_rate[r]) for r in rates[i : i + 2])
    return low + (high - low) * (above - share) / (above - below)


def is_lower_bound(attainment_by_rate: dict[float, float], share: float = SLO_SHARE) -> bool:
    """Whether the highest swept rate met ``share``: the :func:`goodput` is then that rate,
    a lower bound on the contender's."""
    return bool(attainment_by_rate) and attainment_by_rate[max(attainment_by_rate)] >= share
