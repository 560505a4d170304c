"""A KV-aware Ray Serve request router: each request goes to the replica the cluster policy's
``route`` verb picks from where kvray holds the request's pages.

For each request :class:`KvrayRequestRouter` hashes the prompt's token ids into page keys
(the chained keys the replicas' connectors use: each replica publishes its model
fingerprint and salt in its routing stats), asks the kvray controller where the cached
prefix of those keys lives (``Controller.locate``: one node per page, nothing pinned), and
hands :func:`~kvray.engines.vllm.routing.choose_replica` the replicas' backlogs (Serve's
queue length per replica times the measured time per request) and the links'
utilisations the controller observes. The answer comes from
:meth:`kvray.policy.cluster.ClusterPolicy.route` with the same
:class:`~kvray.policy.cluster.RequestView` and :class:`~kvray.policy.cluster.ClusterView`
the simulator builds (``kvray/sim/cluster.py``), so a policy learned or tuned there
(``cost-router``, or any ``package.module:Class``) routes live traffic unchanged.

What the controller's index does not hold it cannot route on: it knows each page's node,
and its tier only where nodes have one tier (stores keep tiers), so the view carries what
``Controller.decide`` shows the policy for the same request; ``page_prefill_ms`` is the
runtime's when it has one (the router's setting otherwise). The engine that serves the
request asks the policy's other verbs itself (:mod:`kvray.engines.vllm.verbs`). Nothing of
the engines' own prefix caches is in the index: with ``engine_cache_pages`` set (each
replica's vLLM KV space, in pages) the router also keeps what it sent each node
(:class:`~kvray.engines.vllm.routing.EngineCaches`): the replica that served a session's
last turn still holds it on the device, so those pages count as that node's, device tier.

When the controller cannot be reached within ``lookup_timeout_s`` (not started,
restarting, slow) or no replica has published its fingerprint yet, the request goes to
the least-loaded replica: the cache never fails or stalls a request. Serve tries the
other replicas, least loaded first, when the chosen one is full.

Example (what ``vllm_app(..., router="kvray")`` sets up)::

    from ray.serve.config import RequestRouterConfig

    config = RequestRouterConfig(
        request_router_class="kvray.engines.vllm.router:KvrayRequestRouter",
        request_router_kwargs={"runtime": "kvray", "policy": "cost-router"},
        request_routing_stats_period_s=1.0,
    )
"""

from __future__ import annotations

import asyncio
import logging
import time

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from kvray.engines.vllm.routing import Candidate, EngineCaches, choose_replica, keys_from_stats, least_loaded
from kvray.policy.cluster import ClusterView, RequestView, make_cluster_policy

log = logging.getLogger(__name__)

RETRY_CONTROLLER_S = 5.0  # after a failed attempt to find the controller, route by load this long
SERVICE_SMOOTHING = 0.2  # weight of the latest request in the measured time per request


def prompt_token_ids(request: PendingRequest | None) -> list[int] | None:
    """The token ids of a request's prompt: the first argument's ``prompt_token_ids``
    (:class:`kvray.engines.vllm.serve.GenerateRequest`), or None (a text prompt)."""
    if request is None or not request.args:
        return None
    return getattr(request.args[0], "prompt_token_ids", None)


