"""The Ray runtime on three real local nodes: stores, controller, client, transfer paths.

Every test here uses the session's shared 3-node cluster (``ray_cluster``) and starts its
own kvray runtime (a controller and one store actor per node) under a unique name.
"""

from __future__ import annotations

import dataclasses
import itertools
import secrets
import time

import numpy as np
import pytest
import ray

from kvray.cluster import KvrayClient, Runtime, RuntimeConfig
from kvray.cluster.protocol import Plan
from kvray.cluster.transfer import PeerLinks
from kvray.cluster.wire import TOKEN_BYTES
from kvray.core.config import PageLayout, TierSizes

pytestmark = pytest.mark.ray

LAYOUT = PageLayout(layers=2, kv_heads=2, head_dim=16, page_tokens=512, dtype="float16")  # 128 KiB pages
_names = itertools.count()


def start(**overrides) -> tuple[Runtime, KvrayClient]:
    config = RuntimeConfig(name=f"t{next(_names)}", layout=LAYOUT, **overrides)
    runtime = Runtime.start(config)
    return runtime, KvrayClient.connect(config.name, buffer_pages=64)


@pytest.fixture(scope="module")
def shared(ray_cluster):
    """One runtime for the tests that only read and write distinct keys (starting store
    actors costs seconds: each is a new process, importing torch for the collective group
    that the collective-path tests use)."""
    runtime, client = start(tiers=TierSizes(host=256), local_pages_limit=4, collective=True, collective_min_bytes=1 << 20)
    yield runtime, client
    client.close()
    runtime.close()


@pytest.fixture
def with_paths(shared):
    """The shared client with given transfer-path settings (a client-side choice)."""
    runtime, client = shared
    original = client.config

    def set_paths(**update) -> tuple[Runtime, KvrayClient]:
        client.config = original.model_copy(update=update)
        return runtime, client

    yield set_paths
    client.config = original


def fill(rows: np.ndarray, seed: int) -> np.ndarray:
    """Random pages into ``rows``; returns them."""
    data = np.random.default_rng(seed).integers(0, 256, rows.shape, dtype=np.uint8)
    rows[:] = data
    return data


def roundtrip(client: KvrayClient, keys: list[int], expected: np.ndarray):
    client.buffer.pages[:] = 0
    with client.request(keys) as r:
        assert np.array_equal(r.rows[: r.hit], expected[: r.hit])
    return r.plan, r.loaded


def test_a_store_actor_runs_on_every_node_with_node_affinity(shared):
    runtime, client = shared
    nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert set(runtime.stores) == nodes and len(nodes) == 3
    assert ray.get([s.ping.remote() for s in runtime.stores.values()]) == list(runtime.stores)


def test_pages_spread_by_hash_ring_come_back_exact_from_every_node(with_paths):
    runtime, client = with_paths()  # defaults: other nodes' pages come by direct TCP
    before = ray.get(runtime.controller.snapshot.remote())
    keys = client.keys_for_trace(list(range(40)))
    with client.request(keys) as r:
        assert r.hit == 0 and len(set(r.plan.targets)) == 3  # 40 pages > 4: spread over all nodes
        expected = fill(r.rows, seed=1)
        r.store()
    assert r.stored == 40

    placed = r.plan.targets
    plan, loaded = roundtrip(client, keys, expected)
    assert loaded.pages == 40 and plan.hit_nodes == placed
    assert loaded.by_tier["host"] + loaded.by_tier["remote"] == 40 and loaded.by_tier["remote"] > 0
    assert loaded.paths.keys() == {"mapped", "tcp"}  # this node's pages copied from its mapped host tier
    after = ray.get(runtime.controller.snapshot.remote())
    assert after["indexed_pages"] - before["indexed_pages"] == 40 and after["open_leases"] == 0
    for tier, pages in loaded.by_tier.items():
        assert after["hit_pages_by_tier"][tier] - before["hit_pages_by_tier"].get(tier, 0) == pages


