"""``kvray bench --only concurrency``: many clients at once on three local Ray nodes.

A shared-prefix agent workload: agents each with a system prompt of ``PREFIX_PAGES`` pages
shared by all their sessions, and sessions whose history grows by a page a turn; a
request is an agent's prompt plus one session's history so far. Requests go to the node
that serves their agent (sticky routing, as an agent service's router does), where
client processes (``PROCESSES_PER_NODE`` actors per node) serve them on threads, each
thread with its own :class:`~kvray.cluster.client.KvrayClient` (one landing buffer per
request in flight), each request a :func:`~kvray.cluster.checked.serve_checked`: lookup,
load, check every loaded page's bytes, compute the missing pages, release, store.

- ``concurrency_throughput[N clients]`` / ``concurrency_p50`` / ``concurrency_p99``: the
  same request list served by N clients, each with ``DEPTH`` requests in flight (the
  peak level: 256 x 4 = 1,024 in flight), against that list replayed by one client, one
  request at a time (no contention), in the same run. Each run uses its own tenant salt,
  so each starts cold. ``params`` carry the measured peak of requests in flight, wrong
  pages (0: every loaded byte is checked), calls given up (timeouts: no deadlock), and
  whether the controller's and the clients' counters agree.
- ``concurrency_lookup_throughput[K shards]``: controller lookups (``lookup_pin`` +
  ``release`` of cached 8-page requests, routed by :class:`~kvray.cluster.shards.ControllerShards`
  as clients route them, ``WINDOW`` outstanding per client process) per second with K
  controller shards, against 1 shard in the same run.

The detailed figures go to ``concurrency.json`` and ``concurrency.png`` in ``KVRAY_BENCH_OUT``
(default ``results/bench``); the knee is the last level before throughput stops growing
``KNEE_GAIN`` times from one level to the next.

Example::

    kvray bench --only concurrency --quick     # 2 -> 4 -> 8 clients, 1 and 2 shards
"""

from __future__ import annotations

import itertools
import json
import os
import random
import statistics
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ray

from kvray.bench import BenchResult, benchmark
from kvray.cluster import KvrayClient, RayConnection, Runtime, RuntimeConfig
from kvray.cluster.checked import PagePattern, serve_checked
from kvray.cluster.protocol import new_lease
from kvray.cluster.runtime import alive_nodes, on_node
from kvray.cluster.shards import ControllerShards
from kvray.core.config import PageLayout, TierSizes

LAYOUT = PageLayout(layers=2, kv_heads=2, head_dim=16, page_tokens=16, dtype="float16")  # 4 KiB pages
PREFIX_PAGES = 4  # an agent's system prompt
TURNS = 4  # a session's history: 1..TURNS pages after the prompt
PROCESSES_PER_NODE = 2
DEPTH = 4  # requests in flight per client
WINDOW = 64  # lookups outstanding per client process in the shard phase
KNEE_GAIN = 1.25
CALL_TIMEOUT_S = 30.0  # a client's wait for any one call; past it, a miss (counted)
RUN_TIMEOUT_S = 600.0  # a level that has not finished by then is a deadlock: the bench fails


def agent_requests(count: int, agents: int, sessions: int, seed: int = 0) -> list[tuple[int, list[int]]]:
    """``count`` requests as (agent, trace block ids): an agent's prompt then a session's history."""
    rng = random.Random(seed)
    requests = []
    for _ in range(count):
        agent, session, turn = rng.randrange(agents), rng.randrange(sessions), rng.randrange(TURNS)
        prompt = [agent * 1_000 + j for j in range(PREFIX_PAGES)]
        history = [10**7 + (agent * sessions + session) * TURNS + t for t in range(turn + 1)]
        requests.append((agent, prompt + history))
    return requests


