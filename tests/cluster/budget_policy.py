"""A cluster policy that caps every serving node's NVMe writes, for
tests/cluster/test_disk_write_budget_runtime.py (the controller builds it by import path)."""

from __future__ import annotations

from kvray.policy.cluster import ClusterView, LocalFirstRing, NodeView

PAGE_NBYTES = 2 * 2 * 16 * 2 * 8 * 2  # the test's layout: layers x K,V x tokens x kv_heads x head_dim x fp16
BUDGET_PAGES = 3  # a burst of this many pages, then as many per second


class ThreePagesPerSecond(LocalFirstRing):
    name = "three-pages-per-second"

    def disk_write_budget(self, node: NodeView, cluster: ClusterView) -> float:
        return BUDGET_PAGES * PAGE_NBYTES
