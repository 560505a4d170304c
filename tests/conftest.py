"""Shared fixtures: small page layouts and a deterministic 'model' whose KV for a token
depends on the whole prefix before it, so any KV returned for the wrong prefix shows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvray.config import PageLayout

TINY = PageLayout(layers=2, kv_heads=2, head_dim=4, page_tokens=4, dtype="float32")


def prefix_kv(layout: PageLayout, tokens) -> torch.Tensor:
    """KV of ``tokens`` where every value depends on the token's whole prefix."""
    tokens = np.asarray(tokens, dtype=np.int64)
    state = np.cumsum((tokens + 1) * 1_000_003 % 65_521) % 2**20  # rolling prefix digest
    per_token = layout.layers * 2 * layout.kv_heads * layout.head_dim
    grid = (state[:, None] * 7 + np.arange(per_token)[None, :]) % 1_000
    kv = torch.from_numpy(grid.astype(np.float32) / 8.0)  # exact in float16 and bfloat16 too
    kv = kv.view(len(tokens), layout.layers, 2, layout.kv_heads, layout.head_dim).permute(1, 2, 0, 3, 4)
    return kv.contiguous().to({"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[layout.dtype])


@pytest.fixture
def tiny_layout() -> PageLayout:
    return TINY


# -- Ray: one real multi-node cluster per test session (tests marked ``ray``) -----------------
RAY_NODES = 3
RAY_OBJECT_STORE_BYTES = 150 << 20


@pytest.fixture(scope="session")
def ray_cluster():
    """Three local Ray nodes (separate raylets and object stores), shared by every ``ray`` test.

    No dashboard (it costs ~1 GB); metrics are reported every second so Prometheus
    exports can be checked without long waits. Tests that need to lose a node add their
    own and remove it, so the three stay.
    """
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "object_store_memory": RAY_OBJECT_STORE_BYTES,
            "include_dashboard": False,
            "_system_config": {"metrics_report_interval_ms": 1000},
        },
    )
    for _ in range(RAY_NODES - 1):
        cluster.add_node(num_cpus=1, object_store_memory=RAY_OBJECT_STORE_BYTES)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="kvray", log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()
