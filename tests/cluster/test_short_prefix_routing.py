"""A short prefix stored as part of a longer chain is found by its own lookup, with shards
routed past the root.

With ``controller_route_depth`` d a chain is routed by its page at depth d, and a chain of
at most d pages by its last page. A request's store commits the whole chain to the shard
its own page at depth d names; a later lookup of just its first L <= d pages asks the shard
its page L-1 names. Those differ for most chains, and that lookup missed pages the cluster
held: misses, never wrong KV. The store now also commits each such prefix to the shard its
own lookup asks. The keys here are drawn so the shards differ; the lookups go through a
client that does not read the node's mapped host tier, so the controller answers them.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import ray

from kvray.cluster import KvrayClient, Runtime, RuntimeConfig
from kvray.cluster.protocol import Loaded
from kvray.core.config import PageLayout, TierSizes
from kvray.core.partition import shard_of

pytestmark = pytest.mark.ray

LAYOUT = PageLayout(layers=2, kv_heads=2, head_dim=8, page_tokens=16, dtype="float16")
SHARDS = 4
DEPTH = 2
_names = itertools.count()


@pytest.fixture
def clients(ray_cluster):
    routed = {"controller_shards": SHARDS, "controller_route_depth": DEPTH}
    config = RuntimeConfig(name=f"shortroute{next(_names)}", layout=LAYOUT, tiers=TierSizes(host=64), **routed)
    runtime = Runtime.start(config)
    writer = KvrayClient.connect(config.name)
    reader = KvrayClient.connect(config.name, mapped_reads=False)
    yield runtime, writer, reader
    reader.close()
    writer.close()
    runtime.close()


def chain_routed_apart(client: KvrayClient, pages: int) -> list[int]:
    """Keys of a ``pages``-page chain whose prefixes of 1..DEPTH pages and the whole chain
    route to DEPTH + 1 different shards."""
    for salt in range(10_000):
        keys = client.keys_for_trace(list(range(pages)), salt=str(salt))
        routes = {shard_of(keys[i], SHARDS) for i in range(DEPTH + 1)}
        if len(routes) == DEPTH + 1:
            return keys
    raise AssertionError("no chain found whose prefixes route apart")


def look_up(reader: KvrayClient, keys: list[int]) -> tuple[int, np.ndarray]:
    plan = reader.lookup(keys)
    loaded = reader.load(keys, plan) if plan.hit_pages else Loaded(0)
    reader.release(plan, loaded)
    return loaded.pages, reader.buffer.pages[: loaded.pages].copy()


def test_each_short_prefix_of_a_stored_chain_is_found_by_its_own_lookup(clients):
    runtime, writer, reader = clients
    keys = chain_routed_apart(writer, 5)
    data = np.random.default_rng(0).integers(0, 256, (len(keys), LAYOUT.page_nbytes), dtype=np.uint8)
    with writer.request(keys) as r:
        assert r.hit == 0
        r.rows[:] = data
        r.store()
    assert r.stored == len(keys)
    writer.settle()
    ray.get(runtime.shards.broadcast("snapshot"))  # every commit sent before has run
    for length in range(1, len(keys) + 1):
        got, rows = look_up(reader, keys[:length])
        assert got == length, f"a lookup of the first {length} pages found {got}"
        assert np.array_equal(rows, data[:length])


def test_a_stored_chain_is_indexed_once_on_each_shard_its_lookups_ask(clients):
    runtime, writer, reader = clients
    keys = chain_routed_apart(writer, 4)
    data = np.random.default_rng(1).integers(0, 256, (len(keys), LAYOUT.page_nbytes), dtype=np.uint8)
    with writer.request(keys[:1]) as r:  # one page cached first: its own shard indexes it
        r.rows[:] = data[:1]
        r.store()
    writer.settle()
    before = runtime.shards.snapshot()["indexed_pages"]
    with reader.request(keys) as r:  # misses (another shard), stores all 4 from the root
        r.rows[:] = data
        r.store()
    reader.settle()
    ray.get(runtime.shards.broadcast("snapshot"))
    # The whole chain on its own shard (4), the 2-page prefix on its page-1 shard (2);
    # the 1-page prefix was there already.
    assert runtime.shards.snapshot()["indexed_pages"] - before == 4 + 2
    assert look_up(reader, keys[:2])[0] == 2 and look_up(reader, keys[:1])[0] == 1
