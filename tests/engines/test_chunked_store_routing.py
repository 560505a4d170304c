"""An engine's pages stored a part at a time on a runtime with several controller shards
commit to the shard the prompt's lookups ask.

Engines store only what they computed: the continuation of a cached prefix (vLLM's
``PageSave`` with its parent key, the transformers adapter's new pages), and a prompt
longer than the landing buffer a buffer at a time. Each part's own keys do not say where
the whole chain is routed (its root, or its page at ``controller_route_depth``), so a part
routed by them went to whichever shard its first page hashed to, and the prompt's lookups
never found it: misses, never wrong KV, and a cache that quietly stopped caching. The
prompts here are drawn so every part's own keys route elsewhere than the chain's. The
lookups go through a second client that does not read the node's mapped host tier, so the
controller answers them, as it answers an engine on another node.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import ray

from kvray.cluster import KvrayClient, Runtime, RuntimeConfig
from kvray.cluster.protocol import Loaded
from kvray.core.config import PageLayout, TierSizes
from kvray.core.errors import RequestError
from kvray.core.partition import route_key, shard_of
from kvray.engines.runtime import RuntimePages

pytestmark = pytest.mark.ray

LAYOUT = PageLayout(layers=2, kv_heads=2, head_dim=8, page_tokens=16, dtype="float16")
BUFFER = 4  # the landing buffer's rows: a 12-page prompt is stored in three parts
PAGES = 12
SHARDS = 2
_names = itertools.count()


@pytest.fixture(params=[0, 1], ids=["by-root", "route-depth-1"])
def engine_pages(ray_cluster, request):
    config = RuntimeConfig(
        name=f"chunkroute{next(_names)}",
        layout=LAYOUT,
        tiers=TierSizes(host=64),
        controller_shards=SHARDS,
        controller_route_depth=request.param,
        max_request_pages=PAGES,
    )
    runtime = Runtime.start(config)
    pages = RuntimePages(KvrayClient.connect(config.name, buffer_pages=BUFFER))
    reader = RuntimePages(KvrayClient.connect(config.name, buffer_pages=BUFFER, mapped_reads=False))
    yield runtime, pages, reader
    reader.close()
    pages.close()
    runtime.close()


def prompt_routed_away_from_its_parts(pages: RuntimePages, depth: int) -> list[int]:
    """Page keys of a prompt whose every part (from any page past the first)
    would route to another shard than the whole chain if routed by its own keys."""
    for seed in range(10_000):
        tokens = np.random.default_rng(seed).integers(0, 30_000, PAGES * LAYOUT.page_tokens, dtype=np.int32)
        keys = pages.keys(tokens)
        owner = shard_of(route_key(keys, depth), SHARDS)
        parts = [keys[lo - 1 :] for lo in (3, BUFFER, 2 * BUFFER)] + [keys[lo:] for lo in (3, BUFFER, 2 * BUFFER)]
        if all(shard_of(route_key(part, depth), SHARDS) != owner for part in parts):
            return keys
    raise AssertionError("no prompt found whose parts route away from it")


def rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, LAYOUT.page_nbytes), dtype=np.uint8)


def settle(runtime: Runtime, pages: RuntimePages) -> None:
    pages.client.settle()
    ray.get(runtime.shards.broadcast("snapshot"))  # every commit sent before has run


def test_a_prompt_longer_than_the_buffer_is_found_whole(engine_pages):
    runtime, pages, reader = engine_pages
    keys = prompt_routed_away_from_its_parts(pages, runtime.config.controller_route_depth)
    data = rows(PAGES, 1)
    assert pages.put_pages(keys, data, pages.fingerprint.digest) == PAGES  # three parts, each continuing the last
    settle(runtime, pages)
    client = reader.client
    plan = client.lookup(keys)
    total = Loaded(0)
    for start, loaded in client.load_chunks(keys, plan):
        assert np.array_equal(client.buffer.pages[: loaded.pages], data[start : start + loaded.pages])
        total.merge(loaded)
    client.release(plan, total)
    assert plan.hit_pages == total.pages == PAGES


def test_a_continuation_saved_as_the_connector_does_is_found_whole(engine_pages):
    runtime, pages, reader = engine_pages
    keys = prompt_routed_away_from_its_parts(pages, runtime.config.controller_route_depth)
    prompt = keys[:BUFFER]
    head, tail = rows(3, 2), rows(BUFFER - 3, 3)
    assert pages.put_pages(prompt[:3], head, pages.fingerprint.digest) == 3  # an earlier request cached 3 pages
    settle(runtime, pages)
    assert reader.match(prompt) == 3
    # The connector's save of the pages computed after them: parent key and the prompt's route key.
    route = pages.route_key(prompt)
    assert pages.put_pages(prompt[3:], tail, pages.fingerprint.digest, parent_key=prompt[2], route_key=route) == 1
    settle(runtime, pages)
    plan = reader.lookup(prompt)
    loaded, raw = reader.read(prompt, plan)
    assert loaded.pages == BUFFER and np.array_equal(raw, np.concatenate([head, tail]))
    with pytest.raises(RequestError, match="route_key"):  # a continuation that does not say its route is refused
        pages.put_pages(prompt[3:], tail, pages.fingerprint.digest, parent_key=prompt[2])
