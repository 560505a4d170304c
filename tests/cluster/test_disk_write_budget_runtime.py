"""The cluster policy's NVMe write budget on a real runtime: the controller sends the
serving node's budget to its store actor, which writes no more to disk than it pays for;
what it stored reads back exact, the rest is a miss. The request decided with a new budget
is the first under it: its executor (the replay's driver) waits for the store to apply it."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
import ray

from kvray.apps.replay import VERBS, Replay
from kvray.cluster import KvrayClient, Runtime, RuntimeConfig
from kvray.cluster.protocol import Decision
from kvray.core.config import PageLayout, TierSizes
from kvray.core.keys import pack_keys
from kvray.traces import TraceRequest
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
        assert decision.node == client.node_id and decision.budget_set is not None
        # the decision carries the store's call that applies the budget: once it is done, the
        # request's own writes go under it (the simulator applies it to the same request)
        ray.get(decision.budget_set, timeout=60)
        assert ray.get(store.stats.remote(), timeout=60)["disk_write_budget"]["bytes_per_s"] == BUDGET_PAGES * PAGE_NBYTES
        again = ray.get(controller.decide.remote(pack_keys(keys), client.node_id), timeout=60)
        assert again.budget_set is None  # unchanged: nothing sent, nothing to wait for
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


@ray.remote
class LateBudget:
    """A controller whose decisions carry a budget the store applies only after ``APPLY_S``."""

    def decide(self, keys: bytes, front: str) -> Decision:
        return Decision(front, budget_set=_apply_late.remote())


APPLY_S = 1.0


@ray.remote
def _apply_late() -> None:
    time.sleep(APPLY_S)


def test_the_replay_sends_a_request_only_once_the_budget_decided_with_it_applies(ray_cluster):
    config = RuntimeConfig(name="late-budget")
    replay = Replay.__new__(Replay)  # its driver's decide step alone, against a controller that applies late
    replay.runtime = SimpleNamespace(shards=SimpleNamespace(handles=[LateBudget.remote()], of=lambda keys: 0))
    replay.settings = SimpleNamespace(cache=True)
    replay.fingerprint, replay.page_tokens, replay.engines = config.fingerprint(), 512, {"node-a": None}
    replay.verbs = dict.fromkeys(VERBS, 0)
    request = TraceRequest(timestamp_ms=0.0, input_length=1024, output_length=1, hash_ids=(1, 2))
    ray.get(replay.runtime.shards.handles[0].__ray_ready__.remote(), timeout=60)  # started: its start is not timed
    t0 = time.monotonic()
    node, verbs = replay._decide(request, "node-a")
    # the request goes to its engine only once the store applied the budget (its call took APPLY_S)
    assert time.monotonic() - t0 >= APPLY_S and node == "node-a" and verbs["replicate"] == ()
    assert replay.verbs["budget_changes"] == 1  # counted in `kvray run --json`'s cluster_verbs
