"""Benchmarks of the Ray runtime on two local Ray nodes (separate raylets, object stores).

- ``same_node_load_vs_memcpy``: an engine (this process) loading a request's pages from its
  node's host tier through the client API (lookup answered from the mapped slot directory,
  the engine copying the pages out of the mapped host tier, release sent without waiting),
  against ``numpy.copyto`` of the same bytes. The ``via_store_actor`` row is the same load
  with mapped reads off: controller lookup + pin, the store actor copying verified pages
  into the engine's shared-memory buffer, release.
- ``cross_node_transfer_vs_loopback_tcp``: moving a request's pages from the other node
  into this engine's buffer (the load alone, under one lookup's pins; the lookup is
  ``controller_lookup_vs_empty_call``), by each path (direct TCP to the peer's page server,
  Ray's object store, the collective path over gloo), against a raw TCP socket on loopback
  moving the same bytes in this run; NIXL (Ray's tensor transport) beside them where the
  ``nixl`` package is installed. The goal applies to the path kvray picks (the faster of
  TCP and NIXL as measured here, else collective from ``collective_min_bytes`` up, else
  object store). The ``tcp+tell`` row is the TCP load with the request's TELL before it
  (the first load of a request from a peer, whose store's policy hears of the request after
  the answer: :mod:`kvray.cluster.after_answer`), measured alternately with the plain one
  (both orders, the medians averaged; ``plain_tcp_gbps`` in its params).
- ``controller_lookup_vs_empty_call``: lookup + pin of a cached 64-page request against an
  empty call to an actor on the same node.
- ``runtime_start_vs_empty_actors``: :meth:`Runtime.start` (a controller and a store per
  node, each a process of its own, ready to serve) and its close, against as many empty
  actors started on the same nodes and called once: what kvray's own start costs beyond
  Ray's process start (mostly imports; see docs/design.md on torch), without the collective
  group (the default) and with it.
- ``controller_memory_per_page``: the controller's index bytes per indexed page (budget 200),
  beside a plain ``dict`` of key -> (node, tier) measured the same way; the second row
  weighs a simulated 64-node cluster's controller holding 1,000,000 pages.
- ``controller_shard_spread``: in-process, the bundled conversation trace (one root page
  under all 5,719 requests) looked up through 4 controller shards routed past the shared
  root (``controller_route_depth=1``), against the same routed by the root: the busiest
  shard's lookups over an even share (goal: at most 1.3x).
"""

from __future__ import annotations

import atexit
import itertools
import socket
import sys
import threading

import numpy as np
import ray

from kvray.bench import BenchResult, alternating_medians, benchmark, paired_medians
from kvray.cluster import KvrayClient, RayConnection, Runtime, RuntimeConfig
from kvray.cluster.controller import Controller
from kvray.cluster.paths import NIXL_IMPORTABLE
from kvray.cluster.protocol import Plan
from kvray.cluster.runtime import on_node
from kvray.core.config import PageLayout, TierSizes
from kvray.core.errors import ClusterError
from kvray.core.keys import ModelFingerprint, pack_keys, trace_page_keys
from kvray.core.partition import chain_shard
from kvray.traces import read_trace

# Llama-3-8B-like pages (8 KV heads x 128, bf16, 128 tokens, 4 layers): 2 MiB each.
LAYOUT = PageLayout(layers=4, kv_heads=8, head_dim=128, page_tokens=128, dtype="bfloat16")
REQUEST_PAGES = 32  # 64 MiB
SIZES = {"2MiB": 1, "64MiB": 32}
# NIXL (Ray's tensor transport over UCX; TCP here) where the nixl package is installed
SPREAD_TRACE = "conversation_trace_first30min.jsonl"  # one root page under every request
CROSS_NODE_PATHS = ("tcp", *(("nixl",) if NIXL_IMPORTABLE else ()), "object_store", "collective")


