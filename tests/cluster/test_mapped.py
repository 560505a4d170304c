"""Same-node loads without a Ray call: the client maps its node store's host tier and
slot directory, answers a fully local request itself and copies the pages out."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
import ray

from kvray.cluster import KvrayClient, Runtime, RuntimeConfig
from kvray.cluster.checked import PagePattern
from kvray.cluster.protocol import LOCAL_LEASE, Plan
from kvray.core.config import PageLayout, TierSizes
from kvray.core.tiers.directory import SHM_DIR, directory_name
from tests.cluster.test_faults import restarted_info

pytestmark = pytest.mark.ray

LAYOUT = PageLayout(layers=2, kv_heads=2, head_dim=16, page_tokens=512, dtype="float16")  # 128 KiB pages
_names = itertools.count()


def _runtime(ray_cluster):
    """A runtime whose host tier holds 8 pages per node, and a client on the head node."""
    config = RuntimeConfig(
        name=f"m{next(_names)}", layout=LAYOUT, tiers=TierSizes(host=8), collective=False, checksum_memory=True
    )
    runtime = Runtime.start(config)
    client = KvrayClient.connect(config.name, buffer_pages=16)
    yield runtime, client
    client.close()
    runtime.close()


# Starting store actors costs seconds (each a new process): the tests that
# leave the stores running share one runtime; every test fills the 8 slots it relies on itself.
local = pytest.fixture(scope="module")(_runtime)
own_runtime = pytest.fixture(_runtime)


def put_local(client: KvrayClient, keys: list[int], seed: int) -> np.ndarray:
    """Store ``keys`` on the client's node; returns the pages."""
    pages = np.random.default_rng(seed).integers(0, 256, (len(keys), client.page_nbytes), dtype=np.uint8)
    client.buffer.pages[: len(keys)] = pages
    client.store(keys, 0, Plan.placing([client.node_id] * len(keys)))
    return pages


def controller(runtime: Runtime) -> dict:
    return ray.get(runtime.controller.snapshot.remote())  # also: earlier fire-and-forget calls have landed


def eventually(condition, timeout_s: float = 30.0) -> None:
    """Wait for the effect of fire-and-forget calls (the store forwards a local plan's report)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the reported hits never arrived"
        time.sleep(0.05)


def load(client: KvrayClient, keys: list[int]):
    """One request for ``keys``: its plan, its load's record, and a copy of the rows it loaded."""
    client.buffer.pages[:] = 0
    with client.request(keys) as r:
        rows = r.rows[: r.hit].copy()
    return r.plan, r.loaded, rows


def test_a_fully_local_hit_makes_no_controller_call_and_is_exact(local):
    runtime, client = local
    store = runtime.stores[client.node_id]
    keys = client.keys_for_trace(list(range(10, 16)))
    pages = put_local(client, keys, seed=1)
    old = client.keys_for_trace([900, 901])
    put_local(client, old, seed=2)  # the 8 host slots now hold ``keys``, then ``old``: LRU order
    before, store_before = controller(runtime), ray.get(store.stats.remote())

    plan, loaded, rows = load(client, keys)
    assert plan.lease == LOCAL_LEASE and plan.hit_nodes == [client.node_id] * 6 and plan.targets == []
    assert loaded.pages == 6 and loaded.paths == {"mapped": 6} and loaded.by_tier == {"host": 6}
    assert np.array_equal(rows, pages)
    store_hits = store_before["hit_pages_by_tier"].get("host", 0)
    eventually(lambda: ray.get(store.stats.remote())["hit_pages_by_tier"].get("host", 0) == store_hits + 6)
    eventually(lambda: controller(runtime)["local_lookups"] == before["local_lookups"] + 1)
    after = controller(runtime)
    assert after["lookups"] == before["lookups"]  # no lookup_pin
    assert after["lookup_pages"] == before["lookup_pages"] + 6
    assert after["hit_pages_by_tier"]["host"] == before["hit_pages_by_tier"].get("host", 0) + 6

    # The touch reached the store's LRU: ``keys`` are now the most recent, so new pages evict ``old``.
    put_local(client, client.keys_for_trace([950]), seed=3)
    held = set(ray.get(store.info.remote())["keys"])
    assert set(keys) <= held and not set(old) <= held


def test_a_partly_local_request_asks_the_controller_and_copies_its_local_run(local):
    runtime, client = local
    keys = client.keys_for_trace(list(range(20, 24)))
    pages = put_local(client, keys, seed=4)
    wanted = keys + client.keys_for_trace([2400])  # one page nobody holds
    before = controller(runtime)["lookups"]
    plan, loaded, rows = load(client, wanted)
    assert plan.lease != LOCAL_LEASE and controller(runtime)["lookups"] == before + 1
    assert loaded.pages == 4 and loaded.paths == {"mapped": 4}
    assert np.array_equal(rows, pages)


