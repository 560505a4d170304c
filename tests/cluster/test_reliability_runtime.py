"""Reliability of the Ray runtime with real processes: the controller or a store actor
killed mid-replay, many client processes at once, and tenants kept apart by their salt.

Each test prints one ``RELIABILITY {...}`` line with what it measured (run with ``-s``);
docs/reliability.md tabulates them. Those where the controller's sharding matters run with
1 and 2 controller shards; with 2, the controller kill kills one shard, which rebuilds the
chains it owns while the other keeps serving.
"""

from __future__ import annotations

import itertools
import json
import random
import time

import numpy as np
import pytest
import ray

from kvray.cluster import KvrayClient, Runtime, RuntimeConfig
from kvray.cluster.checked import PagePattern, serve_checked
from kvray.cluster.controller import REBUILD_WAIT_S
from kvray.core.config import PageLayout, TierSizes
from kvray.core.partition import shard_of
from kvray.traces import read_trace
from tests.apps.test_replay import TRACE
from tests.cluster.test_faults import SHARDS, replay_with_fault, restarted_info

pytestmark = [pytest.mark.ray, pytest.mark.fault]

LAYOUT = PageLayout(layers=2, kv_heads=2, head_dim=16, page_tokens=512, dtype="float16")
# A restarted controller answers within: Ray restarting the actor process, plus waiting
# at most REBUILD_WAIT_S for the stores' holdings, plus slack for a loaded 2-core machine.
CONTROLLER_RECOVERY_BOUND_S = 30.0 + REBUILD_WAIT_S
_names = itertools.count()


def report(fault: str, **figures) -> None:
    print("RELIABILITY " + json.dumps({"fault": fault, **figures}))


def indexed_keys(runtime: Runtime) -> set[int]:
    """Every key indexed by any controller shard."""
    keys = ray.get([shard.__ray_call__.remote(lambda self: list(self.index.keys())) for shard in runtime.shards.handles])
    return {key for shard in keys for key in shard}


def roots_by_shard(runtime: Runtime) -> list[list[int]]:
    """Each shard's chain roots (its pages hang from them: the index is prefix-closed)."""

    def roots(self) -> list[int]:
        return [k for k in self.index.keys() if self.index.parent[self.index.handle_of(k)] == -1]

    return ray.get([shard.__ray_call__.remote(roots) for shard in runtime.shards.handles])


def held_keys(runtime: Runtime) -> set[int]:
    """Pages the stores hold with a known place in their chain (what a rebuild can restore)."""
    held = ray.get([store.holdings.remote() for store in runtime.stores.values()])
    return {key for h in held for key, _ in h["pages"]}


def start(**overrides) -> tuple[RuntimeConfig, Runtime]:
    config = RuntimeConfig(name=f"r{next(_names)}", layout=LAYOUT, collective=False, **overrides)
    return config, Runtime.start(config)


def serve(client: KvrayClient, pattern: PagePattern, keys: list[int]) -> tuple[int, int]:
    """One checked engine request; returns (pages hit, pages whose bytes were wrong)."""
    served = serve_checked(client, pattern, keys)
    return served.hit, served.wrong


