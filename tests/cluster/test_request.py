"""``with client.request(keys) as r:`` on a real runtime: the loaded rows are the stored
pages, the rows cannot be used after the block, the lease ends even when the block
raises, and what the block asks to store is stored on exit (and only then)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvray.cluster import KvrayClient, Runtime, RuntimeConfig
from kvray.cluster.checked import PagePattern
from kvray.core.config import PageLayout, TierSizes
from kvray.core.errors import RequestError

pytestmark = pytest.mark.ray

LAYOUT = PageLayout(layers=2, kv_heads=2, head_dim=16, page_tokens=512, dtype="float16")  # 128 KiB pages
BUFFER = 8
_salts = itertools.count()


@pytest.fixture(scope="module")
def runtime_and_client(ray_cluster):
    """One runtime; each test uses keys under its own tenant salt. Mapped reads off, so
    every lookup of a cached prefix pins it under a controller lease (what the tests watch)."""
    runtime = Runtime.start(RuntimeConfig(name="request", layout=LAYOUT, tiers=TierSizes(host=64), collective=False))
    client = KvrayClient.connect("request", buffer_pages=BUFFER, mapped_reads=False)
    yield runtime, client
    client.close()
    runtime.close()


def fresh_keys(client: KvrayClient, pages: int) -> list[int]:
    return client.keys_for_trace(list(range(pages)), salt=f"t{next(_salts)}")


def test_the_rows_computed_in_one_request_are_stored_on_exit_and_loaded_by_the_next(runtime_and_client):
    runtime, client = runtime_and_client
    pattern = PagePattern(client.page_nbytes)
    keys = fresh_keys(client, 6)
    with client.request(keys[:4]) as r:
        assert r.hit == 0 and r.rows.shape == (4, client.page_nbytes)
        pattern.fill_rows(keys[:4], r.rows)
        r.store()
        assert r.stored is None  # not before the block ends
    assert r.stored == 4

    client.buffer.pages[:] = 0
    with client.request(keys) as r:  # 4 cached, 2 to compute
        assert r.hit == 4 and r.plan.hit_pages == 4 and r.loaded.by_tier == {"host": 4}
        assert pattern.wrong(keys[:4], r.rows) == 0  # the stored bytes, each in its key's row
        pattern.fill_rows(keys[4:], r.rows[4:])
        r.store()
    assert r.stored == 2

    with client.request(keys) as r:
        assert r.hit == 6 and pattern.wrong(keys, r.rows) == 0
    assert r.stored is None  # nothing asked, nothing stored
    snapshot = runtime.shards.snapshot()
    assert snapshot["open_leases"] == 0


def test_rows_are_unusable_after_the_block(runtime_and_client):
    _, client = runtime_and_client
    keys = fresh_keys(client, 3)
    with client.request(keys) as r:
        kept = r.rows
        kept[:] = 7
    with pytest.raises(RequestError, match="after its `with client.request"):
        r.rows  # noqa: B018 - the read itself is what must fail
    with pytest.raises(RequestError, match="call it inside"):
        r.store()
    with pytest.raises(ValueError, match="read-only"):
        kept[0] = 1  # a view kept past the block cannot write the next request's rows
    assert r.hit == 0 and r.plan.targets  # what the request got stays readable
    del kept


def test_a_block_that_raises_releases_its_lease_and_stores_nothing(runtime_and_client):
    runtime, client = runtime_and_client
    pattern = PagePattern(client.page_nbytes)
    keys = fresh_keys(client, 5)
    with client.request(keys[:3]) as r:
        pattern.fill_rows(keys[:3], r.rows)
        r.store()
    before = runtime.shards.snapshot()

    with pytest.raises(ZeroDivisionError), client.request(keys) as r:
        assert r.hit == 3 and r.plan.lease > 0  # pinned at the controller
        pattern.fill_rows(keys[3:], r.rows[3:])
        r.store()
        _ = 1 / 0  # the engine failed mid-request
    assert r.stored is None

    after = runtime.shards.snapshot()  # after the release sent on exit: this process's calls arrive in order
    assert after["open_leases"] == 0 and before["open_leases"] == 0
    assert after["lookups"] == before["lookups"] + 1
    assert sum(after["hit_pages_by_tier"].values()) == sum(before["hit_pages_by_tier"].values()) + 3  # reported
    assert after["indexed_pages"] == before["indexed_pages"]  # the half-computed rows were not stored
    with client.request(keys) as r:
        assert r.hit == 3


def test_a_request_larger_than_the_buffer_is_refused_before_anything_is_pinned(runtime_and_client):
    runtime, client = runtime_and_client
    before = runtime.shards.snapshot()["lookups"]
    with pytest.raises(RequestError, match="max_request_pages"), client.request(fresh_keys(client, BUFFER + 1)):
        pytest.fail("the block must not run")
    after = runtime.shards.snapshot()
    assert after["lookups"] == before and after["open_leases"] == 0
    with pytest.raises(RequestError, match="empty request"), client.request([]):
        pytest.fail("the block must not run")


def test_a_session_end_hint_outside_the_request_is_refused_by_name_and_loses_nothing(runtime_and_client):
    """``ends_session_from`` names a page of the request (or -1): anything else is refused
    before anything is pinned, and what was stored still loads."""
    runtime, client = runtime_and_client
    keys = fresh_keys(client, 3)
    with client.request(keys) as r:
        r.store()
    before = runtime.shards.snapshot()["lookups"]
    for bad in (3, -2, 1.5, True, "1"):
        with pytest.raises(RequestError, match="ends_session_from"), client.request(keys, ends_session_from=bad):
            pytest.fail("the block must not run")
    after = runtime.shards.snapshot()
    assert after["lookups"] == before and after["open_leases"] == 0
    with client.request(keys, ends_session_from=np.int64(1)) as r:  # a good hint (any integer): the pages load as before
        assert r.hit == 3


def test_rows_hold_exactly_the_request_and_the_block_sees_the_loaded_bytes(runtime_and_client):
    """A stored page's bytes come back in its own row, whatever the buffer held before."""
    _, client = runtime_and_client
    keys = fresh_keys(client, 4)
    data = np.random.default_rng(5).integers(0, 256, (4, client.page_nbytes), dtype=np.uint8)
    with client.request(keys) as r:
        r.rows[:] = data
        r.store()
    client.buffer.pages[:] = 0xFF
    with client.request(keys[:2]) as r:
        assert r.rows.shape[0] == 2 and np.array_equal(r.rows, data[:2])


