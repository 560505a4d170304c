"""Leases, timeouts and late copies with real processes (issue 13, items 2 and 3).

- A lease a client never released (it died, or its ``lookup`` timed out after the pin
  happened) must not keep a dropped page "doomed" for ever: it ends when the client
  releases it by its id, or when it expires.
- A store call that finishes after the client gave up on it must not touch the buffer the
  client reuses: the client moves to a fresh landing buffer, so the late copy writes
  memory no request reads (0 wrong KV). The delay is injected with the store's test hook
  ``inject_faults``.
- A store call that raises (a full or failing disk) is a miss, not a failed request.

Each test prints one ``RELIABILITY {...}`` line (run with ``-s``); docs/reliability.md
tabulates them. The lease tests run with 1 and 2 controller shards: a lease lives on the
shard owning its request's chain, and its release must reach that shard.
"""

from __future__ import annotations

import itertools
import time

import pytest
import ray

from kvray.cluster import KvrayClient, Runtime, RuntimeConfig
from kvray.cluster.checked import PagePattern
from kvray.cluster.protocol import new_lease
from kvray.core.config import PageLayout, TierSizes
from tests.cluster.test_faults import SHARDS
from tests.cluster.test_reliability_runtime import report, serve

pytestmark = [pytest.mark.ray, pytest.mark.fault]

LAYOUT = PageLayout(layers=2, kv_heads=2, head_dim=16, page_tokens=512, dtype="float16")
_names = itertools.count()
TIMEOUT_S = 3.0  # the client's; calls on a loaded 2-core machine stay well below it
STALL_S = 6.0  # an injected delay: well past TIMEOUT_S


def start(**overrides) -> tuple[Runtime, KvrayClient]:
    config = RuntimeConfig(name=f"l{next(_names)}", layout=LAYOUT, collective=False, **overrides)
    runtime = Runtime.start(config)
    return runtime, KvrayClient.connect(config.name, buffer_pages=8, timeout_s=TIMEOUT_S, mapped_reads=False)


def settle(runtime: Runtime) -> dict:
    """The controller shards' merged snapshot once the calls sent without waiting (release,
    commit) landed: each shard answers after the calls this process sent it before."""
    return runtime.shards.snapshot()


def evict_all_but_root(runtime: Runtime, client: KvrayClient, pattern: PagePattern, keys: list[int]) -> None:
    """Fill the node's 4-page host tier with 3 new pages: the request's 2nd and 3rd pages
    (least recently used) leave, and the store reports them with the write."""
    serve(client, pattern, keys[:1])  # the root is used again, so it stays
    serve(client, pattern, client.keys_for_trace([7000, 7001, 7002]))
    settle(runtime)


@SHARDS
def test_a_leaked_lease_blocks_a_dropped_prefix_only_until_it_expires(ray_cluster, shards):
    """A client pins a 3-page prefix and dies without releasing; two of the pages are then
    evicted. Until the lease expires the prefix serves 1 of 3 pages and cannot be cached
    again (the old code: for ever); once it expires the pages are stored and hit again."""
    ttl = 10.0
    runtime, client = start(tiers=TierSizes(host=4), lease_ttl_s=ttl, controller_shards=shards)
    pattern = PagePattern(client.page_nbytes)
    keys = client.keys_for_trace([6000, 6001, 6002])
    try:
        assert serve(client, pattern, keys) == (0, 0)
        ray.get(runtime.shards.for_keys(keys).lookup_pin.remote(keys, client.node_id, new_lease()))  # never released
        leaked_at = time.monotonic()
        evict_all_but_root(runtime, client, pattern, keys)
        blocked = serve(client, pattern, keys)
        assert blocked == (1, 0) and serve(client, pattern, keys) == (1, 0)  # re-storing does not help yet
        assert settle(runtime)["doomed_pages"] >= 1
        time.sleep(max(ttl - (time.monotonic() - leaked_at), 0) + 0.5)
        hits = [serve(client, pattern, keys) for _ in range(3)]
        snap = settle(runtime)
    finally:
        client.close()
        runtime.close()
    report(
        "leaked lease (client died after lookup_pin) + eviction",
        requests=5 + 3,
        wrong_pages=0,
        hits_while_leaked=blocked[0],
        hits_after_expiry=[h for h, _ in hits],
        lease_ttl_s=ttl,
    )
    assert hits[0] == (1, 0)  # the lease expired: the dropped pages are gone and stored again
    assert hits[1:] == [(3, 0), (3, 0)]
    assert snap["expired_leases"] >= 1 and snap["doomed_pages"] == 0 and snap["open_leases"] == 0