class _Bench:
    """Two local nodes, a runtime, and a client in this process (on the head node)."""

    _instance: _Bench | None = None
    _failure: ClusterError | None = None  # Ray did not start: every runtime benchmark is skipped at once

    def __init__(self) -> None:
        self.connection = None
        if not ray.is_initialized():
            self.connection = RayConnection(nodes=2, object_store_mb=400).__enter__()
        self.config = RuntimeConfig(
            name="bench",
            layout=LAYOUT,
            tiers=TierSizes(host=2 * REQUEST_PAGES + 8),
            local_pages_limit=1 << 20,
            collective=True,  # the collective row needs the group
        )
        self.runtime = Runtime.start(self.config)
        self.client = KvrayClient.connect("bench", buffer_pages=REQUEST_PAGES)
        self.nixl_config = self.config.model_copy(update={"nixl": True})  # what kvray would pick with NIXL on
        self.here = self.client.node_id
        self.there = next(n for n in self.runtime.stores if n != self.here)
        self.requests = {node: self._cached_request(node, seed) for seed, node in enumerate((self.here, self.there))}
        atexit.register(self.close)

    @classmethod
    def get(cls) -> _Bench:
        if cls._failure is not None:
            raise cls._failure
        if cls._instance is None:
            try:
                cls._instance = cls()
            except ClusterError as exc:
                cls._failure = exc
                raise
        return cls._instance

    def _cached_request(self, node: str, seed: int) -> list[int]:
        keys = self.client.keys_for_trace(list(range(seed * 1000, seed * 1000 + REQUEST_PAGES)))
        self.client.buffer.pages[:] = np.random.default_rng(seed).integers(0, 256, self.client.buffer.pages.shape, dtype=np.uint8)
        self.client.store(keys, 0, Plan.placing([node] * REQUEST_PAGES))
        ray.get(self.runtime.controller.snapshot.remote())  # the commit has landed
        return keys

    def use_path(self, path: str) -> None:
        """Force cross-node pages onto ``path`` (tcp, nixl, collective or object_store)."""
        self.client.config = self.config.model_copy(
            update={
                "tcp": path == "tcp",
                "nixl": path == "nixl",
                "collective_min_bytes": 0 if path == "collective" else 1 << 40,
            }
        )

    def load(self, keys: list[int], mapped_reads: bool = True) -> None:
        """What an engine does on a hit: lookup (+ pin), load, release."""
        self.client.mapped_reads = mapped_reads
        with self.client.request(keys) as r:
            assert r.hit == len(keys), r.loaded

    def transfer(self, keys: list[int], plan: Plan, tell: bool = False) -> None:
        """The move alone: load the pages of a plan already pinned (``tell``: as a request's
        first load from the peer, whose store is told of the request)."""
        if tell:
            self.client.context.arrive(pack_keys(keys), 0.0, None)
        loaded = self.client.load(keys, plan)
        assert loaded.pages == len(keys), loaded

    def close(self) -> None:
        self.client.close()
        self.runtime.close()
        if self.connection is not None:
            self.connection.__exit__(None, None, None)


class _LoopbackTCP:
    """One persistent TCP connection on 127.0.0.1; ``move(n)`` sends n bytes across it."""

    def __init__(self, nbytes: int) -> None:
        server = socket.create_server(("127.0.0.1", 0))
        self.tx = socket.create_connection(server.getsockname())
        self.rx, _ = server.accept()
        server.close()
        self.src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
        self.dst = np.empty(nbytes, dtype=np.uint8)

    def move(self) -> None:
        sender = threading.Thread(target=self.tx.sendall, args=(memoryview(self.src),))
        sender.start()
        view, got = memoryview(self.dst), 0
        while got < len(view):
            got += self.rx.recv_into(view[got:])
        sender.join()

    def close(self) -> None:
        self.tx.close()
        self.rx.close()


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


@benchmark("same_node_load_vs_memcpy")
def same_node_load(quick: bool) -> list[BenchResult]:
    bench = _Bench.get()
    keys = bench.requests[bench.here]
    nbytes = len(keys) * LAYOUT.page_nbytes
    src = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    params = {"pages": len(keys), "page_bytes": LAYOUT.page_nbytes, "checksum_memory": bench.config.checksum_memory}
    mapped, via_actor, base = alternating_medians(
        lambda: bench.load(keys, True),
        lambda: bench.load(keys, False),
        lambda: np.copyto(dst, src),
        repeats=7 if quick else 21,
    )
    bench.client.mapped_reads = True
    return [
        BenchResult("same_node_load_vs_memcpy[64MiB]", _gbps(nbytes, mapped), _gbps(nbytes, base), "GB/s", ">= 0.8", params),
        BenchResult(
            "same_node_load_via_store_actor_vs_memcpy[64MiB]", _gbps(nbytes, via_actor), _gbps(nbytes, base), "GB/s", None, params
        ),
    ]