@SHARDS
def test_a_killed_controller_is_restarted_and_rebuilds_its_index_from_the_stores(ray_cluster, shards):
    """Mid-replay the controller process dies (with 2 shards: the shard holding the most
    pages); Ray restarts it and it rebuilds membership and its index (its shard's chains)
    from the store actors within CONTROLLER_RECOVERY_BOUND_S; the replay completes,
    requests during the outage are misses, no page the stores held is lost to the index,
    and every shard indexes only chains it owns."""
    config, runtime = start(tiers=TierSizes(host=300), controller_shards=shards)
    nodes = sorted(runtime.stores)
    trace = read_trace(TRACE)[1000:1040]
    seen: dict = {}

    def kill_at_half(i: int) -> None:
        if i != len(trace) // 2:
            return
        time.sleep(0.5)  # let the previous request's commit (sent without waiting) land
        seen["indexed"] = indexed_keys(runtime)
        seen["held"] = held_keys(runtime)
        by_shard = runtime.shards.snapshot()["shards"]
        seen["victim"] = victim = max(by_shard, key=lambda s: s["indexed_pages"])["shard"]
        seen["victim_pages"] = by_shard[victim]["indexed_pages"]
        controller = runtime.shards.handles[victim]
        client = KvrayClient.connect(config.name, buffer_pages=8, timeout_s=5.0)
        ray.kill(controller, no_restart=False)
        t0 = time.monotonic()
        try:  # a request during the outage (to the killed shard): a miss, never an error
            requests = (client.keys_for_trace(list(r.hash_ids[:4])) for r in trace)
            keys = next(k for k in requests if runtime.shards.of(k) == victim)
            with client.request(keys) as r:
                r.store()
        finally:
            client.close()
        while True:
            try:
                snap = ray.get(controller.snapshot.remote(), timeout=5)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                assert time.monotonic() - t0 < CONTROLLER_RECOVERY_BOUND_S
                continue
            if snap["rebuild_s"] > 0:  # the new incarnation
                break
            time.sleep(0.1)
        seen["recovery_s"] = time.monotonic() - t0
        seen["rebuild_s"] = snap["rebuild_s"]
        seen["rebuilt"] = indexed_keys(runtime)
        seen["rebuilt_pages"] = snap["rebuilt_pages"]
        seen["nodes"] = snap["nodes"]
        seen["roots"] = roots_by_shard(runtime)

    result, after = replay_with_fault(runtime, trace, kill_at_half)
    acknowledged = seen["indexed"] & seen["held"]
    lost = acknowledged - seen["rebuilt"]
    report(
        "controller killed mid-replay" if shards == 1 else f"controller shard killed mid-replay ({shards} shards)",
        requests=result.requests + 1,
        wrong_pages=result.wrong_pages,
        acknowledged_pages=len(acknowledged),
        lost_pages=len(lost),
        killed_shard_pages=seen["victim_pages"],
        rebuilt_pages=seen["rebuilt_pages"],
        recovery_s=round(seen["recovery_s"], 2),
        rebuild_s=round(seen["rebuild_s"], 3),
        bound_s=CONTROLLER_RECOVERY_BOUND_S,
    )
    assert result.requests == len(trace) and result.wrong_pages == 0
    assert seen["recovery_s"] < CONTROLLER_RECOVERY_BOUND_S
    assert sorted(seen["nodes"]) == nodes  # every store re-joined
    assert len(acknowledged) > 0 and not lost
    assert seen["rebuilt"] <= seen["held"]  # nothing indexed that no store holds
    assert seen["victim_pages"] > 0 and seen["rebuilt_pages"] > 0  # the killed shard rebuilt its own pages
    assert all(shard_of(root, shards) == shard for shard, roots in enumerate(seen["roots"]) for root in roots)
    assert after["hit_pages_by_tier"]  # the rebuilt index served hits in the second half


def test_a_killed_shard_rebuilds_its_own_chains_while_the_other_keeps_serving(ray_cluster):
    """Two shards, 16 chains under distinct roots (tenant salts), so both hold pages. One
    shard's process dies: while it restarts, requests it owns are misses and requests the
    other owns still hit; once back, it indexes exactly the chains it held before, each
    under a root it owns, and the other shard's index never changed."""
    config, runtime = start(tiers=TierSizes(host=128), controller_shards=2)
    client = KvrayClient.connect(config.name, buffer_pages=8, timeout_s=5.0)
    pattern = PagePattern(client.page_nbytes)
    chains = [client.keys_for_trace([1, 2, 3, 4], salt=f"tenant-{t}") for t in range(16)]

    def index_of(shard) -> set[int]:
        return set(ray.get(shard.__ray_call__.remote(lambda self: list(self.index.keys())), timeout=30))

    try:
        client.mapped_reads = False  # every lookup asks its shard
        assert [serve(client, pattern, keys) for keys in chains] == [(0, 0)] * 16
        runtime.shards.snapshot()  # the commits have landed
        victim, survivor = runtime.shards.handles
        before = [index_of(victim), index_of(survivor)]
        owned = [[keys for keys in chains if runtime.shards.of(keys) == s] for s in (0, 1)]
        assert owned[0] and owned[1] and all(before)  # both shards hold chains
        ray.kill(victim, no_restart=False)
        t0 = time.monotonic()
        during = [serve(client, pattern, keys) for keys in owned[1]]  # the survivor serves while the victim restarts
        assert during == [(4, 0)] * len(owned[1])
        while True:
            try:
                snap = ray.get(victim.snapshot.remote(), timeout=5)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                snap = {"rebuild_s": 0}
            if snap["rebuild_s"] > 0:
                break
            assert time.monotonic() - t0 < CONTROLLER_RECOVERY_BOUND_S, "the shard did not come back"
            time.sleep(0.1)
        recovery_s = time.monotonic() - t0
        after = [index_of(victim), index_of(survivor)]
        roots = roots_by_shard(runtime)
        served_after = [serve(client, pattern, keys) for keys in chains]
    finally:
        client.close()
        runtime.close()
    report(
        "one of 2 controller shards killed",
        requests=16 + len(during) + 16,
        wrong_pages=sum(w for _, w in served_after),
        pages_on_killed_shard=len(before[0]),
        pages_rebuilt=len(after[0]),
        survivor_hits_during_outage=sum(h for h, _ in during),
        recovery_s=round(recovery_s, 2),
    )
    assert after == before  # the victim rebuilt exactly its chains; the survivor lost nothing
    assert all(shard_of(root, 2) == shard for shard, rs in enumerate(roots) for root in rs)
    assert served_after == [(4, 0)] * 16


