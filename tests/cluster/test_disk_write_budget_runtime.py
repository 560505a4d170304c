"""The cluster policy's NVMe write budget on a real runtime: the controller sends the
serving node's budget to its store actor, which writes no more to disk than it pays for;
what it stored reads back exact, the rest is a miss."""

from __future__ import annotations

import time

import numpy as np
import pytest
import ray

from kvray.cluster import KvrayClient, Runtime, RuntimeConfig
from kvray.core.config import PageLayout, TierSizes
from kvray.core.keys import pack_keys
from tests.cluster.budget_policy import BUDGET_PAGES, PAGE_NBYTES

pytestmark = pytest.mark.ray

LAYOUT = PageLayout(layers=2, kv_heads=2, head_dim=8, page_tokens=16, dtype="float16")


def test_a_store_writes_to_disk_only_what_the_policys_budget_pays_for(ray_cluster, tmp_path):
    assert LAYOUT.page_nbytes == PAGE_NBYTES
    config = RuntimeConfig(
        name="diskbudget",
        layout=LAYOUT,
        tiers=TierSizes(disk=64),
        disk_root=tmp_path,
        local_pages_limit=64,  # the chain stays on the requester's node (no host tier sets the limit to 0)
        cluster_policy="tests.cluster.budget_policy:ThreePagesPerSecond",
    )
    runtime = Runtime.start(config)
    client = KvrayClient.connect(config.name)
    try:
        keys = client.keys_for_trace(list(range(12)))
        store = runtime.stores[client.node_id]  # local-first: the pages go to the requester's node
        assert ray.get(store.stats.remote(), timeout=60)["disk_write_budget"] is None  # none until the policy is asked
        controller = runtime.shards.for_keys(keys)
        decision = ray.get(controller.decide.remote(pack_keys(keys), client.node_id), timeout=60)
        assert decision.node == client.node_id
        # sent without waiting: the store has it by its next writes, not necessarily this request's
        deadline = time.monotonic() + 30
        while ray.get(store.stats.remote(), timeout=60)["disk_write_budget"] is None and time.monotonic() < deadline:
            time.sleep(0.05)
        pages = np.random.default_rng(0).integers(0, 256, (len(keys), LAYOUT.page_nbytes), dtype=np.uint8)
        with client.request(keys) as r:
            r.rows[:] = pages
            r.store()
        client.settle()
        budget = ray.get(store.stats.remote(), timeout=60)["disk_write_budget"]
        assert budget["bytes_per_s"] == BUDGET_PAGES * PAGE_NBYTES
        assert set(r.plan.targets) == {client.node_id}
        assert r.stored <= BUDGET_PAGES + 1 and budget["taken_bytes"] == r.stored * PAGE_NBYTES  # + 1: a second passed
        assert budget["refused_pages"] >= 1
        with client.request(keys) as again:
            assert again.hit == r.stored and np.array_equal(again.rows[: again.hit], pages[: again.hit])
    finally:
        client.close()
        runtime.close()
