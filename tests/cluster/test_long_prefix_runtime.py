"""A prefix larger than an engine's landing buffer, through the Ray runtime: stored a
buffer at a time on another node (each part continuing the chain of the one before) and
loaded back in chunks (:meth:`KvrayClient.load_chunks`) under one lookup's pins."""

from __future__ import annotations

import numpy as np
import pytest
import ray

from kvray.cluster import KvrayClient, Runtime, RuntimeConfig
from kvray.cluster.protocol import Loaded, Plan
from kvray.core.config import PageLayout, TierSizes
from kvray.core.errors import RequestError

pytestmark = pytest.mark.ray

LAYOUT = PageLayout(layers=2, kv_heads=2, head_dim=16, page_tokens=512, dtype="float16")  # 128 KiB pages
BUFFER = 16
PAGES = 100  # six buffers and a bit


@pytest.fixture(scope="module")
def runtime_and_client(ray_cluster, tmp_path_factory):
    config = RuntimeConfig(
        name="longprefix",
        layout=LAYOUT,
        tiers=TierSizes(host=40, disk=128),  # the prefix lives on host and disk of one node
        disk_root=tmp_path_factory.mktemp("disk"),
        max_request_pages=PAGES,
    )
    runtime = Runtime.start(config)
    client = KvrayClient.connect(config.name, buffer_pages=BUFFER)
    yield runtime, client
    client.close()
    runtime.close()


def _store_in_parts(client: KvrayClient, keys: list[int], data: np.ndarray, node: str) -> None:
    for start in range(0, len(keys), BUFFER):
        part = keys[start : start + BUFFER]
        client.buffer.pages[: len(part)] = data[start : start + len(part)]
        parent = keys[start - 1] if start else None
        placing, route = Plan.placing([node] * len(part)), client.shards.route_key(keys)
        assert client.store(part, 0, placing, parent_key=parent, route_key=route) == len(part)


def test_a_prefix_six_buffers_long_streams_back_exact(runtime_and_client):
    runtime, client = runtime_and_client
    other = next(n for n in runtime.stores if n != client.node_id)
    keys = client.keys_for_trace(list(range(PAGES)))
    data = np.random.default_rng(7).integers(0, 256, (PAGES, client.page_nbytes), dtype=np.uint8)
    _store_in_parts(client, keys, data, other)
    ray.get(runtime.controller.snapshot.remote())  # the commits (fire and forget) have landed

    plan = client.lookup(keys)
    assert plan.hit_pages == PAGES and set(plan.hit_nodes) == {other}  # one chain, every part joined
    total = Loaded(0)
    starts = []
    for start, loaded in client.load_chunks(keys, plan, chunk_pages=12):
        assert np.array_equal(client.buffer.pages[: loaded.pages], data[start : start + loaded.pages])
        starts.append(start)
        total.merge(loaded)
    client.release(plan, total)
    assert starts == list(range(0, PAGES, 12)) and total.pages == PAGES
    assert total.by_tier == {"remote": PAGES} and total.bytes_between_nodes == PAGES * client.page_nbytes
    stats = ray.get(runtime.stores[other].stats.remote())
    assert stats["tiers"]["disk"]["used"] > 0 and stats["tiers"]["host"]["used"] == 40  # host and disk both hold part
    assert ray.get(runtime.controller.snapshot.remote())["open_leases"] == 0


def test_chunks_must_fit_the_buffer_and_long_loads_need_chunks(runtime_and_client):
    _, client = runtime_and_client
    keys = client.keys_for_trace(list(range(5000, 5000 + 3 * BUFFER)))
    plan = client.lookup(keys)  # a request longer than the buffer may be looked up
    with pytest.raises(RequestError, match="chunk_pages"):
        next(client.load_chunks(keys, plan, chunk_pages=BUFFER + 1))
    with pytest.raises(RequestError, match="max_request_pages"):
        client.load(keys, plan)
    with pytest.raises(RequestError, match="max_request_pages"):
        client.lookup(client.keys_for_trace(list(range(PAGES + 1))))
    client.release(plan, Loaded(0))