def test_a_request_that_stores_here_reports_its_mapped_hits_with_the_write_and_its_release_with_the_commit(local):
    """No ``touch`` and no separate ``release``: the write carries the mapped hits (counted
    before the new pages, so the store's LRU sees them as the simulator does) and the commit
    the controller's release (the lease ends, the hits are counted once)."""
    runtime, client = local
    store = runtime.stores[client.node_id]
    pattern = PagePattern(client.page_nbytes)
    cached = client.keys_for_trace(list(range(60, 63)))
    put_local(client, cached, seed=9)
    old = client.keys_for_trace([960, 961])
    put_local(client, old, seed=10)  # LRU order: ``cached``, then ``old``
    before, store_before = controller(runtime), ray.get(store.stats.remote())
    keys = cached + client.keys_for_trace(list(range(60, 62)), salt="new")
    with client.request(keys) as r:
        assert r.plan.lease not in (LOCAL_LEASE, 0) and r.loaded.paths == {"mapped": 3}
        pattern.fill_rows(keys[3:], r.rows[3:])
        r.store()
    assert r.stored == 2
    client.settle()
    after, store_after = controller(runtime), ray.get(store.stats.remote())
    assert store_after["hit_pages_by_tier"].get("host", 0) == store_before["hit_pages_by_tier"].get("host", 0) + 3
    assert after["open_leases"] == 0 and after["lookups"] == before["lookups"] + 1
    assert after["hit_pages_by_tier"]["host"] == before["hit_pages_by_tier"].get("host", 0) + 3
    # The hits reached the store's LRU: ``old`` is now the least recent, and goes first.
    put_local(client, client.keys_for_trace([970, 971, 972]), seed=11)
    held = set(ray.get(store.info.remote())["keys"])
    assert set(keys) <= held and not set(old) & held


def test_eviction_between_lookup_and_load_is_a_miss_not_wrong_kv(local):
    runtime, client = local
    keys = client.keys_for_trace(list(range(30, 34)))
    put_local(client, keys, seed=5)
    plan = client.lookup(keys)
    assert plan.lease == LOCAL_LEASE
    # Eight newer pages fill the 8-slot host tier: ``keys`` are evicted (no disk tier), and
    # slots they used now hold other pages.
    put_local(client, client.keys_for_trace(list(range(3000, 3008))), seed=6)
    client.buffer.pages[:] = 0
    loaded = client.load(keys, plan)
    client.release(plan, loaded)
    assert loaded.pages == 0 and loaded.lost == {client.node_id: keys}
    assert client.lookup(keys).hit_pages == 0  # the controller forgot them too


def test_the_actor_path_still_serves_when_mapped_reads_are_off(local):
    runtime, client = local
    keys = client.keys_for_trace(list(range(40, 43)))
    pages = put_local(client, keys, seed=7)
    client.mapped_reads = False
    try:
        plan, loaded, rows = load(client, keys)
    finally:
        client.mapped_reads = True
    assert plan.lease != LOCAL_LEASE and loaded.paths == {"local": 3}
    assert np.array_equal(rows, pages)


def test_a_restarted_store_is_remapped_and_never_yields_wrong_kv(own_runtime):
    runtime, client = own_runtime
    store = runtime.stores[client.node_id]
    keys = client.keys_for_trace(list(range(50, 54)))
    pages = put_local(client, keys, seed=8)
    assert load(client, keys)[1].paths == {"mapped": 4}
    first = ray.get(store.host_tier.remote())["name"]

    ray.kill(store, no_restart=False)
    restarted_info(store)
    second = ray.get(store.host_tier.remote())["name"]
    assert second != first  # a fresh segment per incarnation; the killed one's are gone
    assert not (SHM_DIR / first).exists() and not (SHM_DIR / directory_name(first)).exists()
    deadline = time.monotonic() + 30
    while client._host is None or client._host.name != second:  # noticed through the touch reply
        _, loaded, rows = load(client, keys)
        assert np.array_equal(rows, pages[: loaded.pages])
        assert time.monotonic() < deadline, "the client never mapped the new store's host tier"

    fresh = client.keys_for_trace(list(range(60, 63)))
    fresh_pages = put_local(client, fresh, seed=9)
    plan, loaded, rows = load(client, fresh)
    assert plan.lease == LOCAL_LEASE and loaded.paths == {"mapped": 3}
    assert np.array_equal(rows, fresh_pages)


def test_a_run_half_on_host_half_on_disk_is_copied_then_read_through_the_store(ray_cluster, tmp_path):
    config = RuntimeConfig(
        name=f"m{next(_names)}", layout=LAYOUT, tiers=TierSizes(host=4, disk=16), disk_root=tmp_path, collective=False
    )
    runtime = Runtime.start(config)
    client = KvrayClient.connect(config.name, buffer_pages=16)
    try:
        store = runtime.stores[client.node_id]
        keys = client.keys_for_trace(list(range(70, 74)))
        pages = put_local(client, keys, seed=10)
        assert load(client, keys[:2])[1].paths == {"mapped": 2}  # the first two are now the most recent
        eventually(lambda: ray.get(store.stats.remote())["hit_pages_by_tier"].get("host", 0) == 2)
        put_local(client, client.keys_for_trace([7000, 7001]), seed=11)  # demotes keys[2:] to disk

        plan, loaded, rows = load(client, keys)
        assert plan.lease != LOCAL_LEASE  # not all on the host tier: the controller answers
        assert loaded.pages == 4 and loaded.paths == {"mapped": 2, "local": 2}
        assert loaded.by_tier == {"host": 2, "disk": 2}
        assert np.array_equal(rows, pages)
    finally:
        client.close()
        runtime.close()