@ray.remote(num_cpus=0)
class ClientProcess:
    """One client process on its node: threads each serving requests with their own client.

    Example::

        proc = ClientProcess.options(scheduling_strategy=on_node(node)).remote("kvray", clients=8)
        ray.get(proc.serve.remote([[1, 2, 3], [1, 2, 4]], threads=2, salt="run-1"))["counts"]
    """

    def __init__(self, runtime_name: str, clients: int, mapped_reads: bool = True) -> None:
        self.shards = ControllerShards.find(runtime_name)
        config = ray.get(self.shards.handles[0].runtime_config.remote())
        self.clients = [
            KvrayClient(
                config, self.shards, buffer_pages=PREFIX_PAGES + TURNS, timeout_s=CALL_TIMEOUT_S, mapped_reads=mapped_reads
            )
            for _ in range(clients)
        ]
        self.node_id = ray.get_runtime_context().get_node_id()
        self.page_nbytes = config.layout.page_nbytes

    def serve(self, requests: list[list[int]], threads: int, salt: str) -> dict:
        """Serve ``requests`` (trace block ids) on ``threads`` threads, each taking the next one."""
        queue = iter(range(len(requests)))
        lock = threading.Lock()
        spans = [(0.0, 0.0)] * len(requests)

        def work(client: KvrayClient) -> Counter:
            pattern, seen = PagePattern(self.page_nbytes), Counter()
            while True:
                with lock:
                    i = next(queue, None)
                if i is None:
                    return seen
                start = time.time()
                keys = client.keys_for_trace(requests[i], salt)
                served = serve_checked(client, pattern, keys)
                spans[i] = (start, time.time())
                seen["wrong_pages"] += served.wrong
                seen["stored_pages"] += served.stored
                seen["requests"] += 1
                seen["lookup_pages"] += len(keys)
                seen["hit_pages"] += served.hit

        faults_before = sum(sum(c.faults.values()) for c in self.clients)
        with ThreadPoolExecutor(max_workers=threads) as pool:
            tallies = list(pool.map(work, self.clients[:threads]))
        total = sum(tallies, Counter())
        total["faults"] = sum(sum(c.faults.values()) for c in self.clients) - faults_before
        return {"spans": spans, "counts": dict(total)}

    def lookups(self, requests: list[list[int]], salt: str, count: int) -> list[float]:
        """``count`` lookup_pin + release pairs of ``requests`` (cached), ``WINDOW`` outstanding,
        routed to their shards; returns each lookup's latency."""
        client = self.clients[0]
        keyed = [client.keys_for_trace(ids, salt) for ids in requests]
        pending, latencies, issued = {}, [], 0
        while issued < count or pending:
            while issued < count and len(pending) < WINDOW:
                keys = keyed[issued % len(keyed)]
                shard = self.shards.for_keys(keys)
                pending[shard.lookup_pin.remote(keys, self.node_id, new_lease())] = (shard, time.perf_counter())
                issued += 1
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=CALL_TIMEOUT_S)
            if not ready:
                raise TimeoutError(f"no lookup answered in {CALL_TIMEOUT_S:g} s")
            for ref in ready:
                shard, t0 = pending.pop(ref)
                plan = ray.get(ref)
                latencies.append(time.perf_counter() - t0)
                shard.release.remote(plan.lease, {}, {})
        return latencies

    def close(self) -> None:
        for client in self.clients:
            client.close()


class _Cluster:
    """Three local Ray nodes (or the connected cluster) for the whole benchmark."""

    def __init__(self) -> None:
        self.connection = None if ray.is_initialized() else RayConnection(nodes=3, object_store_mb=100).__enter__()
        self.nodes = alive_nodes()
        self._names = itertools.count()

    def runtime(self, shards: int, host_pages: int) -> Runtime:
        config = RuntimeConfig(
            name=f"concurrency{next(self._names)}",
            layout=LAYOUT,
            tiers=TierSizes(host=host_pages),
            local_pages_limit=1 << 20,  # an agent's pages stay on its node
            max_request_pages=PREFIX_PAGES + TURNS,
            collective=False,
            controller_shards=shards,
        )
        return Runtime.start(config)

    def processes(self, runtime: Runtime, clients_per_process: int, mapped_reads: bool = True) -> list:
        procs = [
            ClientProcess.options(scheduling_strategy=on_node(node)).remote(
                runtime.config.name, clients_per_process, mapped_reads
            )
            for node in self.nodes
            for _ in range(PROCESSES_PER_NODE)
        ]
        ray.get([p.__ray_ready__.remote() for p in procs], timeout=RUN_TIMEOUT_S)
        return procs

    def close(self) -> None:
        if self.connection is not None:
            self.connection.__exit__()


def settled(runtime: Runtime, before: dict, expect: Counter, timeout_s: float = 60.0) -> tuple[dict, bool]:
    """The controller's counters once the reports sent without waiting have landed; whether
    they agree with what the clients counted (requests, pages looked up, pages hit)."""
    deadline = time.monotonic() + timeout_s
    while True:
        snap = runtime.shards.snapshot()
        got = Counter(
            requests=snap["lookups"] + snap["local_lookups"] - before["lookups"] - before["local_lookups"],
            lookup_pages=snap["lookup_pages"] - before["lookup_pages"],
            hit_pages=sum(snap["hit_pages_by_tier"].values()) - sum(before["hit_pages_by_tier"].values()),
        )
        ok = all(got[k] == expect[k] for k in got) and snap["open_leases"] == 0
        if ok or time.monotonic() > deadline:
            return snap, ok
        time.sleep(0.2)


