"""Cross-node pages by NIXL (Ray's tensor transport, UCX over TCP on this machine) between
real Ray nodes, and the client's choice per peer between NIXL and the TCP page server."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import ray

from kvray.cluster import KvrayClient, Runtime, RuntimeConfig
from kvray.cluster.paths import MEASURED_BYTES, PathSpeeds
from kvray.cluster.protocol import Plan
from kvray.core.config import PageLayout, TierSizes

LAYOUT = PageLayout(layers=2, kv_heads=2, head_dim=16, page_tokens=512, dtype="float16")  # 128 KiB pages
needs_nixl = pytest.mark.skipif(
    importlib.util.find_spec("nixl") is None, reason="the nixl package is not installed (pip install 'kvray[nixl]')"
)


@needs_nixl
@pytest.mark.ray
def test_pages_cross_nodes_by_nixl_exactly_and_the_faster_path_is_kept(ray_cluster):
    config = RuntimeConfig(name="nixl", layout=LAYOUT, tiers=TierSizes(host=64), nixl=True)
    runtime = Runtime.start(config)
    client = KvrayClient.connect(config.name, buffer_pages=32)
    try:
        other = next(n for n in runtime.stores if n != client.node_id)
        keys = client.keys_for_trace(list(range(32)))
        data = np.random.default_rng(3).integers(0, 256, (32, client.page_nbytes), dtype=np.uint8)
        client.buffer.pages[:] = data
        assert client.store(keys, 0, Plan.placing([other] * 32)) == 32
        ray.get(runtime.controller.snapshot.remote())

        client.config = config.model_copy(update={"tcp": False})  # NIXL the only direct path
        seen = set()
        for _ in range(2):
            client.buffer.pages[:] = 0
            with client.request(keys) as r:
                assert r.loaded.paths == {"nixl": 32} and r.loaded.by_tier == {"remote": 32}
                assert np.array_equal(r.rows, data)
            seen.update(r.loaded.paths)
        partial = keys[:5] + client.keys_for_trace([999])  # a miss after 5 pages: the prefix only
        with client.request(partial) as r:
            assert r.hit == 5 and np.array_equal(r.rows[:5], data[:5])

        client.config = config  # both on: each is tried on a large load, then the faster one kept
        for _ in range(3):
            with client.request(keys) as r:
                assert r.hit == 32 and np.array_equal(r.rows, data)
            seen.update(r.loaded.paths)
        assert seen == {"nixl", "tcp"}
        best = client.speeds.best(other, ["tcp", "nixl"])
        assert client.path_for(other, 32 * client.page_nbytes) == best
    finally:
        client.close()
        runtime.close()


def test_path_speeds_try_each_path_then_keep_the_fastest_that_works():
    speeds, big = PathSpeeds(), 8 * MEASURED_BYTES
    both = ["tcp", "nixl"]
    assert speeds.pick("b", both, big) == "tcp"  # untried, in order of preference
    speeds.record("b", "tcp", big, 1.0)
    assert speeds.pick("b", both, big) == "nixl"
    speeds.record("b", "nixl", big, 0.25)  # four times faster
    picks = [speeds.pick("b", both, big) for _ in range(64)]
    assert picks.count("nixl") == 62 and picks.count("tcp") == 2  # the runner-up re-measured now and then
    assert speeds.pick("b", both, 1024) == "nixl"  # small transfers: the best known, never a probe
    assert speeds.pick("c", both, big) == "tcp"  # per peer
    speeds.failed("b", "nixl")
    assert {speeds.pick("b", both, big) for _ in range(64)} == {"tcp"}  # a path that failed is left alone
    speeds.record("b", "tcp", MEASURED_BYTES - 1, 1e-9)  # too small to say anything
    assert speeds.best("b", both) == "tcp"