@benchmark("cross_node_transfer_vs_loopback_tcp")
def cross_node(quick: bool) -> list[BenchResult]:
    bench = _Bench.get()
    results = []
    for label, pages in SIZES.items():
        keys = bench.requests[bench.there][:pages]
        nbytes = pages * LAYOUT.page_nbytes
        tcp = _LoopbackTCP(nbytes)
        plan = bench.client.lookup(keys)  # pinned for the whole measurement: every load is a full hit
        for path in CROSS_NODE_PATHS:
            bench.use_path(path)
            repeats = 5 if quick else 15
            if path == "tcp":  # and with a TELL before each load, alternately, in both orders
                plain, told = (lambda: bench.transfer(keys, plan)), (lambda: bench.transfer(keys, plan, tell=True))
                ahead = alternating_medians(plain, told, tcp.move, repeats=repeats)
                behind = alternating_medians(told, plain, tcp.move, repeats=repeats)
                kvray, told, base = (ahead[0] + behind[1]) / 2, (ahead[1] + behind[0]) / 2, (ahead[2] + behind[2]) / 2
                params = {"picked_by_kvray": False, "pages": pages, "plain_tcp_gbps": _gbps(nbytes, kvray)}
                name = f"cross_node_transfer_vs_loopback_tcp[tcp+tell,{label}]"
                results.append(BenchResult(name, _gbps(nbytes, told), _gbps(nbytes, base), "GB/s", None, params))
            else:
                kvray, base = paired_medians(lambda: bench.transfer(keys, plan), tcp.move, repeats)
            # TCP and NIXL are both measured above: kvray's choice between them is the faster
            direct = bench.client.speeds.best(bench.there, bench.client.direct_paths(bench.there, bench.nixl_config))
            picked = path == (direct or bench.client.path_for(bench.there, nbytes, bench.config))
            results.append(
                BenchResult(
                    f"cross_node_transfer_vs_loopback_tcp[{path},{label}]",
                    _gbps(nbytes, kvray),
                    _gbps(nbytes, base),
                    "GB/s",
                    ">= 0.5" if picked else None,
                    {"picked_by_kvray": picked, "pages": pages},
                )
            )
        bench.client.release(plan, bench.client.load(keys, plan))
        tcp.close()
    return results


