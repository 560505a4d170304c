"""Cluster policies that use the verbs a vLLM engine executes, for
tests/engines/test_vllm_cluster_verbs.py (the runtime's controller builds one by import path:
``tests.engines.verb_policy:SplitPrefetchReplicate``)."""

from __future__ import annotations

from kvray.policy.cluster import ClusterView, LocalFirstRing, RequestView

LONG_HIT = 12  # pages: a hit this long is prefetched, a shorter one replicated


class SplitPrefetchReplicate(LocalFirstRing):
    """Loads half of every cached prefix (vLLM computes the rest); prefetches a hit of at
    least :data:`LONG_HIT` pages; keeps a copy of a shorter one that lies partly elsewhere
    on the node serving it."""

    name = "split-prefetch-replicate"

    def load_pages(self, request: RequestView, cluster: ClusterView) -> int:
        return len(request.hit_nodes) // 2

    def prefetch(self, request: RequestView, cluster: ClusterView) -> bool:
        return len(request.hit_nodes) >= LONG_HIT

    def replicate(self, request: RequestView, cluster: ClusterView) -> list[str]:
        elsewhere = any(node != request.requester for node in request.hit_nodes)
        return [request.requester] if elsewhere and len(request.hit_nodes) < LONG_HIT else []


class ReplicateElsewhere(LocalFirstRing):
    """Loads every cached page and keeps a copy of a cached prefix on every node that
    neither serves the request nor holds a page of it: a copy to another node than the
    engine's own, which only the worker's ``replicate`` puts there."""

    name = "replicate-elsewhere"

    def replicate(self, request: RequestView, cluster: ClusterView) -> list[str]:
        if not request.hit_nodes:
            return []
        return [n for n in cluster.names if n != request.requester and n not in request.hit_nodes]
