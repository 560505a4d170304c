"""The connector's scheduler side: what kvray holds of each request's prompt, and what the
worker must load and save in each step.

With an **in-process store** (a :class:`~kvray.core.store.PageStore` this side owns), a new
request's full prompt pages are looked up and *read and verified right away*, so the hit
reported to vLLM is made of pages already in memory: a store that fails, loses its disk or
returns a corrupt page yields a shorter hit (vLLM computes the rest), never a failed load
and never wrong KV. The staged pages go down to the worker with the step that schedules
the request; pages of finished prefill blocks come back up in the step's output and are
stored here.

On a **kvray runtime** the lookup is one controller round trip that pins the cached
prefix, made on a thread of its own (:mod:`kvray.engines.vllm.lookups`): vLLM is told
``None`` (ask again later) until the plan is in, and steps its running requests meanwhile.
The hit is reported as an *asynchronous* load (vLLM's ``load_async``): the
request waits in ``WAITING_FOR_REMOTE_KVS`` while others run, and the worker reads the
pages itself with the plan this side hands it (:mod:`kvray.engines.vllm.worker`). No page
byte passes through this side, but a prefetch's. When the runtime's cluster policy decides
them, its verbs (load or recompute, prefetch, replicate) are asked as vLLM adds the
request and executed here and by the worker (:mod:`kvray.engines.vllm.verbs`).

Requests whose KV does not depend on their token ids alone (multimodal inputs, prompt
embeddings, LoRA adapters) are neither loaded nor stored: equal tokens would not mean
equal KV.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvray.core.config import PageLayout
from kvray.core.placement import RequestInfo
from kvray.core.store import PageStore
from kvray.engines.runtime import RuntimePages
from kvray.engines.vllm.hints import session_end_page
from kvray.engines.vllm.lookups import RuntimeLookups
from kvray.engines.vllm.metadata import (
    KVRayMetadata,
    KVRayWorkerMetadata,
    PageLoad,
    PageSave,
    RuntimeLoad,
    new_counters,
)
from kvray.engines.vllm.verbs import DEFAULT, PENDING, ClusterVerbs

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvray.cluster.protocol import Plan

log = logging.getLogger(__name__)


# -- what this side keeps per request ---------------------------------------------------
@dataclass
class TrackedRequest:
    """A running request whose prompt kvray can cache; grows with its blocks as it runs."""

    keys: list[int]  # keys of the prompt's full pages
    ends_session_from: int = -1  # its client's end-of-session hint over them (kvray.engines.vllm.hints)
    told: bool = False  # the store's policy has heard of the request (once: vLLM asks again for one it could not schedule)
    block_ids: list[int] = field(default_factory=list)
    saved_pages: int = 0  # leading prompt pages already in kvray or handed to the worker
    cached_pages: int = 0  # leading prompt pages the runtime held at lookup


@dataclass(frozen=True)
class StagedHit:
    """Pages read and verified at lookup, held until vLLM allocates the request's blocks.
    vLLM may ask again for the same ``computed_tokens``; it then gets the same answer."""

    first_page: int  # the first page vLLM has not computed itself
    computed_tokens: int  # the num_computed_tokens the hit was reported for
    pages: np.ndarray  # [n, page_nbytes] uint8


@dataclass(frozen=True)
class AcceptedHit:
    """The part of a staged hit vLLM allocated blocks for: it goes down to the worker with
    the step that schedules the request."""

    first_page: int
    pages: np.ndarray  # [n, page_nbytes] uint8


@dataclass(frozen=True)
class PinnedHit:
    """Runtime: a lookup whose plan pins the cached prefix until the worker reads it or the
    request goes away."""

    first_page: int
    computed_tokens: int
    plan: Plan  # cut where a load split ends the hit
    replicate: tuple[str, ...] = ()  # the nodes the worker copies the pages to after reading them

    @property
    def pages(self) -> int:
        """Pages of the hit beyond what vLLM computed itself."""
        return self.plan.hit_pages - self.first_page


class ConnectorScheduler:
    """The scheduler side (see the module docstring): pages come from ``store`` (in-process)
    or ``runtime``, exactly one of them given; ``salt`` prefixes every request's cache salt;
    ``verbs``: the cluster policy's verbs are asked and executed (a runtime's only).

    Example::

        scheduler = ConnectorScheduler(layout, "", PageStore(config), runtime=None)
        tokens, load_async = scheduler.get_num_new_matched_tokens(request, 0)
    """

    def __init__(
        self,
        layout: PageLayout,
        salt: str,
        store: PageStore | None,
        runtime: RuntimePages | None,
        verbs: bool = False,
    ) -> None:
        assert (store is None) != (runtime is None), "pages come from a store or a runtime"
        assert not verbs or runtime is not None, "the cluster's verbs need a runtime"
        self.layout = layout
        self.salt = salt
        self.store = store
        self.runtime = runtime
        self.counters = new_counters()
        self.verbs = ClusterVerbs(runtime, self.counters) if verbs else None
        self.lookups = RuntimeLookups(runtime, self.counters) if runtime is not None else None
        self._requests: dict[str, TrackedRequest] = {}
        self._staged: dict[str, StagedHit] = {}
        self._accepted: dict[str, AcceptedHit] = {}
        self._pinned: dict[str, PinnedHit] = {}
        self._runtime_loads: list[RuntimeLoad] = []

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` whose pages kvray holds, read and verified now
        (in-process store) or pinned for the worker to read (runtime: loaded asynchronously;
        ``None`` while the runtime's lookup runs)."""
        page = self.layout.page_tokens
        staged = self._staged.get(request.request_id)
        if staged is not None and staged.computed_tokens == num_computed_tokens:
            return len(staged.pages) * page, False
        pinned = self._pinned.get(request.request_id)
        if pinned is not None and pinned.computed_tokens == num_computed_tokens:
            return pinned.pages * page, True
        tracked = self._track(request)
        if tracked is None:
            return 0, False
        loadable = (len(request.prompt_token_ids) - 1) // page  # the last token is always computed
        first = num_computed_tokens // page
        if first >= loadable:  # nothing to look up (vLLM holds it all), but pages to store, maybe
            self._tell(request.request_id, tracked)
            return 0, False
        if self.verbs is not None and self.verbs.answer(request.request_id) is PENDING:
            return None, False  # its decision or prefetch runs: vLLM asks again in a later step
        if self.runtime is not None:  # counted and timed on the lookups' thread
            return self._pin_on_runtime(request.request_id, tracked, first, loadable, num_computed_tokens)
        self.counters["lookups"] += 1
        started = time.perf_counter()
        try:
            return self._look_up(request.request_id, tracked, first, loadable, num_computed_tokens)
        finally:
            self.counters["lookup_us"] += int((time.perf_counter() - started) * 1e6)

    def on_new_request(self, request: Request) -> None:
        """vLLM added ``request``: ask the cluster policy's verbs for it (and start its
        prefetch) while it waits for its turn."""
        if self.verbs is None or (tracked := self._track(request)) is None:
            return
        loadable = min((len(request.prompt_token_ids) - 1) // self.layout.page_tokens, self.runtime.capacity)
        if loadable:
            self.counters["decisions"] += 1
            self.verbs.ask(request.request_id, tracked.keys[:loadable], self.runtime.route_key(tracked.keys))

    def _look_up(self, req_id: str, tracked: TrackedRequest, first: int, loadable: int, computed: int) -> tuple[int, bool]:
        """Pages ``first``..``loadable`` of the request's prompt, read and verified from the store
        now, its policy told of the request first (with the client's end-of-session hint)."""
        page = self.layout.page_tokens
        try:
            self._tell(req_id, tracked)
            found, pages = self.store.get_pages(tracked.keys[first:loadable])
        except Exception as exc:  # a cache must never fail a request: any store failure is a miss
            self.counters["failures"] += 1
            log.warning("kvray lookup failed, request %s recomputes: %r", req_id, exc)
            return 0, False
        if not found:
            return 0, False
        self.counters["hit_pages"] += len(found)
        self._staged[req_id] = StagedHit(first, computed, pages)
        return len(found) * page, False

    def _tell(self, req_id: str, tracked: TrackedRequest) -> None:
        """Tell the store of a request once, before anything of it is stored, when no lookup will
        (a lookup on a runtime announces it itself): every full page of its prompt, with its
        client's end-of-session hint. A runtime's store hears of it on the lookups' thread, not
        waited for (the worker stores the request's pages after the step that computes them)."""
        if tracked.told or not tracked.keys:
            return
        try:
            if self.store is not None:
                now = time.monotonic() * 1000.0
                info = RequestInfo(tuple(tracked.keys), arrival_ms=now, ends_session_from=tracked.ends_session_from)
                self.store.on_request(info)
            else:
                self.lookups.announce((tracked.keys, tracked.ends_session_from))
        except Exception as exc:  # a cache must never fail a request: the store hears of it at the next ask
            self.counters["failures"] += 1
            log.warning("kvray could not tell the store of request %s: %r", req_id, exc)
            return
        tracked.told = True

    def _pin_on_runtime(
        self, req_id: str, tracked: TrackedRequest, first: int, loadable: int, computed: int
    ) -> tuple[int | None, bool]:
        """Pin the runtime's cached prefix; its pages beyond ``first`` load asynchronously.
        ``None`` tokens while the lookup runs (vLLM asks again in a later step)."""
        if (stale := self._pinned.pop(req_id, None)) is not None:
            self.lookups.release(stale.plan)
        # Routed as the prompt's saves are (all its full pages): a prompt of at most
        # controller_route_depth + 1 pages would otherwise ask another shard than it saves to.
        told = None if tracked.told else (tracked.keys, tracked.ends_session_from)  # all its pages: it may store them all
        plan = self.lookups.plan(req_id, tracked.keys[:loadable], self.runtime.route_key(tracked.keys), told)
        if plan is None:
            return None, False
        tracked.told = True
        tracked.cached_pages = max(tracked.cached_pages, plan.hit_pages)  # the pages a split recomputes are not saved again
        verbs = self.verbs.answer(req_id) if self.verbs is not None else DEFAULT
        if verbs.load_pages is not None and verbs.load_pages < plan.hit_pages:  # a load split: vLLM computes the rest
            cut = max(verbs.load_pages, first)
            self.counters["recomputed_hit_pages"] += plan.hit_pages - cut
            self.lookups.touch_unloaded(tracked.keys, plan, cut)  # their holders count them as read
            plan = dataclasses.replace(plan, hit_nodes=plan.hit_nodes[:cut])  # the lease still pins (and ends) them all
        if plan.hit_pages <= first:
            self.lookups.release(plan)
            return 0, False
        # a copy of a chain is stored from its root: only a hit vLLM computed nothing of is replicated
        pinned = self._pinned[req_id] = PinnedHit(first, computed, plan, verbs.replicate if first == 0 else ())
        self.counters["hit_pages"] += pinned.pages
        return pinned.pages * self.layout.page_tokens, True

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """vLLM took ``num_external_tokens`` of the hit and allocated ``blocks`` for them."""
        taken = num_external_tokens // self.layout.page_tokens
        staged = self._staged.pop(request.request_id, None)
        if staged is not None and num_external_tokens > 0:
            self._accepted[request.request_id] = AcceptedHit(staged.first_page, staged.pages[:taken])
        pinned = self._pinned.pop(request.request_id, None)
        if pinned is None:
            return
        if taken == 0:
            self.lookups.release(pinned.plan)
            return
        first, keys = pinned.first_page, self._requests[request.request_id].keys
        block_ids = blocks.get_block_ids()[0][first : first + taken]
        # the worker ends the whole lease, on the controller shard that holds it
        sub = dataclasses.replace(pinned.plan, hit_nodes=pinned.plan.hit_nodes[first : first + taken], targets=[])
        load = RuntimeLoad(request.request_id, keys[first : first + taken], block_ids, sub, pinned.replicate)
        self._runtime_loads.append(load)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVRayMetadata:
        """The worker's orders for this step: pages to load into newly scheduled requests'
        blocks, prompt blocks to copy out once computed."""
        meta = KVRayMetadata(runtime_loads=self._runtime_loads, on_runtime=self.runtime is not None)
        self._runtime_loads = []
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._requests.get(new.req_id)
            if tracked is None:  # not cacheable (see _track)
                continue
            tracked.block_ids = list(new.block_ids[0])
            self._plan_load(meta, new.req_id, tracked)
            self._plan_save(meta, new.req_id, tracked, new.num_computed_tokens, scheduler_output)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._requests.get(req_id)
            if tracked is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # back from preemption: all its blocks are new
                tracked.block_ids = list(new_blocks[0]) if new_blocks else []
                self._plan_load(meta, req_id, tracked)
            elif new_blocks:
                tracked.block_ids.extend(new_blocks[0])
            self._plan_save(meta, req_id, tracked, cached.num_computed_tokens[i], scheduler_output)
        for req_id in scheduler_output.finished_req_ids:
            self._forget(req_id)
        return meta

    def _plan_load(self, meta: KVRayMetadata, req_id: str, tracked: TrackedRequest) -> None:
        """Hand the pages accepted for ``req_id`` to the worker, with the blocks they fill."""
        accepted = self._accepted.pop(req_id, None)
        if accepted is not None:
            first, pages = accepted.first_page, accepted.pages
            meta.loads.append(PageLoad(tracked.block_ids[first : first + len(pages)], pages))
            self.counters["loaded_pages"] += len(pages)

    def _plan_save(self, meta: KVRayMetadata, req_id: str, tracked: TrackedRequest, computed: int, out: SchedulerOutput) -> None:
        """Ask the worker for the prompt pages that become complete in this step and that
        kvray does not hold yet (pages it just loaded, for instance, are skipped)."""
        done = min((computed + out.num_scheduled_tokens.get(req_id, 0)) // self.layout.page_tokens, len(tracked.keys))
        cached = tracked.cached_pages if self.runtime is not None else self.store.match(tracked.keys[:done])
        first = max(tracked.saved_pages, cached)
        tracked.saved_pages = max(tracked.saved_pages, done)
        if first < done:
            parent = tracked.keys[first - 1] if first else None
            route = self.runtime.route_key(tracked.keys) if self.runtime is not None else None
            meta.saves.append(PageSave(tracked.keys[first:done], tracked.block_ids[first:done], parent, route))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Store the pages the worker copied out (in-process store; on a runtime the worker
        stores them itself and sends none)."""
        worker = connector_output.kv_connector_worker_meta
        if not isinstance(worker, KVRayWorkerMetadata):
            return
        for saved in worker.saved:
            save = saved.save
            try:
                stored = self.store.put_pages(save.keys, saved.pages, self.store.fingerprint.digest, save.parent_key)
            except Exception as exc:  # storing is best effort: the pages are simply not cached
                self.counters["failures"] += 1
                log.warning("kvray could not store %d pages: %r", len(save.keys), exc)
            else:
                self.counters["saved_pages"] += stored

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; its blocks are vLLM's to free at once (nothing is sent from them)."""
        self._forget(request.request_id)
        return False, None

    def _track(self, request: Request) -> TrackedRequest | None:
        """State of a request whose KV depends on its token ids alone; ``None`` for the rest
        (see the module docstring)."""
        tracked = self._requests.get(request.request_id)
        if tracked is None:
            if not request.prompt_token_ids or request.mm_features or request.lora_request is not None:
                return None
            if request.prompt_embeds is not None:
                return None
            salt = self.salt if request.cache_salt is None else f"{self.salt}|{request.cache_salt}"
            pages = self.runtime if self.runtime is not None else self.store
            keys = pages.keys(np.asarray(request.prompt_token_ids, dtype=np.int32), salt=salt)
            hint = session_end_page(request.kv_transfer_params, self.layout.page_tokens, len(keys), request.request_id)
            tracked = self._requests[request.request_id] = TrackedRequest(keys, hint)
        return tracked

    def _forget(self, req_id: str) -> None:
        self._requests.pop(req_id, None)
        self._staged.pop(req_id, None)
        self._accepted.pop(req_id, None)
        if self.verbs is not None:
            self.verbs.forget(req_id)
        if self.lookups is not None:
            self.lookups.forget(req_id)
        if (pinned := self._pinned.pop(req_id, None)) is not None:
            self.lookups.release(pinned.plan)

    def shutdown(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None
        if self.verbs is not None:
            self.verbs.close()
            self.verbs = None
        if self.lookups is not None:
            self.lookups.close()
            self.lookups = None
        if self.runtime is not None:
            self.runtime.close()
            self.runtime = None