def test_small_request_stays_on_the_engines_node(shared):
    runtime, client = shared
    keys = client.keys_for_trace([700, 701, 702])
    with client.request(keys) as r:
        assert r.plan.targets == [client.node_id] * 3


def roundtrip_from_another_node(runtime: Runtime, client: KvrayClient, tokens: range, seed: int):
    """Store pages of ``tokens`` on a node other than the client's, then load them back."""
    other = next(n for n in runtime.stores if n != client.node_id)
    keys = client.keys_for_trace(list(tokens))
    expected = fill(client.buffer.pages[: len(keys)], seed=seed)
    client.store(keys, 0, Plan.placing([other] * len(keys)))
    ray.get(runtime.controller.snapshot.remote())  # the commit (fire and forget) has landed
    return roundtrip(client, keys, expected)


def test_a_load_cut_short_by_an_error_leaves_no_answer_for_the_next_request(with_paths, monkeypatch):
    """A load that raises after sending its runs to two peers' page servers (here: reading the
    first run fails with an error no transfer path catches, as a Ray object lost with its node
    would) abandons them: the links are dropped and the landing buffer replaced, so the next
    request to the same peers reads exactly its own pages, not the answers left unread."""
    runtime, client = with_paths()  # peers' pages by TCP
    peers = [n for n in runtime.stores if n != client.node_id]
    first, second = (client.keys_for_trace([base + i for i in range(4)]) for base in (9300, 9400))
    expected = {}
    for keys, seed in ((first, 61), (second, 62)):
        expected[keys[0]] = fill(client.buffer.pages[:4], seed)
        client.store(keys, 0, Plan.placing([peers[0], peers[0], peers[1], peers[1]]))
    ray.get(runtime.controller.snapshot.remote())  # the commits (fire and forget) have landed
    renewed = client.renewed_buffers

    def lost(*args):
        raise RuntimeError("an object lost with its node")

    monkeypatch.setattr(client, "_finish_run", lost)
    with pytest.raises(RuntimeError, match="lost with its node"), client.request(first):
        pytest.fail("entering the request loads its pages, which raises")
    monkeypatch.undo()
    assert client.renewed_buffers == renewed + 1
    client.buffer.pages[:] = 0
    with client.request(second) as r:
        assert r.hit == 4 and r.loaded.paths.keys() == {"tcp"}
        assert np.array_equal(r.rows[:4], expected[second[0]])


def test_collective_path_moves_a_large_run_exactly(with_paths):
    runtime, client = with_paths(tcp=False, collective_min_bytes=1 << 20)
    _, loaded = roundtrip_from_another_node(runtime, client, range(100, 148), seed=2)
    assert loaded.pages == 48 and loaded.paths == {"collective": 48}
    assert loaded.bytes_between_nodes == 48 * client.page_nbytes


def test_object_store_path_below_the_collective_threshold(with_paths):
    runtime, client = with_paths(tcp=False, collective_min_bytes=64 << 20)
    _, loaded = roundtrip_from_another_node(runtime, client, range(200, 210), seed=3)
    assert loaded.paths == {"object_store": 10}


def test_by_default_no_collective_group_so_a_tcp_off_client_uses_the_object_store(ray_cluster):
    """The group would load torch in every store for a path no TCP client takes; a client
    that turns TCP off still gets its large runs, exactly, by the object store."""
    runtime, client = start(tiers=TierSizes(host=64))
    try:
        assert ray.get(runtime.controller.members.remote())["ranks"] == {}
        client.config = client.config.model_copy(update={"tcp": False, "collective_min_bytes": 0})
        _, loaded = roundtrip_from_another_node(runtime, client, range(800, 816), seed=8)
        assert loaded.pages == 16 and loaded.paths == {"object_store": 16}
    finally:
        client.close()
        runtime.close()


def test_evicted_pages_leave_the_index_and_a_stale_location_is_a_miss(ray_cluster):
    runtime, client = start(tiers=TierSizes(host=6), collective=False)
    try:
        _evictions_and_stale_locations(runtime, client)
    finally:
        client.close()
        runtime.close()