def in_flight_peak(spans: list[tuple[float, float]]) -> int:
    """Most requests between their start and end at any one moment."""
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    return max(itertools.accumulate(d for _, d in events))


def serve_run(runtime: Runtime, procs: list, nodes: list[str], requests, clients: int, salt: str) -> dict:
    """Serve ``requests`` with ``clients`` x DEPTH threads spread over the processes, each
    agent's requests on its node's processes; ``clients`` 0: the baseline, one thread in
    one process serving them in order (no contention)."""
    by_proc: list[list[list[int]]] = [[] for _ in procs]
    for i, (agent, ids) in enumerate(requests):
        node = agent % len(nodes)
        by_proc[node * PROCESSES_PER_NODE + i % PROCESSES_PER_NODE].append(ids)
    active = [p for p, reqs in enumerate(by_proc) if reqs]
    per_proc = [max(clients * DEPTH // len(active), 1)] * len(active)
    if not clients:
        active, by_proc, per_proc = [0], [[ids for _, ids in requests]], [1]
    before = runtime.shards.snapshot()
    t0 = time.time()
    outs = ray.get(
        [procs[p].serve.remote(by_proc[p], n, salt) for p, n in zip(active, per_proc)],
        timeout=RUN_TIMEOUT_S,
    )
    elapsed = time.time() - t0
    counts = sum((Counter(o["counts"]) for o in outs), Counter())
    spans = [span for o in outs for span in o["spans"]]
    _, consistent = settled(runtime, before, counts)
    latencies = sorted(e - s for s, e in spans)
    return {
        "clients": clients,
        "threads": sum(per_proc),
        "requests": counts["requests"],
        "throughput_rps": counts["requests"] / elapsed,
        "p50_ms": statistics.median(latencies) * 1e3,
        "p99_ms": latencies[min(int(len(latencies) * 0.99), len(latencies) - 1)] * 1e3,
        "in_flight_peak": in_flight_peak(spans),
        "wrong_pages": counts["wrong_pages"],
        "faults": counts["faults"],
        "hit_pages": counts["hit_pages"],
        "lookup_pages": counts["lookup_pages"],
        "counters_consistent": consistent,
    }


def knee(levels: list[dict]) -> int | None:
    """Where the curve bends: the last level (clients) before throughput stops growing by
    KNEE_GAIN x from one level to the next; None if it still grows at the last level."""
    for prev, cur in itertools.pairwise(levels):
        if cur["throughput_rps"] < KNEE_GAIN * prev["throughput_rps"]:
            return prev["clients"]
    return None


def lookup_run(cluster: _Cluster, shards: int, requests, count: int) -> dict:
    """Lookup throughput of a runtime with ``shards`` controller shards, on cached requests."""
    runtime = cluster.runtime(shards, host_pages=2048)
    procs = cluster.processes(runtime, clients_per_process=1, mapped_reads=False)
    try:
        distinct = list({tuple(ids): (agent, ids) for agent, ids in requests}.values())
        serve_run(runtime, procs, cluster.nodes, distinct, clients=8, salt="lookups")  # cache them all
        per_proc = [list(distinct[p :: len(procs)]) for p in range(len(procs))]
        t0 = time.perf_counter()
        latencies = ray.get(
            [
                proc.lookups.remote([list(ids) for _, ids in mine], "lookups", count // len(procs))
                for proc, mine in zip(procs, per_proc)
            ],
            timeout=RUN_TIMEOUT_S,
        )
        elapsed = time.perf_counter() - t0
        flat = sorted(x for part in latencies for x in part)
        snap = runtime.shards.snapshot()
        return {
            "shards": shards,
            "lookups_per_s": len(flat) / elapsed,
            "p50_ms": statistics.median(flat) * 1e3,
            "lookups_by_shard": [s["lookups"] for s in snap["shards"]],
        }
    finally:
        stop(procs)
        runtime.close()


@benchmark("concurrency")
def concurrency(quick: bool) -> list[BenchResult]:
    if quick:
        report = run_concurrency(levels=(2, 4, 8), shard_counts=(1, 2), requests=96, agents=6, sessions=4, lookups=2000)
    else:
        report = run_concurrency(
            levels=(8, 32, 64, 128, 256), shard_counts=(1, 2, 4), requests=3072, agents=24, sessions=16, lookups=12000
        )
    write_report(report)
    return results_of(report)


def run_concurrency(
    levels: tuple[int, ...], shard_counts: tuple[int, ...], requests: int, agents: int, sessions: int, lookups: int
) -> dict:
    """Serve the same ``requests`` at each level of concurrent clients and by one client, then
    measure ``lookups`` controller lookups with each shard count; the report's figures."""
    workload = agent_requests(requests, agents, sessions)
    cluster = _Cluster()
    try:
        runtime = cluster.runtime(1, host_pages=4096)
        per_process = -(-max(levels) * DEPTH // (PROCESSES_PER_NODE * len(cluster.nodes)))
        procs = cluster.processes(runtime, clients_per_process=per_process)
        try:
            served = [serve_run(runtime, procs, cluster.nodes, workload, c, f"level-{c}") for c in levels]
            serial = serve_run(runtime, procs, cluster.nodes, workload, 0, "serial")
        finally:
            stop(procs)
            runtime.close()
        by_shards = [lookup_run(cluster, k, workload, lookups) for k in shard_counts]
    finally:
        cluster.close()
    return {
        "workload": {"requests": requests, "agents": agents, "sessions_per_agent": sessions, "prefix_pages": PREFIX_PAGES},
        "nodes": len(cluster.nodes),
        "processes": PROCESSES_PER_NODE * len(cluster.nodes),
        "depth": DEPTH,
        "levels": served,
        "serial": serial,
        "knee_clients": knee(served),
        "lookups_by_shards": by_shards,
    }


def stop(procs: list) -> None:
    ray.get([p.close.remote() for p in procs], timeout=120)
    for p in procs:
        ray.kill(p)


def results_of(report: dict) -> list[BenchResult]:
    serial, results = report["serial"], []
    common = {"knee_clients": report["knee_clients"], "nodes": report["nodes"], "requests": report["workload"]["requests"]}
    for level in report["levels"]:
        params = {
            **common,
            **{k: level[k] for k in ("threads", "in_flight_peak", "wrong_pages", "faults", "counters_consistent")},
        }
        name = f"[{level['clients']} clients]"
        results += [
            BenchResult(
                f"concurrency_throughput{name}", level["throughput_rps"], serial["throughput_rps"], "req/s", None, params
            ),
            BenchResult(f"concurrency_p50{name}", level["p50_ms"], serial["p50_ms"], "ms", None, params),
            BenchResult(f"concurrency_p99{name}", level["p99_ms"], serial["p99_ms"], "ms", None, params),
        ]
    one = report["lookups_by_shards"][0]
    for run in report["lookups_by_shards"][1:]:
        results.append(
            BenchResult(
                f"concurrency_lookup_throughput[{run['shards']} shards]",
                run["lookups_per_s"],
                one["lookups_per_s"],
                "lookups/s",
                None,
                {"baseline": "1 shard", "lookups_by_shard": run["lookups_by_shard"], "p50_ms": run["p50_ms"]},
            )
        )
    return results


def write_report(report: dict) -> Path:
    """``concurrency.json`` and a plot beside it in ``KVRAY_BENCH_OUT`` (default results/bench)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(os.environ.get("KVRAY_BENCH_OUT", "results/bench"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "concurrency.json").write_text(json.dumps(report, indent=2))
    levels, serial = report["levels"], report["serial"]
    clients = [lv["clients"] for lv in levels]
    fig, (ax_t, ax_l, ax_s) = plt.subplots(1, 3, figsize=(15, 4.2))
    ax_t.plot(clients, [lv["throughput_rps"] for lv in levels], "o-", label="kvray, N clients")
    ax_t.axhline(serial["throughput_rps"], color="gray", ls="--", label="one client, no contention")
    if report["knee_clients"]:
        ax_t.axvline(report["knee_clients"], color="red", ls=":", label=f"knee ({report['knee_clients']} clients)")
    ax_t.set(xscale="log", xlabel="concurrent clients", ylabel="requests / s", title="throughput")
    ax_l.plot(clients, [lv["p50_ms"] for lv in levels], "o-", label="p50")
    ax_l.plot(clients, [lv["p99_ms"] for lv in levels], "s-", label="p99")
    ax_l.axhline(serial["p50_ms"], color="gray", ls="--", label="p50, one client")
    ax_l.set(xscale="log", yscale="log", xlabel="concurrent clients", ylabel="ms per request", title="latency")
    shards = report["lookups_by_shards"]
    ax_s.bar([str(s["shards"]) for s in shards], [s["lookups_per_s"] for s in shards])
    ax_s.set(xlabel="controller shards", ylabel="lookups / s", title="controller lookups")
    for ax in (ax_t, ax_l):
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "concurrency.png", dpi=120)
    plt.close(fig)
    return out / "concurrency.json"
