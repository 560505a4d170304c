"""Failures with real processes: a node leaves mid-replay; a store actor restarts.

Tests where the controller's sharding changes what happens (membership changes reach every
shard, a request's calls reach its chain's shard) run with 1 and 2 controller shards routed
by root, and 4 routed past it (``controller_route_depth=1``: the root pages replicated in
every shard a chain is routed to) (:data:`SHARDS_AND_ROUTES`; other files' tests take
:data:`SHARDS`)."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
import ray

from kvray.apps.replay import Replay, ReplaySettings
from kvray.cluster import KvrayClient, Runtime, RuntimeConfig
from kvray.core.config import PageLayout, TierSizes
from kvray.traces import read_trace
from tests.apps.test_replay import TRACE
from tests.conftest import RAY_OBJECT_STORE_BYTES

pytestmark = [pytest.mark.ray, pytest.mark.fault]

LAYOUT = PageLayout(layers=2, kv_heads=2, head_dim=16, page_tokens=512, dtype="float16")
_names = itertools.count()
SHARDS = pytest.mark.parametrize("shards", [1, 2], ids=["1-shard", "2-shards"])  # routed by root
SHARDS_AND_ROUTES = pytest.mark.parametrize(
    ("shards", "route_depth"), [(1, 0), (2, 0), (4, 1)], ids=["1-shard", "2-shards", "4-shards-past-root"]
)


def replay_with_fault(runtime: Runtime, trace, fault, inspect=None) -> tuple:
    """Replay ``trace`` on ``runtime`` with ``fault(i)`` run before request ``i``; returns the
    result and what ``inspect()`` (default: the controller shards' merged snapshot) saw before teardown."""
    try:
        replay = Replay(
            runtime, ReplaySettings(name="fault", nodes=len(runtime.stores), runtime=runtime.config, prefill_us_per_token=1.0)
        )
        try:
            result = replay.run(trace, progress=False, on_request=fault)
            return result, (inspect or runtime.shards.snapshot)()
        finally:
            replay.close()
    finally:  # also when the engines did not start: no runtime outlives its test
        runtime.close()


@SHARDS_AND_ROUTES
def test_a_node_removed_mid_replay_costs_misses_never_wrong_kv(ray_cluster, shards, route_depth):
    """A fourth node joins, takes part, and is removed (raylet, store and engine die)
    halfway through; the replay finishes and the index forgets the node's pages."""
    doomed = ray_cluster.add_node(num_cpus=1, object_store_memory=RAY_OBJECT_STORE_BYTES)
    ray_cluster.wait_for_nodes()
    config = RuntimeConfig(
        name=f"f{next(_names)}",
        layout=LAYOUT,
        tiers=TierSizes(host=300),
        collective=False,
        controller_shards=shards,
        controller_route_depth=route_depth,
    )
    runtime = Runtime.start(config)
    assert doomed.node_id in runtime.stores and len(runtime.stores) == 4
    trace = read_trace(TRACE)[1000:1040]
    before = {}

    def remove_at_half(i: int) -> None:
        if i == len(trace) // 2:
            before.update(runtime.shards.pages_by_node())
            ray_cluster.remove_node(doomed)

    result, after = replay_with_fault(runtime, trace, remove_at_half)
    assert result.requests == len(trace) and result.wrong_pages == 0
    assert result.lost_nodes == [doomed.node_id]
    assert before[doomed.node_id] > 0  # the node held pages when it went
    assert after["pages_by_node"][doomed.node_id] == 0 and doomed.node_id not in after["nodes"]
    assert after["lost_pages"] >= before[doomed.node_id]


def restarted_info(store, timeout_s: float = 120.0) -> dict:
    """The store's ``info`` once its new incarnation answers (``ray.kill`` is asynchronous,
    and calls fail while the actor restarts)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            info = ray.get(store.info.remote(), timeout=timeout_s)
        except ray.exceptions.ActorUnavailableError:
            info = {"restarted": False}
        if info["restarted"]:
            return info
        time.sleep(0.2)
    raise TimeoutError("the store actor did not come back")


@SHARDS_AND_ROUTES
def test_a_restarted_store_recovers_its_disk_tier(ray_cluster, tmp_path, shards, route_depth):
    config = RuntimeConfig(
        controller_shards=shards,
        controller_route_depth=route_depth,
        name=f"f{next(_names)}",
        layout=LAYOUT,
        tiers=TierSizes(host=4, disk=32),
        disk_root=tmp_path,
        collective=False,
        local_pages_limit=12,
    )
    runtime = Runtime.start(config)
    client = KvrayClient.connect(config.name, buffer_pages=16)
    try:
        keys = client.keys_for_trace(list(range(9000, 9012)))
        expected = np.random.default_rng(7).integers(0, 256, (12, client.page_nbytes), dtype=np.uint8)
        with client.request(keys) as r:
            assert r.plan.targets == [client.node_id] * 12
            r.rows[:] = expected
            r.store()  # 12 pages, 4 host slots: the oldest 8 are demoted to disk
        store = runtime.stores[client.node_id]
        assert len(ray.get(store.info.remote())["keys"]) == 12

        ray.kill(store, no_restart=False)  # the process dies; Ray restarts the actor on its node
        info = restarted_info(store)
        assert len(info["keys"]) == 8  # the disk tier came back, the host tier did not

        client.buffer.pages[:] = 0
        with client.request(keys) as r:
            assert r.plan.hit_pages == 8  # the controller dropped the 4 lost host pages
            assert r.hit == 8 and r.loaded.by_tier == {"disk": 8}
            assert np.array_equal(r.rows[:8], expected[:8])
    finally:
        client.close()
        runtime.close()
