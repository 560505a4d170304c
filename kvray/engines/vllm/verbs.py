"""The cluster policy's verbs in a vLLM engine on a kvray runtime: how much of a hit to load,
prefetch while the request waits, replicate after it is served, the NVMe write budget.

The engine was routed to already (by the Ray Serve router's ``route``,
:mod:`kvray.engines.vllm.router`, or by whoever sent the request), so when vLLM adds a
request the scheduler side asks the controller shard owning its chain for the other verbs
as this node sees them (``Controller.decide(..., route=False)``: the views and the order
the simulator's ``ClusterSimulator.serve`` uses) and executes them:

- **load or recompute**: the hit reported to vLLM stops at the decision's ``load_pages``;
  vLLM computes the rest of the prompt itself. The pages it recomputes stay cached where
  they were (their holders count them as read, as the simulator does) and are not stored
  again. A shorter hit can only cost time: no page that is loaded is any other than before.
- **prefetch**: the pages to be loaded that live on other nodes are copied into this node's
  store (and indexed there as replicas) on a thread of this side, while vLLM keeps the
  request waiting (``get_num_new_matched_tokens`` answers ``None``: ask again later); its
  lookup then reads them from this node.
- **replicate** (to every node the decision names, this one or others): the worker, having
  read the pages into the request's blocks, copies them from its landing buffer to those
  nodes' stores (:meth:`~kvray.cluster.storing.ChainStores.replicate`);
- **write budget**: the serving store's NVMe write budget, which the controller sends with
  the decision; the request waits until it is applied, so its own writes are under it.

A request waits at most ``timeout_s`` for its decision and prefetch; a decision that fails
or comes late is the default one (load every hit page, nothing else): the cache never fails
a request. Asking costs one controller call per request, so the connector asks only when
the runtime's cluster policy decides one of these verbs itself (:func:`decides_verbs`),
unless its ``cluster_verbs`` setting says otherwise.

Example::

    verbs = ClusterVerbs(runtime, counters)       # the scheduler side's RuntimePages and counters
    verbs.ask("req-1", keys, runtime.route_key(keys))
    verbs.answer("req-1")                         # PENDING, then a Verbs
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, NamedTuple

from kvray.cluster.protocol import Loaded
from kvray.core.keys import pack_keys
from kvray.policy.cluster import ClusterPolicy

if TYPE_CHECKING:
    from kvray.cluster.client import KvrayClient
    from kvray.engines.runtime import RuntimePages

log = logging.getLogger(__name__)

VERBS = ("load_pages", "prefetch", "replicate", "disk_write_budget")
WAIT_S = 10.0  # the longest a request waits for its decision and prefetch


def decides_verbs(policy: ClusterPolicy) -> bool:
    """Whether ``policy`` decides any verb an engine executes (overrides one of :data:`VERBS`);
    one that does not always answers the default, which asking would only delay."""
    return any(getattr(type(policy), verb) is not getattr(ClusterPolicy, verb) for verb in VERBS)


def wants_verbs(runtime: RuntimePages, setting: bool | None) -> bool:
    """Whether an engine on ``runtime`` whose ``cluster_verbs`` setting is ``setting`` asks
    (None: when the runtime's cluster policy decides a verb, :func:`decides_verbs`)."""
    return decides_verbs(runtime.client.config.make_cluster_policy()) if setting is None else setting


class Verbs(NamedTuple):
    """What an engine does with one request's cached prefix: load the first ``load_pages``
    (None: all of them), then copy them to the nodes ``replicate`` names."""

    load_pages: int | None = None
    replicate: tuple[str, ...] = ()


PENDING = object()  # the answer while a request's decision or prefetch runs
DEFAULT = Verbs()


class ClusterVerbs:
    """The scheduler side's asker (see the module docstring): one background thread, and a
    client of its own for prefetches, opened on the first one (it has a landing buffer, as
    every client; the scheduler side's client is used from vLLM's thread only). Pages it
    prefetched are counted in ``counters["prefetched_pages"]`` (the scheduler side's)."""

    def __init__(self, runtime: RuntimePages, counters: dict[str, int], timeout_s: float = WAIT_S) -> None:
        self.runtime = runtime
        self.counters = counters
        self.timeout_s = timeout_s
        self.failures = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvray-verbs")
        self._asked: dict[str, tuple[float, Future | None]] = {}  # None: answered with the default
        self._prefetcher: KvrayClient | None = None

    def ask(self, req_id: str, keys: Sequence[int], route_key: int) -> None:
        """Ask the controller for the verbs of request ``req_id`` (page ``keys`` it may load)
        and run its prefetch, in the background."""
        if keys and req_id not in self._asked:
            self._asked[req_id] = (time.monotonic() + self.timeout_s, self._pool.submit(self._decide, list(keys), route_key))

    def answer(self, req_id: str) -> Verbs | object:
        """The verbs of ``req_id``: :data:`PENDING` while they are being decided (and the
        prefetch runs), the default when never asked, failed or late."""
        asked = self._asked.get(req_id)
        if asked is None:
            return DEFAULT
        deadline, future = asked
        if future is None:
            return DEFAULT
        if not future.done():
            if time.monotonic() < deadline:
                return PENDING
            log.warning("kvray verbs for request %s took over %.1f s: it loads every hit page", req_id, self.timeout_s)
        else:
            try:
                return future.result()
            except Exception as exc:  # a cache must never fail a request: the default verbs
                log.warning("kvray verbs for request %s failed, it loads every hit page: %r", req_id, exc)
        self.failures += 1
        self._asked[req_id] = (deadline, None)
        return DEFAULT

    def forget(self, req_id: str) -> None:
        self._asked.pop(req_id, None)

    def _decide(self, keys: list[int], route_key: int) -> Verbs:
        """On the thread: the controller's decision for ``keys`` served here, and its prefetch."""
        import ray

        client = self.runtime.client
        controller = client.shards.handles[client.shards.owner(route_key)]
        decision = ray.get(controller.decide.remote(pack_keys(keys), client.node_id, 0.0, False), timeout=self.timeout_s)
        decision.wait_for_budget(self.timeout_s)  # the request's writes go under the budget decided with it
        load = None if decision.load_pages >= decision.hit_pages else decision.load_pages
        if decision.prefetch and decision.load_pages:
            self.counters["prefetched_pages"] += self._prefetch(keys[: decision.load_pages], route_key)
        return Verbs(load, decision.replicate)

    def _prefetch(self, keys: list[int], route_key: int) -> int:
        """Copy the cached pages of ``keys`` that live on other nodes into this node's store
        (indexed as replicas there); returns the pages it added."""
        if self._prefetcher is None:
            from kvray.cluster.client import KvrayClient

            self._prefetcher = KvrayClient.connect(self.runtime.client.config.name)
        client = self._prefetcher
        plan = client.lookup(keys, route_key=route_key)
        client.context.take_arrival()  # the peers it reads hear of the request; this node's, from the scheduler side
        if all(node == client.node_id for node in plan.hit_nodes):  # nothing cached elsewhere
            client.release(plan, Loaded(0))
            return 0
        loaded = client.load(keys[: plan.hit_pages], plan)
        client.release(plan, loaded)
        copied = sum(client.replicate(keys, plan, loaded).values())
        client.settle()  # the controller indexes the copies before the request's own lookup
        return copied

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None