def _evictions_and_stale_locations(runtime: Runtime, client: KvrayClient) -> None:
    first = client.keys_for_trace(list(range(300, 306)))
    second = client.keys_for_trace(list(range(400, 406)))
    for keys, seed in ((first, 4), (second, 5)):
        with client.request(keys) as r:
            fill(r.rows, seed)
            r.store()  # the second request evicts the first from the node's host tier
    ray.get(runtime.controller.snapshot.remote())
    with client.request(first) as r:
        assert r.plan.hit_pages == 0  # the store reported the evictions with its write

    # A location the controller believes but the store no longer has: a miss, reported, dropped.
    third = client.keys_for_trace(list(range(500, 506)))
    plan = client.lookup(third)
    stale = Plan(plan.lease, [client.node_id] * 6, [])
    loaded = client.load(third, stale)
    assert loaded.pages == 0 and loaded.lost == {client.node_id: third}
    client.release(plan, loaded)


def test_one_controller_call_answers_a_whole_request(shared):
    runtime, client = shared
    before = ray.get(runtime.controller.snapshot.remote())["lookups"]
    keys = client.keys_for_trace(list(range(600, 664)))
    with client.request(keys) as r:
        assert len(r.plan.targets) == 64 and r.hit == 0  # placement for all 64 pages at once
    assert ray.get(runtime.controller.snapshot.remote())["lookups"] == before + 1


def test_page_servers_serve_only_this_runtimes_token_holders(shared):
    runtime, client = shared
    other = next(n for n in runtime.stores if n != client.node_id)
    keys = client.keys_for_trace(list(range(600, 603)))
    expected = fill(client.buffer.pages[:3], seed=6)
    client.store(keys, 0, Plan.placing([other] * 3))
    ray.get(runtime.controller.snapshot.remote())
    rows = np.zeros((3, client.page_nbytes), dtype=np.uint8)
    assert client.links.load(client.servers[other], keys).receive(rows) == 3
    assert np.array_equal(rows, expected)

    stranger = PeerLinks(secrets.token_bytes(TOKEN_BYTES), client.page_nbytes, timeout_s=10)
    rows[:] = 0
    assert stranger.load(client.servers[other], keys).receive(rows) == 0
    assert not rows.any()
    stranger.close()
    deadline = time.monotonic() + 10  # the store counts the stranger once its connection closes
    while ray.get(runtime.stores[other].stats.remote())["tcp_rejected"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)


@pytest.mark.parametrize("tcp", [True, False])  # to the peers' page servers, or through Ray's object store
def test_replicate_copies_a_hit_to_every_node_named_and_the_copies_read_back_exact(with_paths, tcp):
    runtime, client = with_paths(tcp=tcp)
    keys = client.keys_for_trace([9100 + 10 * tcp + i for i in range(3)])  # three pages: they stay on this node
    with client.request(keys) as r:
        expected = fill(r.rows, 41 + tcp)
        r.store()
    client.settle()
    with client.request(keys) as r:
        assert r.hit == len(keys)
    assert set(r.plan.hit_nodes) == {client.node_id}
    others = [node for node in runtime.stores if node != client.node_id]
    controller = runtime.shards.for_keys(keys)
    before = ray.get(controller.snapshot.remote(), timeout=60)["replica_locations"]
    # a buffer replaced since the load (a call given up on may have written it) is never copied from
    assert client.replicate(keys, r.plan, dataclasses.replace(r.loaded, buffer="replaced"), others) == {}
    assert client.replicate(keys, r.plan, r.loaded, others) == {node: len(keys) for node in others}
    client.settle()
    for node in others:
        assert np.array_equal(ray.get(runtime.stores[node].get_pages.remote(keys), timeout=60), expected)
    assert ray.get(controller.snapshot.remote(), timeout=60)["replica_locations"] == before + len(others) * len(keys)
    assert client.replicate(keys, r.plan, r.loaded, [client.node_id]) == {}  # this node holds them all: nothing to copy
