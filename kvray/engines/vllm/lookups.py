"""The scheduler side's calls to a kvray runtime, on a thread of their own.

A lookup on a runtime is a controller round trip (unless this node's mapped host tier
holds the whole prompt). Made on vLLM's scheduler thread it stops the engine for that
long: on the served benchmark's agents (2 engines on 2 shared cores) 19-28 ms per request
at capacity, 13% of the engine thread's wall time, while a step of another request could
have run. vLLM lets ``get_num_new_matched_tokens`` answer ``None`` ("not known yet: ask
again in a later step"), so the scheduler side asks here and answers ``None`` until the
plan is in, and the engine steps its running requests meanwhile.

One lookup is in flight at a time per engine: vLLM skips a request answered ``None`` and
asks the next one in the same step, and a lookup started for every waiting request would
pin all their prefixes for as long as they queue (seconds at capacity), holding pages the
host tier could evict. With one at a time the pins are those the blocking lookup took:
the request vLLM is about to schedule.

``on_done``, where set, runs on this thread as each lookup ends: an engine loop that has
nothing to step while lookups run (:mod:`kvray.harness.vllm_serving`) sleeps until then
instead of stepping vLLM empty every few milliseconds to ask again.

Every call of the scheduler side's client (lookups, releases, touches of pages a load
split recomputes) runs on this thread, in the order made, because the client is not
thread-safe (:class:`~kvray.engines.runtime.RuntimePages`).

Example::

    lookups = RuntimeLookups(runtime)
    lookups.plan("req-1", keys, runtime.route_key(keys))   # None: asked, not in yet
    ...                                                     # a later step
    plan = lookups.plan("req-1", keys, route)               # the Plan, pinned; taken
    lookups.release(plan)                                   # the request went away
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvray.cluster.protocol import Plan
    from kvray.engines.runtime import RuntimePages

log = logging.getLogger(__name__)

Told = tuple[list[int], int]  # a request's pages (root first) and its client's end-of-session hint over them (-1: none)


class RuntimeLookups:
    """Lookups and releases of one scheduler side on one thread (see the module docstring);
    ``counters``: the side's, which gets ``lookups``, ``lookup_us`` (each lookup's wall
    time on this thread) and ``failures``."""

    def __init__(self, runtime: RuntimePages, counters: dict[str, int]) -> None:
        self.runtime = runtime
        self.counters = counters
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvray-lookup")
        self._asked: dict[str, Future] = {}  # request -> its lookup (-> Plan), until taken or forgotten
        self.on_done: Callable[[], None] | None = None  # runs as each lookup ends (see the module docstring)

    def plan(self, req_id: str, keys: Sequence[int], route_key: int, told: Told | None = None) -> Plan | None:
        """The pinned plan of ``keys`` for ``req_id``, taken (the caller releases it), once
        its lookup is in; None while it runs, or while another request's does (this one is
        asked when vLLM asks again). A lookup that raised is a miss. ``told``: what this
        node's store is to be told of the request after the lookup (its pages and its client's
        end-of-session hint over them; :meth:`_look_up`); None: a request told already."""
        future = self._asked.get(req_id)
        if future is None:
            if any(not f.done() for f in self._asked.values()):
                return None
            future = self._asked[req_id] = self._pool.submit(self._look_up, list(keys), route_key, told)
            if self.on_done is not None:  # once the plan is in: vLLM's next ask finds it
                future.add_done_callback(lambda _: self.on_done())
            return None
        if not future.done():
            return None
        del self._asked[req_id]
        return future.result()

    def _look_up(self, keys: list[int], route_key: int, told: Told | None) -> Plan:
        """The lookup; then, with ``told``, this node's store hears of the request before the
        plan is handed over (the worker that loads and stores its pages has clients of its own,
        whose calls carry no arrival: :meth:`~kvray.engines.runtime.RuntimePages.announce`).
        The hint goes with the lookup too where it names a page looked up (a holder of the
        request's pages elsewhere hears of it with a load split's touch)."""
        from kvray.cluster.protocol import NO_LEASE, Plan

        started = time.perf_counter()
        self.counters["lookups"] += 1
        try:
            plan = self.runtime.lookup(keys, route_key, told[1] if told is not None else -1, tell=told is not None)
        except Exception as exc:  # a cache must never fail a request: a miss
            self.counters["failures"] += 1
            log.warning("kvray lookup failed, the request recomputes: %r", exc)
            plan = Plan(NO_LEASE, [], [])
        if told is not None:  # the request arrived whatever the lookup found
            self._quietly(self.runtime.announce, *told)  # a store not told: the plan stands
        self.counters["lookup_us"] += int((time.perf_counter() - started) * 1e6)
        return plan

    def announce(self, told: Told) -> None:
        """Tell this node's store of a request that is not looked up (vLLM computed every page
        it could load), after every call made before (not waited for)."""
        self._pool.submit(self._quietly, self.runtime.announce, *told)

    def release(self, plan: Plan) -> None:
        """End ``plan``'s pins, after every call made before (not waited for)."""
        self._pool.submit(self._quietly, self.runtime.release, plan)

    def touch_unloaded(self, keys: Sequence[int], plan: Plan, cut: int) -> None:
        """The client's ``touch_unloaded`` (a load split's recomputed pages), in order, not waited for."""
        self._pool.submit(self._quietly, self.runtime.client.touch_unloaded, list(keys), plan, cut)

    def forget(self, req_id: str) -> None:
        """``req_id`` went away: a plan asked for it and not taken is released once it is in."""
        future = self._asked.pop(req_id, None)
        if future is not None:  # the lookup ran or runs first on the one thread: its plan is there by then
            self._pool.submit(lambda: self._quietly(self.runtime.release, future.result()))

    def _quietly(self, call, *args) -> None:
        try:
            call(*args)
        except Exception as exc:  # a release not made expires with its lease; never fails a request
            self.counters["failures"] += 1
            log.warning("kvray %s failed: %r", getattr(call, "__name__", call), exc)

    def close(self) -> None:
        """Run what was asked (releases included), then stop the thread."""
        for req_id in list(self._asked):
            self.forget(req_id)
        self._pool.shutdown(wait=True)