def test_a_lookup_announced_tells_the_store_before_another_client_stores(ray_cluster):
    """The vLLM connector's split: one client looks up and announces the request with its
    pages and its client's end-of-session hint; another, the worker's, stores the computed
    pages. The node's store heard the hint first, so the session's own pages are not stored,
    a page the lookup did not cover included (an engine does not look up the page holding the
    prompt's last token, and stores it). Unannounced, the lookup leaves the store untold (its
    arrival waits for that client's next call there) and the pages are stored."""
    from kvray.cluster.protocol import Loaded, Plan
    from kvray.engines.runtime import RuntimePages

    runtime = Runtime.start(
        RuntimeConfig(name="announce", layout=LAYOUT, tiers=TierSizes(host=64), collective=False, policy="lru-session-end")
    )
    scheduler = KvrayClient.connect("announce", buffer_pages=BUFFER, mapped_reads=False)
    worker = KvrayClient.connect("announce", buffer_pages=BUFFER, mapped_reads=False)
    pattern = PagePattern(worker.page_nbytes)

    def last_turn(own_from: int | None, looked_up: int = 3) -> int:
        """A session's last turn over a shared first page: ``looked_up`` of its three pages looked
        up by one client (and announced with its own pages from ``own_from``, unless None), its
        new pages stored by the other; returns the pages a later lookup finds."""
        keys = fresh_keys(scheduler, 3)
        pattern.fill_rows(keys[:1], worker.buffer.pages[:1])
        assert worker.store(keys[:1], 0, Plan.placing([worker.node_id])) == 1  # the shared page, stored earlier
        plan = scheduler.lookup(keys[:looked_up])
        if own_from is not None:
            scheduler.announce(keys, ends_session_from=own_from)
        scheduler.release(plan, Loaded(0))
        pattern.fill_rows(keys[1:], worker.buffer.pages[:2])
        worker.store(keys[1:], 0, Plan.placing([worker.node_id] * 2), parent_key=keys[0], route_key=keys[0])
        found = scheduler.lookup(keys)
        scheduler.release(found, Loaded(0))
        return found.hit_pages

    try:
        # an engine's lookup covers at most the landing buffer: a hint past it names none of those pages
        long_prompt = fresh_keys(scheduler, BUFFER + 2)
        plan = RuntimePages(scheduler).lookup(long_prompt, ends_session_from=BUFFER + 1)
        assert plan.hit_pages == 0
        scheduler.release(plan, Loaded(0))
        assert last_turn(own_from=1) == 1  # pages 1 and 2: this session's own, now done
        assert last_turn(own_from=2, looked_up=2) == 2  # the last page, not looked up, is its own
        assert last_turn(own_from=None) == 3
        assert runtime.store_stats()[worker.node_id]["policy"]["ended_stores_refused"] == 2
    finally:
        scheduler.close()
        worker.close()
        runtime.close()