@benchmark("cross_node_store_vs_loopback_tcp")
def cross_node_store(quick: bool) -> list[BenchResult]:
    """Storing a run of new pages on the other node (``client.store`` with a plan placing
    them there; each round new keys, so every round really writes and evicts) by direct TCP
    and by the object store, against raw loopback TCP moving the same bytes."""
    bench = _Bench.get()
    rounds = itertools.count(10_000, REQUEST_PAGES)
    results = []
    for label, pages in SIZES.items():
        nbytes = pages * LAYOUT.page_nbytes
        tcp = _LoopbackTCP(nbytes)

        def store() -> None:
            first = next(rounds)
            keys = bench.client.keys_for_trace(list(range(first, first + pages)))
            assert bench.client.store(keys, 0, Plan.placing([bench.there] * pages)) == pages

        for path in ("tcp", "object_store"):
            bench.use_path(path)
            # Steady state: every slot of the receiving host tier written once, so no round
            # pays the first-touch page faults of fresh shared memory (~1-2 ms per 2 MiB).
            for _ in range(-(-bench.config.tiers.host // pages)):
                store()
            kvray, base = paired_medians(store, tcp.move, 5 if quick else 15)
            results.append(
                BenchResult(
                    f"cross_node_store_vs_loopback_tcp[{path},{label}]",
                    _gbps(nbytes, kvray),
                    _gbps(nbytes, base),
                    "GB/s",
                    None,
                    {"picked_by_kvray": path == "tcp", "pages": pages},
                )
            )
        tcp.close()
    bench.use_path("tcp")
    return results


@ray.remote(num_cpus=0)
class _Empty:
    def call(self) -> None:
        return None


@benchmark("controller_lookup_vs_empty_call")
def controller_lookup(quick: bool) -> list[BenchResult]:
    bench = _Bench.get()
    keys = bench.requests[bench.here]
    request = keys + bench.client.keys_for_trace(list(range(5000, 5000 + 64 - len(keys))))  # 64 pages, 32 cached
    empty = _Empty.options(scheduling_strategy=on_node(bench.here)).remote()
    controller = bench.runtime.controller

    def lookup() -> None:
        plan = ray.get(controller.lookup_pin.remote(request, bench.here))
        controller.release.remote(plan.lease, {}, {})

    kvray, base = paired_medians(lookup, lambda: ray.get(empty.call.remote()), 50 if quick else 200, warmup=5)
    ray.kill(empty)
    return [
        BenchResult(
            "controller_lookup_vs_empty_call[64 pages]",
            kvray * 1e6,
            base * 1e6,
            "us",
            "<= 1.5",
            {"pages": 64, "cached": len(keys)},
        )
    ]


@benchmark("runtime_start_vs_empty_actors")
def runtime_start(quick: bool) -> list[BenchResult]:
    bench = _Bench.get()
    names = itertools.count()
    nodes = list(bench.runtime.stores)
    homes = [bench.here, *nodes]  # the controller beside the driver, a store on every node

    def start_empty() -> None:
        actors = [_Empty.options(scheduling_strategy=on_node(node)).remote() for node in homes]
        ray.get([a.call.remote() for a in actors])
        for actor in actors:
            ray.kill(actor)

    results = []
    for collective in (True, False):  # the collective group loads torch in every store
        config = bench.config.model_copy(update={"collective": collective})

        def start_runtime() -> None:
            Runtime.start(config.model_copy(update={"name": f"bench-start-{next(names)}"})).close()

        kvray, base = paired_medians(start_runtime, start_empty, 3 if quick else 7)
        results.append(
            BenchResult(
                f"runtime_start_vs_empty_actors[{len(nodes)} nodes,collective {'on' if collective else 'off (default)'}]",
                kvray,
                base,
                "s",
                "<= 2.5",
                {"nodes": len(nodes), "processes": len(homes), "collective": collective},
            )
        )
    return results


@benchmark("controller_memory_per_page")
def controller_memory(quick: bool) -> list[BenchResult]:
    """In-process: the controller's index is plain Python; no Ray needed to weigh it. One
    controller as a runtime uses it, and one of a simulated 64-node cluster holding
    1,000,000 pages (the metadata of one shard; shards split it)."""
    sizes = ((4, 50_000), (64, 100_000)) if quick else ((4, 200_000), (64, 1_000_000))
    return [weigh_controller(nodes, pages) for nodes, pages in sizes]


@benchmark("controller_shard_spread")
def controller_shard_spread(quick: bool) -> list[BenchResult]:
    """Each request is a ``lookup_pin`` and ``release`` at the shard its chain routes to, and
    a miss stores its missing pages there (``commit``), as a client does; the shards are
    real controllers in this process (routing needs no Ray), and what is counted is what
    each of them served (its ``lookups``)."""
    shards = 4
    fingerprint = ModelFingerprint.of(LAYOUT, "spread")
    requests = [trace_page_keys(fingerprint, r.hash_ids) for r in read_trace(SPREAD_TRACE, limit=1000 if quick else None)]
    busiest: dict[int, float] = {}
    for depth in (1, 0):
        config = RuntimeConfig(name="spread", controller_shards=shards, controller_route_depth=depth)
        controllers = [Controller(config, shard=shard) for shard in range(shards)]
        for controller in controllers:
            controller.register_store("node", None)
        for keys in requests:
            controller = controllers[chain_shard(keys, shards, depth)]
            plan = controller.lookup_pin(keys, "node")
            if plan.hit_pages < len(keys):
                parent = keys[plan.hit_pages - 1] if plan.hit_pages else None
                controller.commit(parent, keys[plan.hit_pages :], plan.targets, plan.hit_pages, {})
            controller.release(plan.lease, {}, {})
        lookups = [controller.lookups for controller in controllers]
        busiest[depth] = max(lookups) / (sum(lookups) / shards)
        if depth == 1:
            by_shard = lookups
            indexed = [len(controller.index) for controller in controllers]
    return [
        BenchResult(
            f"controller_shard_spread[conversation trace,{shards} shards, busiest vs even share]",
            busiest[1],
            busiest[0],
            "x even",
            None,
            {
                "requests": len(requests),
                "route_depth": 1,
                "baseline": "routed by the root page (controller_route_depth=0)",
                "lookups_by_shard": by_shard,
                "indexed_pages_by_shard": indexed,
                "goal": "<= 1.3x an even share",
                "met": busiest[1] <= 1.3,
            },
        )
    ]


def weigh_controller(nodes: int, pages: int, chain: int = 64) -> BenchResult:
    """Index bytes per page of a controller holding ``pages`` pages in ``chain``-page chains
    spread over ``nodes`` nodes (one location per page: a page held twice is indexed once),
    beside a plain ``dict`` of key -> (node, tier) measured the same way. ``params`` also
    carry what Python allocated for the index while it filled (tracemalloc, the keys
    included), a check on the estimate's completeness."""
    import tracemalloc

    controller = Controller(RuntimeConfig(name="weigh"))
    node_ids = [f"{i:056x}" for i in range(nodes)]
    for node in node_ids:
        controller.register_store(node, None)
    keys = np.random.default_rng(0).integers(0, 2**63, pages, dtype=np.int64).tolist()
    tracemalloc.start()
    keys = [k << 64 | k for k in keys]  # 128-bit keys, like page_keys
    for start in range(0, pages, chain):
        run = keys[start : start + chain]
        controller.commit(None, run, [node_ids[(start // chain) % nodes]] * len(run), 0, {})
    allocated = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    per_page = controller.index.memory_bytes() / len(controller.index)
    plain = {k: (i % nodes, 1) for i, k in enumerate(keys)}
    plain_bytes = sys.getsizeof(plain) + sum(sys.getsizeof(k) + sys.getsizeof(v) for k, v in plain.items())
    return BenchResult(
        "controller_memory_per_page_vs_dict" + ("" if nodes == 4 else f"[{nodes} nodes,{pages} pages]"),
        per_page,
        plain_bytes / pages,
        "bytes",
        None,
        {
            "pages": pages,
            "nodes": nodes,
            "budget_bytes": 200,
            "within_budget": per_page <= 200,
            "allocated_per_page": round(allocated / pages, 1),
        },
    )