@SHARDS
def test_a_lookup_that_timed_out_after_its_pin_releases_the_lease_by_id(ray_cluster, shards):
    """The controller is busy past the client's timeout, so the lookup is a miss; the pin
    happens later anyway. The client released the lease by its id, so nothing stays pinned
    and a later eviction does not leave the prefix doomed."""
    runtime, client = start(tiers=TierSizes(host=4), lease_ttl_s=600.0, controller_shards=shards)
    pattern = PagePattern(client.page_nbytes)
    keys = client.keys_for_trace([6100, 6101, 6102])
    try:
        assert serve(client, pattern, keys) == (0, 0)
        settle(runtime)
        runtime.shards.for_keys(keys).__ray_call__.remote(lambda self: time.sleep(STALL_S))  # its shard stalls
        plan = client.lookup(keys)  # gives up after TIMEOUT_S; lookup_pin runs after the stall
        assert plan.hit_pages == 0 and client.faults["timeout"] >= 1
        after_timeout = settle(runtime)
        evict_all_but_root(runtime, client, pattern, keys)
        served = [serve(client, pattern, keys) for _ in range(2)]
        snap = settle(runtime)
    finally:
        client.close()
        runtime.close()
    report(
        f"lookup timed out after the pin (controller stalled {STALL_S:g} s, client timeout {TIMEOUT_S:g} s) + eviction",
        requests=5,
        wrong_pages=0,
        open_leases_after_timeout=after_timeout["open_leases"],
        hits=[h for h, _ in served],
    )
    assert after_timeout["open_leases"] == 0  # released by id right after the pin
    assert served == [(1, 0), (3, 0)] and snap["doomed_pages"] == 0


@SHARDS
def test_a_lease_released_by_id_frees_a_doomed_prefix_at_once(ray_cluster, shards):
    runtime, client = start(tiers=TierSizes(host=4), lease_ttl_s=600.0, controller_shards=shards)
    pattern = PagePattern(client.page_nbytes)
    keys = client.keys_for_trace([6200, 6201, 6202])
    try:
        serve(client, pattern, keys)
        lease = new_lease()
        owner = runtime.shards.for_keys(keys)
        ray.get(owner.lookup_pin.remote(keys, client.node_id, lease))
        evict_all_but_root(runtime, client, pattern, keys)
        assert settle(runtime)["doomed_pages"] >= 1  # the two evicted pages wait for the lease
        owner.release.remote(lease, {}, {})
        assert settle(runtime)["doomed_pages"] == 0
        assert [serve(client, pattern, keys) for _ in range(2)] == [(1, 0), (3, 0)]
    finally:
        client.close()
        runtime.close()


@pytest.mark.parametrize("late", ["read_into", "write_from"])
def test_a_store_call_finishing_after_the_clients_timeout_causes_no_wrong_kv(ray_cluster, late):
    """The store's next buffer copy sleeps STALL_S (test hook), past the client's TIMEOUT_S.
    The client counts a miss and goes on with the next request at once; the late copy
    finishes meanwhile. Old code: a late read overwrote the next request's rows, a late
    write stored the next request's bytes under the previous request's keys."""
    runtime, client = start(tiers=TierSizes(host=32))
    pattern = PagePattern(client.page_nbytes)
    first, second = client.keys_for_trace([6300, 6301, 6302]), client.keys_for_trace([6400, 6401, 6402])
    store = runtime.stores[client.node_id]
    wrong = 0
    try:
        if late == "read_into":
            serve(client, pattern, first)
        ray.get(store.inject_faults.remote(delay_s=STALL_S))
        late_done = time.monotonic() + STALL_S
        # read_into: the read times out, a miss, computed instead; write_from: the write
        # times out, nothing is committed.
        assert serve(client, pattern, first) == (0, 0)
        assert client.faults["timeout"] >= 1 and client.renewed_buffers == 1
        # The next request fills its rows while the late copy is still running.
        with client.request(second) as r:
            pattern.fill_rows(second, r.rows)
            time.sleep(max(late_done - time.monotonic(), 0) + 1.0)  # the late copy is done
            wrong += pattern.wrong(second, r.rows)
            r.store()
        assert r.stored == 3
        # What the store holds under the first request's keys is that request's KV (or nothing).
        held = ray.get(store.get_pages.remote(first))
        wrong += sum(not pattern.matches(key, page) for key, page in zip(first, held))
        wrong += sum(serve(client, pattern, keys)[1] for keys in (first, second))
        stats = ray.get(store.stats.remote())
    finally:
        client.close()
        runtime.close()
    report(
        f"store {late} delayed {STALL_S:g} s past the client's {TIMEOUT_S:g} s timeout",
        requests=5,
        wrong_pages=wrong,
        late_copy_pages=len(held),
        renewed_buffers=client.renewed_buffers,
    )
    assert wrong == 0
    assert stats["landing_buffers"] == 1  # the abandoned buffer was unmapped once its late copy returned


@pytest.mark.parametrize("verb", ["load", "store"])
def test_a_store_that_raises_is_a_miss_not_a_failed_request(ray_cluster, verb):
    """A store whose copy raises (``OSError``, as a full or failing disk) answers with a
    RayTaskError: the client counts a miss and serves the request (old code: it raised)."""
    runtime, client = start(tiers=TierSizes(host=32))
    pattern = PagePattern(client.page_nbytes)
    keys = client.keys_for_trace([6500, 6501])
    store = runtime.stores[client.node_id]
    try:
        if verb == "load":
            serve(client, pattern, keys)
        ray.get(store.inject_faults.remote(fail=True))
        assert serve(client, pattern, keys) == (0, 0)
        assert client.faults["store_error"] == 1 and client.renewed_buffers == 0
        if verb == "store":
            assert serve(client, pattern, keys) == (0, 0)  # the failed write was not committed: stored now
        assert serve(client, pattern, keys) == (2, 0)
    finally:
        client.close()
        runtime.close()