class KvrayRequestRouter(FIFOMixin, RequestRouter):
    """Ray Serve's :class:`~ray.serve.request_router.RequestRouter` routing by kvray's page
    index and the cluster policy's ``route``; see the module docstring.

    Settings (``request_router_kwargs``): ``runtime`` (the kvray runtime's name),
    ``policy`` (a cluster policy name or import path, default ``cost-router``),
    ``page_prefill_ms`` (time to recompute one page on these engines, which weighs pages
    against queues, when the runtime does not say), ``request_ms`` (the time per request assumed
    until one is measured), ``lookup_timeout_s`` (how long to wait for the controller before
    routing by load) and ``engine_cache_pages`` (each replica's own KV space in pages; 0: not counted).
    """

    def initialize_state(
        self,
        runtime: str = "kvray",
        policy: str = "cost-router",
        page_prefill_ms: float = 1.0,
        request_ms: float = 100.0,
        lookup_timeout_s: float = 1.0,
        engine_cache_pages: int = 0,
    ) -> None:
        self.runtime = runtime
        self.policy = make_cluster_policy(policy)
        self.page_prefill_ms = page_prefill_ms
        self.request_ms = request_ms
        self.lookup_timeout_s = lookup_timeout_s
        self.engine_caches = EngineCaches(engine_cache_pages) if engine_cache_pages > 0 else None
        self._shards = None
        self._next_find = 0.0
        self._started: dict[str, float] = {}  # internal request id -> when it was routed

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # every replica full: wait before retrying
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        candidates = [
            Candidate(r.replica_id.unique_id, r.node_id or "", self.replica_queue_len_cache.get(r.replica_id) or 0)
            for r in candidate_replicas
        ]
        chosen = await self._route(prompt_token_ids(pending_request), candidate_replicas, candidates)
        rest = sorted((c for c in candidates if c.replica != chosen), key=lambda c: c.queue_len)
        return [[by_id[chosen]], *([by_id[c.replica]] for c in rest)]

    async def _route(self, tokens: list[int] | None, replicas: list[RunningReplica], candidates: list[Candidate]) -> str:
        """The policy's replica, or the least loaded when the request or the cache cannot say."""
        keys = self._keys(tokens, replicas)
        located = await self._locate(keys) if keys else None
        if located is None:
            return least_loaded(candidates).replica
        request, links = located
        hit_nodes, tiers = request.hit_nodes, request.hit_tiers
        if self.engine_caches is not None:
            hit_nodes, tiers = self.engine_caches.merge(keys, hit_nodes, tiers)
        page_ms = links.page_prefill_ms or self.page_prefill_ms  # the runtime's, which its engines' decisions see
        chosen = choose_replica(self.policy, keys, hit_nodes, candidates, links, self.request_ms, page_ms, tiers)
        if self.engine_caches is not None:
            self.engine_caches.served(next(c.node for c in candidates if c.replica == chosen), keys)
        return chosen

    def _keys(self, tokens: list[int] | None, replicas: list[RunningReplica]) -> list[int]:
        """The request's page keys as the replicas' connectors make them (none before a
        replica has published its fingerprint, or for a text prompt)."""
        if not tokens:
            return []
        stats = next((r.routing_stats for r in replicas if r.routing_stats and "kvray_digest" in r.routing_stats), None)
        if stats is None:
            return []
        return keys_from_stats(tokens, stats)

    async def _locate(self, keys: list[int]) -> tuple[RequestView, ClusterView] | None:
        """The controller's answer (the request's and the cluster's views), or None when it cannot be had in time."""
        shards = await self._controller()
        if shards is None:
            return None
        try:
            return await asyncio.wait_for(shards.for_keys(keys).locate.remote(keys), self.lookup_timeout_s)
        except Exception as exc:  # any failure of the cache is a least-loaded route, never a failed request
            log.warning("kvray controller did not locate a request (%s): routing by load", type(exc).__name__)
            self._shards = None
            self._next_find = time.monotonic() + RETRY_CONTROLLER_S
            return None

    async def _controller(self):
        """The runtime's controller shards, found once (in a thread: finding waits on Ray)."""
        if self._shards is None and time.monotonic() >= self._next_find:
            from kvray.cluster.shards import ControllerShards

            try:
                self._shards = await asyncio.to_thread(ControllerShards.find, self.runtime, self.lookup_timeout_s)
            except Exception as exc:  # no runtime (yet), or one not answering: route by load
                log.warning("kvray runtime %r not reachable (%s): routing by load", self.runtime, exc)
                self._next_find = time.monotonic() + RETRY_CONTROLLER_S
        return self._shards

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        self._started[pending_request.metadata.internal_request_id] = time.monotonic()

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        started = self._started.pop(internal_request_id, None)
        if started is not None:
            took_ms = (time.monotonic() - started) * 1e3
            self.request_ms += SERVICE_SMOOTHING * (took_ms - self.request_ms)