@SHARDS
def test_a_store_actor_killed_mid_replay_costs_misses_never_wrong_kv(ray_cluster, shards):
    """One node's store process dies halfway (the node stays); Ray restarts it empty (no disk
    tier), every controller shard forgets its pages, the replay completes without wrong KV."""
    _, runtime = start(tiers=TierSizes(host=300), controller_shards=shards)
    trace = read_trace(TRACE)[1000:1040]
    victim = next(iter(runtime.stores))
    seen: dict = {}

    def kill_at_half(i: int) -> None:
        if i == len(trace) // 2:
            time.sleep(0.5)
            seen["before"] = runtime.shards.pages_by_node()[victim]
            ray.kill(runtime.stores[victim], no_restart=False)
            seen["t0"] = time.monotonic()

    def inspect() -> tuple:
        restarted_info(runtime.stores[victim])  # polling a store that is still restarting fails: retried
        recovery_s = time.monotonic() - seen["t0"]
        on_victim = {
            key
            for shard in runtime.shards.handles
            for key in ray.get(
                shard.__ray_call__.remote(lambda self: [self.index.key_of(h) for h in self._on_node(victim).tolist()])
            )
        }
        victim_holds = {key for key, _ in ray.get(runtime.stores[victim].holdings.remote())["pages"]}
        return recovery_s, runtime.shards.snapshot(), on_victim, victim_holds

    result, (recovery_s, after, on_victim, victim_holds) = replay_with_fault(runtime, trace, kill_at_half, inspect)
    report(
        "store actor killed mid-replay",
        requests=result.requests,
        wrong_pages=result.wrong_pages,
        pages_on_killed_store=seen["before"],
        pages_forgotten=after["lost_pages"],
        recovery_s=round(recovery_s, 2),
    )
    assert result.requests == len(trace) and result.wrong_pages == 0
    assert seen["before"] > 0
    assert on_victim <= victim_holds  # the pages it lost were forgotten; only new ones are indexed
    assert after["lost_pages"] > 0
    assert victim in after["nodes"]


@ray.remote(num_cpus=0, scheduling_strategy="SPREAD")
def client_process(runtime_name: str, worker: int, requests: int) -> dict:
    """One engine-like client: overlapping conversation prefixes, every loaded page checked."""
    client = KvrayClient.connect(runtime_name, buffer_pages=8, timeout_s=60.0)
    pattern = PagePattern(client.page_nbytes)
    rng = random.Random(worker)
    seen = {
        "requests": 0,
        "lookup_pages": 0,
        "hit_pages": 0,
        "wrong_pages": 0,
        "remote_pages": 0,
        "bytes_between_nodes": 0,
        "stored_pages": 0,
    }
    try:
        for _ in range(requests):
            conversation, depth = rng.randrange(6), rng.randint(1, 8)
            keys = client.keys_for_trace([conversation * 100 + j for j in range(depth)])
            served = serve_checked(client, pattern, keys)
            seen["wrong_pages"] += served.wrong
            seen["stored_pages"] += served.stored
            seen["requests"] += 1
            seen["lookup_pages"] += len(keys)
            seen["hit_pages"] += served.hit
            seen["remote_pages"] += sum(n for path, n in served.loaded.paths.items() if path not in ("local", "mapped"))
            seen["bytes_between_nodes"] += served.loaded.bytes_between_nodes
    finally:
        client.close()
    return seen


