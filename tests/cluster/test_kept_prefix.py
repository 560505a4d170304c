"""A store that keeps only part of a run: the controller learns only the part it kept.

A store out of room keeps a prefix of the run a client sends it (issue 32, item 5). The
client used to commit the whole run, so the index named pages no store held: later
lookups promised them, loads came back short and reported them lost. Now each store
answers how much of the run it holds (``Stored.landed``) and the client commits only
that. The tests send a 10-page run to a store with room for 6, by each path a store
goes (a peer's page server by TCP, a peer by the object store, this node's store through
shared memory), on real store actors, and check the index, the store and a load agree.

Each test prints one ``RELIABILITY {...}`` line (run with ``-s``); docs/reliability.md
tabulates them.
"""

from __future__ import annotations

import pytest
import ray

from kvray.cluster import KvrayClient, Runtime, RuntimeConfig
from kvray.cluster.checked import PagePattern
from kvray.cluster.protocol import Plan
from kvray.core.config import PageLayout, TierSizes
from tests.cluster.test_reliability_runtime import indexed_keys, report

pytestmark = [pytest.mark.ray, pytest.mark.fault]

LAYOUT = PageLayout(layers=2, kv_heads=2, head_dim=16, page_tokens=512, dtype="float16")
ROOM = 6  # pages each node's store has room for
RUN = 10  # pages sent to it in one run
FIRST_BLOCK = {"tcp": 1000, "object_store": 2000, "local": 3000}  # each case's own keys


@pytest.fixture(scope="module")
def runtime_and_client(ray_cluster):
    config = RuntimeConfig(name="kept-prefix", layout=LAYOUT, tiers=TierSizes(host=ROOM))
    runtime = Runtime.start(config)
    client = KvrayClient.connect(config.name, buffer_pages=16)
    yield runtime, client
    client.close()
    runtime.close()


@pytest.mark.parametrize("path", list(FIRST_BLOCK))
def test_a_store_out_of_room_has_only_the_pages_it_kept_indexed(runtime_and_client, path):
    """A 10-page run to a store with room for 6: it keeps the first 6, the controller indexes
    exactly those, and a load of the run returns them bit-exact and misses the other 4,
    with no page reported lost (the old code indexed all 10; the load then found 4 missing)."""
    runtime, client = runtime_and_client
    others = sorted(n for n in runtime.stores if n != client.node_id)
    node = {"tcp": others[0], "object_store": others[1], "local": client.node_id}[path]
    client.config = client.config.model_copy(update={"tcp": path != "object_store"})
    assert client.path_for(node, RUN * client.page_nbytes) == path

    pattern = PagePattern(client.page_nbytes)
    keys = client.keys_for_trace(list(range(FIRST_BLOCK[path], FIRST_BLOCK[path] + RUN)))
    pattern.fill_rows(keys, client.buffer.pages[:RUN])
    stored = client.store(keys, 0, Plan.placing([node] * RUN))
    assert stored == ROOM

    held = set(ray.get(runtime.stores[node].info.remote())["keys"])
    indexed = indexed_keys(runtime) & set(keys)  # after the commit: the controller runs this caller's calls in order
    assert held == indexed == set(keys[:ROOM])

    client.buffer.pages[:] = 0
    with client.request(keys) as r:
        wrong = pattern.wrong(keys[: r.hit], r.rows)
        assert r.plan.hit_nodes == [node] * ROOM
        assert r.hit == ROOM and wrong == 0
        assert r.loaded.lost == {}
    report(
        f"a {RUN}-page run stored by {path} to a store with room for {ROOM}",
        stored=stored,
        held=len(held),
        indexed=len(indexed),
        hit=r.hit,
        wrong=wrong,
        lost=sum(map(len, r.loaded.lost.values())),
    )
