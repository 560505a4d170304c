"""Every wait of the runtime is bounded (issue 32, item 5), on real Ray actors.

- ``Runtime.start`` waited without a timeout for its stores to come up: a store Ray cannot
  place (its node's ``store_resources`` taken) hung the start for ever. It now fails
  within ``RuntimeConfig.start_timeout_s``, naming the store and its node, and stops the
  actors it started.
- A store's collective receive (``pull``) waited without a timeout for the peer's send:
  a peer that stops (SIGSTOP here; a hung process, a stuck disk) held the call and the
  client's landing buffer. It now gives up after ``peer_timeout_s``, the client moves to
  a fresh buffer (the late send may still land in the old one), and the next pull from
  that peer goes by the object store, since the pair is out of step.

Each test prints one ``RELIABILITY {...}`` line (run with ``-s``); docs/reliability.md
tabulates them.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group

from kvray.cluster import KvrayClient, Runtime, RuntimeConfig
from kvray.cluster.checked import PagePattern
from kvray.cluster.config import NAMESPACE, controller_name, store_name
from kvray.cluster.protocol import Plan
from kvray.core.config import PageLayout, TierSizes
from kvray.core.errors import ClusterError
from tests.cluster.test_reliability_runtime import report
from tests.cluster.test_transfer import eventually
from tests.conftest import extra_nodes

pytestmark = [pytest.mark.ray, pytest.mark.fault]

LAYOUT = PageLayout(layers=2, kv_heads=2, head_dim=16, page_tokens=512, dtype="float16")
SLOT = "kvray_bounded_wait_slot"  # a resource only the extra node has
START_TIMEOUT_S = 5.0
PEER_TIMEOUT_S = 3.0
SLACK_S = 30.0  # Ray calls and process starts on a loaded 2-core machine


def name_free(name: str) -> bool:
    try:
        ray.get_actor(controller_name(name), namespace=NAMESPACE)
    except ValueError:
        return True
    return False


def test_a_store_that_cannot_be_placed_fails_the_start_within_its_timeout(ray_cluster):
    """The only node offering the store's resource has it taken (a placement group holds
    it): the start fails after ``start_timeout_s`` with the store and node named, and the
    runtime's name is free again."""
    name = "unplaceable"
    with extra_nodes(ray_cluster, {SLOT: 1}):
        (node,) = (n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get(SLOT))
        taken = placement_group([{SLOT: 1}])
        ray.get(taken.ready(), timeout=60)
        config = RuntimeConfig(
            name=name, layout=LAYOUT, tiers=TierSizes(host=4), store_resources={SLOT: 1}, start_timeout_s=START_TIMEOUT_S
        )
        t0 = time.monotonic()
        try:
            with pytest.raises(ClusterError) as failed:
                Runtime.start(config)
            took = time.monotonic() - t0
        finally:
            remove_placement_group(taken)
        freed = eventually(lambda: name_free(name), timeout_s=SLACK_S)
    message = str(failed.value)
    report("a store Ray cannot place (its node's store_resources taken)", start_failed_after_s=round(took, 2), message=message)
    assert store_name(name, node) in message and node in message
    assert f"start_timeout_s={START_TIMEOUT_S:g}" in message and "RuntimeConfig.start_timeout_s" in message
    assert START_TIMEOUT_S <= took < START_TIMEOUT_S + SLACK_S
    assert freed  # the controller (and the store) were stopped: no half-started runtime holds the name


def test_a_collective_receive_from_a_stopped_peer_gives_up_and_the_next_pull_takes_the_object_store(ray_cluster):
    """Pages stored on a peer; the peer's process is stopped (SIGSTOP) and a load by the
    collective path asks for them: the pull gives up after ``peer_timeout_s``, a miss
    counted as a timeout, on a fresh landing buffer. The peer resumes; the pages, stored
    again (the store already holds them: its answer says so and the client commits them),
    come back bit-exact by the object store."""
    config = RuntimeConfig(
        name="stopped-peer",
        layout=LAYOUT,
        tiers=TierSizes(host=64),
        tcp=False,
        collective=True,
        collective_min_bytes=0,
        peer_timeout_s=PEER_TIMEOUT_S,
    )
    runtime = Runtime.start(config)
    client = KvrayClient.connect(config.name, buffer_pages=16, timeout_s=PEER_TIMEOUT_S + SLACK_S)
    try:
        peer = next(n for n in runtime.stores if n != client.node_id)
        pattern = PagePattern(client.page_nbytes)
        keys = client.keys_for_trace(list(range(9000, 9008)))
        pattern.fill_rows(keys, client.buffer.pages[: len(keys)])
        assert client.store(keys, 0, Plan.placing([peer] * len(keys))) == len(keys)
        assert client.path_for(peer, len(keys) * client.page_nbytes) == "collective"

        pid = ray.get(runtime.stores[peer].__ray_call__.remote(lambda store: os.getpid()), timeout=SLACK_S)
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with client.request(keys) as r:
                stalled_hit = r.hit
            took = time.monotonic() - t0
        finally:
            os.kill(pid, signal.SIGCONT)
        assert r.plan.hit_nodes == [peer] * len(keys)  # the index promised them: the wait was the pull's
        assert stalled_hit == 0 and client.faults["timeout"] == 1 and client.renewed_buffers == 1
        assert PEER_TIMEOUT_S <= took < PEER_TIMEOUT_S + SLACK_S

        # The miss reported the pages lost, so the controller forgot them; the store still holds them.
        pattern.fill_rows(keys, client.buffer.pages[: len(keys)])
        assert client.store(keys, 0, Plan.placing([peer] * len(keys))) == 0  # nothing new to store, all 8 held
        client.buffer.pages[:] = 0
        with client.request(keys) as r:
            wrong = pattern.wrong(keys[: r.hit], r.rows)
        assert r.hit == len(keys) and wrong == 0
        assert client.faults["timeout"] == 1
        report(
            "a peer store stopped (SIGSTOP) during a collective pull",
            pull_gave_up_after_s=round(took, 2),
            stalled_hit=stalled_hit,
            renewed_buffers=client.renewed_buffers,
            next_hit=r.hit,
            wrong=wrong,
        )
    finally:
        client.close()
        runtime.close()