@SHARDS
def test_eight_client_processes_on_overlapping_prefixes(ray_cluster, shards):
    """8 processes x 25 requests: no deadlock (bounded wait), no torn or wrong page, and the
    controller's (all shards') and stores' counters agree with what the clients saw."""
    config, runtime = start(tiers=TierSizes(host=64), local_pages_limit=4, controller_shards=shards)  # longer requests spread
    clients, requests = 8, 25
    try:
        t0 = time.monotonic()
        seen = ray.get([client_process.remote(config.name, w, requests) for w in range(clients)], timeout=240)
        elapsed = time.monotonic() - t0
        deadline = time.monotonic() + 30
        # Leases end, and reports of requests answered from a node's own host tier (no
        # lookup_pin) arrive through that node's store, both without anyone waiting.
        while (snap := runtime.shards.snapshot())["open_leases"] or (
            snap["lookups"] + snap["local_lookups"] < clients * requests
        ):
            assert time.monotonic() < deadline, "releases never arrived"
            time.sleep(0.1)
        stats = runtime.store_stats()
    finally:
        runtime.close()
    total = {k: sum(s[k] for s in seen) for k in seen[0]}
    report(
        f"8 concurrent client processes ({shards} controller shard{'s' * (shards > 1)})",
        requests=total["requests"],
        wrong_pages=total["wrong_pages"],
        hit_pages=total["hit_pages"],
        lookup_pages=total["lookup_pages"],
        seconds=round(elapsed, 1),
    )
    assert total["requests"] == clients * requests and total["wrong_pages"] == 0
    assert total["hit_pages"] > 0 and total["remote_pages"] > 0  # real sharing, across nodes too
    assert snap["lookups"] + snap["local_lookups"] == total["requests"]
    assert snap["lookup_pages"] == total["lookup_pages"]
    assert sum(snap["hit_pages_by_tier"].values()) == total["hit_pages"]
    assert snap["bytes_between_nodes"] == total["bytes_between_nodes"]
    assert shards == 1 or all(s["lookups"] + s["indexed_pages"] > 0 for s in snap["shards"])  # every shard served
    assert sum(s["sent_bytes"] for s in stats.values()) == total["remote_pages"] * runtime.config.layout.page_nbytes


@SHARDS
def test_a_tenant_never_hits_another_tenants_pages_through_the_client(ray_cluster, shards):
    config, runtime = start(tiers=TierSizes(host=32), controller_shards=shards)
    client = KvrayClient.connect(config.name, buffer_pages=8)
    ids = [7, 8, 9, 10]
    try:
        keys_a = client.keys_for_trace(ids, salt="tenant-a")
        expected = np.random.default_rng(3).integers(0, 256, (4, client.page_nbytes), dtype=np.uint8)
        with client.request(keys_a) as r:
            r.rows[:] = expected
            r.store()
        assert r.stored == 4

        for salt, hits in (("tenant-b", 0), ("", 0), ("tenant-a", 4)):
            keys = client.keys_for_trace(ids, salt=salt)
            client.buffer.pages[:] = 0
            with client.request(keys) as r:
                assert r.plan.hit_pages == r.hit == hits, salt
                assert np.array_equal(r.rows[:hits], expected[:hits])  # tenant A's own pages, intact
    finally:
        client.close()
        runtime.close()


@ray.remote(num_cpus=0)
class StoringEngine:
    """An engine that stores one request through its node's store, so the store maps its
    landing buffer, then is killed."""

    def __init__(self, runtime_name: str) -> None:
        self.client = KvrayClient.connect(runtime_name, buffer_pages=4)

    def store_one(self) -> tuple[str, str, int]:
        import os

        keys = self.client.keys_for_trace([9100, 9101])
        with self.client.request(keys) as r:
            r.store()
        assert r.stored == 2 - r.hit
        return self.client.node_id, self.client.buffer.name, os.getpid()


def test_a_killed_engines_landing_buffer_is_unmapped_and_unlinked_by_its_store(ray_cluster):
    """SIGKILL gives an engine no chance to unlink its shared-memory buffer; the store that
    mapped it notices the engine is gone and frees the memory."""
    import os
    from pathlib import Path

    config, runtime = start(tiers=TierSizes(host=16))
    try:
        engine = StoringEngine.remote(config.name)
        node, buffer, pid = ray.get(engine.store_one.remote())
        store = runtime.stores[node]
        mapped_before = ray.get(store.stats.remote())["landing_buffers"]
        assert mapped_before >= 1
        ray.kill(engine)
        deadline = time.monotonic() + 30
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline, "the engine process outlived ray.kill"
            time.sleep(0.1)
        assert ray.get(store.stats.remote())["landing_buffers"] == mapped_before - 1
        assert not Path("/dev/shm", buffer).exists()
    finally:
        runtime.close()
