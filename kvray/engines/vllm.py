"""``KVRayConnector``: vLLM's KV connector API (``KVConnectorBase_V1``) backed by kvray.

Load it with::

    KVTransferConfig(kv_connector="KVRayConnector", kv_connector_module_path="kvray.engines.vllm",
                     kv_role="kv_both", kv_connector_extra_config={"host_pages": 4096})

How the two halves split the work (and why):

- The **scheduler side** owns the :class:`~kvray.core.store.PageStore`. On a new request it
  looks up the prompt's full pages and *reads and verifies them right away*, so the hit it
  reports to vLLM is made of pages already in memory: a store that fails, loses its disk
  or returns a corrupt page yields a shorter hit (vLLM computes the rest), never a failed
  load and never wrong KV. Pages of finished prefill blocks come back from the worker in
  the step's output and are stored here.
- The **worker side** never talks to the store: it copies staged pages into vLLM's paged
  KV cache before the forward pass and copies newly computed full blocks out after it.
  Page bytes thus travel inside vLLM's own scheduler -> worker metadata and worker ->
  scheduler output, which works whether the worker shares the scheduler's process or not.

On a **kvray runtime** (``kvray_runtime`` / ``kvray_ray_address`` in the extra config, or
``$KVRAY_RUNTIME`` / ``$KVRAY_RAY_ADDRESS``; :mod:`kvray.engines.runtime`) every engine
instance on every node shares one cache, and no page byte passes between the halves:

- the scheduler looks the prompt up (one controller round trip, pins the cached prefix)
  and reports the hit as an *asynchronous* load (vLLM's ``load_async``): the request waits
  in ``WAITING_FOR_REMOTE_KVS`` while other requests run;
- the worker reads those pages itself on a background thread, from its node's mapped host
  tier or by TCP from a peer node's page server, writes them straight into the request's
  KV blocks and reports the request in ``get_finished``. A page that does not arrive is
  reported with its block in ``get_block_ids_with_load_errors``, and vLLM (with
  ``kv_load_failure_policy="recompute"``, which the connector sets) recomputes from
  there: a shorter hit, never a failed request or wrong KV;
- the worker stores newly computed full blocks on its node's store, on the same thread.

Pages hold K and V as ``[layers, 2, block_size, kv_heads, head_dim]`` (kvray's canonical
page layout, the same as the transformers adapter's), whatever the attention backend's
physical block layout; :class:`BlockCodec` converts. The page size is vLLM's block size.

Scope: one worker (tensor and pipeline parallel size 1), one full-attention KV cache group,
``kv_cache_dtype="auto"``, attention backends ``CPU_ATTN`` and ``FLASH_ATTN``. Anything else
is refused at start-up with a :class:`~kvray.core.errors.ConfigError` naming it.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvray.core.config import PageLayout, validate
from kvray.core.errors import ConfigError
from kvray.core.pages import torch_dtype
from kvray.core.store import PageStore
from kvray.engines.hf import DTYPE_NAMES
from kvray.engines.revision import checkpoint_revision
from kvray.engines.runtime import RuntimePages, runtime_target
from kvray.engines.vllm_blocks import BlockCodec
from kvray.engines.vllm_settings import ConnectorSettings, connector_settings, store_config
from kvray.policy import make_policy

LOAD_PATHS = ("mapped", "local", "tcp", "object_store", "collective")  # see kvray.cluster.client

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


def page_layout(vllm_config: VllmConfig) -> PageLayout:
    """kvray's page layout for the model vLLM serves: one page per vLLM block."""
    model, cache, parallel = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    if parallel.tensor_parallel_size * parallel.pipeline_parallel_size != 1:
        raise ConfigError(
            "KVRayConnector supports one worker; got tensor_parallel_size="
            f"{parallel.tensor_parallel_size}, pipeline_parallel_size={parallel.pipeline_parallel_size}"
        )
    if cache.cache_dtype != "auto":
        raise ConfigError(f"KVRayConnector needs kv_cache_dtype='auto', got {cache.cache_dtype!r}")
    if model.dtype not in DTYPE_NAMES:
        raise ConfigError(f"KVRayConnector: model dtype {model.dtype} has no kvray page layout")
    fields = {
        "layers": model.get_num_layers(parallel),
        "kv_heads": model.get_num_kv_heads(parallel),
        "head_dim": model.get_head_size(),
        "page_tokens": cache.block_size,
        "dtype": DTYPE_NAMES[model.dtype],
    }
    return validate(PageLayout, fields, source="vLLM model config")


def model_revision(vllm_config: VllmConfig, settings: ConnectorSettings) -> str:
    """The checkpoint the pages are bound to: the hub revision vLLM loaded (or the user's
    ``model_revision``) and a hash of the model config."""
    model = vllm_config.model_config
    return checkpoint_revision(model.hf_config, settings.model_revision or model.revision)


def open_store(vllm_config: VllmConfig, settings: ConnectorSettings) -> PageStore:
    """The connector's in-process store."""
    name = vllm_config.model_config.served_model_name
    config = store_config(settings, page_layout(vllm_config), name, model_revision(vllm_config, settings))
    return PageStore(config, make_policy(settings.policy))


def open_runtime(vllm_config: VllmConfig, settings: ConnectorSettings) -> RuntimePages | None:
    """The kvray runtime the settings or the environment name, if one is named and reachable."""
    target = runtime_target(settings.kvray_ray_address, settings.kvray_runtime)
    if target is None:
        return None
    name = settings.model_name or vllm_config.model_config.served_model_name
    return RuntimePages.open(target, page_layout(vllm_config), name, model_revision(vllm_config, settings))


# -- what travels between the two halves ------------------------------------------------
@dataclass
class PageLoad:
    """Staged pages to copy into ``block_ids`` (one page per block), before the forward."""

    block_ids: list[int]
    pages: np.ndarray  # [n, page_nbytes] uint8, verified


@dataclass
class PageSave:
    """Full prompt blocks to copy out after the forward, the page keys they get, and the key
    of the cached page their chain continues (``None`` from the first page)."""

    keys: list[int]
    block_ids: list[int]
    parent_key: int | None


@dataclass
class RuntimeLoad:
    """Pages the worker reads from the kvray runtime into ``block_ids``, by itself: the
    pages' keys and the scheduler's plan (the pinned lease and the node of each page)."""

    req_id: str
    keys: list[int]
    block_ids: list[int]
    plan: Any  # kvray.cluster.controller.Plan


@dataclass
class KVRayMetadata(KVConnectorMetadata):
    """What the scheduler side asks of the worker for one step: pages to load, blocks to
    save; ``on_runtime``: the worker loads and stores them on the kvray runtime itself."""

    loads: list[PageLoad] = field(default_factory=list)
    saves: list[PageSave] = field(default_factory=list)
    runtime_loads: list[RuntimeLoad] = field(default_factory=list)
    on_runtime: bool = False


@dataclass
class KVRayWorkerMetadata(KVConnectorWorkerMetadata):
    """Pages copied out of vLLM's cache this step, as (save order, ``[n, page_nbytes]`` uint8)."""

    saved: list[tuple[PageSave, np.ndarray]] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVRayWorkerMetadata)
        return KVRayWorkerMetadata(self.saved + other.saved)


@dataclass
class _Tracked:
    """Scheduler-side state of one running request."""

    keys: list[int]  # keys of the prompt's full pages
    block_ids: list[int] = field(default_factory=list)
    saved_pages: int = 0  # leading prompt pages already in kvray or handed to the worker
    cached_pages: int = 0  # leading prompt pages the runtime held at lookup


class KVRayConnector(KVConnectorBase_V1):
    """vLLM KV connector that loads cached prefixes from kvray and stores computed pages.

    Example::

        llm = LLM(model=path, enable_prefix_caching=False, kv_transfer_config=KVTransferConfig(
            kv_connector="KVRayConnector", kv_connector_module_path="kvray.engines.vllm",
            kv_role="kv_both", kv_connector_extra_config={"host_pages": 2048}))
    """

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a later miss

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = connector_settings(self._kv_transfer_config.kv_connector_extra_config)
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) != 1:
            raise ConfigError(
                f"KVRayConnector supports one KV cache group, this model has {len(kv_cache_config.kv_cache_groups)}"
            )
        self.layout = page_layout(vllm_config)
        self.counters = {"lookups": 0, "hit_pages": 0, "loaded_pages": 0, "saved_pages": 0, "failures": 0, "lost_pages": 0}
        self.counters.update({f"{path}_pages": 0 for path in LOAD_PATHS})  # runtime loads by transfer path
        self.runtime = open_runtime(vllm_config, self.settings)
        # scheduler side
        self.store: PageStore | None = None
        self._requests: dict[str, _Tracked] = {}
        self._staged: dict[str, tuple[int, int, np.ndarray]] = {}  # req -> (first page, computed, pages)
        self._loads: dict[str, tuple[int, np.ndarray]] = {}
        self._plans: dict[str, tuple[int, int, Any]] = {}  # runtime: req -> (first page, computed, plan)
        self._runtime_loads: list[RuntimeLoad] = []
        # worker side
        self._codec: BlockCodec | None = None
        self._saved: list[tuple[PageSave, np.ndarray]] = []
        self._io: ThreadPoolExecutor | None = None  # runtime: the one thread that loads and stores
        self._loading: dict[str, tuple[list[int], Future]] = {}
        self._storing: list[Future] = []
        self._failed_blocks: set[int] = set()
        if self.runtime is not None:
            self._io = ThreadPoolExecutor(1, thread_name_prefix="kvray-io") if role == KVConnectorRole.WORKER else None
            # a page that fails to arrive must mean recompute, never a failed request
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
            log.info("kvray runtime %s (node %s) for %s", self.settings.kvray_runtime, self.runtime.node_id, self.layout)
        elif role == KVConnectorRole.SCHEDULER:
            self.store = open_store(vllm_config, self.settings)
            log.info("kvray store for %s: %s, %d pages recovered", self.store.config.model_name, self.layout, len(self.store))

    # ==================================================================================
    # Scheduler side
    # ==================================================================================
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` whose pages kvray holds, read and verified now."""
        staged = self._staged.get(request.request_id)
        if staged is not None and staged[1] == num_computed_tokens:
            return len(staged[2]) * self.layout.page_tokens, False
        planned = self._plans.get(request.request_id)
        if planned is not None and planned[1] == num_computed_tokens:
            return (planned[2].hit_pages - planned[0]) * self.layout.page_tokens, True
        tracked = self._track(request)
        if tracked is None:
            return 0, False
        page = self.layout.page_tokens
        loadable = (len(request.prompt_token_ids) - 1) // page  # the last token is always computed
        first = num_computed_tokens // page
        if first >= loadable:
            return 0, False
        self.counters["lookups"] += 1
        if self.runtime is not None:
            return self._match_on_runtime(request.request_id, tracked, first, loadable, num_computed_tokens)
        try:
            found, pages = self.store.get_pages(tracked.keys[first:loadable])
        except Exception as exc:  # a cache must never fail a request: any store failure is a miss
            self.counters["failures"] += 1
            log.warning("kvray lookup failed, request %s recomputes: %r", request.request_id, exc)
            return 0, False
        if not found:
            return 0, False
        self.counters["hit_pages"] += len(found)
        self._staged[request.request_id] = (first, num_computed_tokens, pages)
        return len(found) * page, False

    def _match_on_runtime(self, req_id: str, tracked: _Tracked, first: int, loadable: int, computed: int) -> tuple[int, bool]:
        """Pin the runtime's cached prefix; its pages beyond ``first`` load asynchronously."""
        if (stale := self._plans.pop(req_id, None)) is not None:
            self.runtime.release(stale[2])
        plan = self.runtime.lookup(tracked.keys[:loadable])
        tracked.cached_pages = max(tracked.cached_pages, plan.hit_pages)
        if plan.hit_pages <= first:
            self.runtime.release(plan)
            return 0, False
        self.counters["hit_pages"] += plan.hit_pages - first
        self._plans[req_id] = (first, computed, plan)
        return (plan.hit_pages - first) * self.layout.page_tokens, True

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        staged = self._staged.pop(request.request_id, None)
        if staged is not None and num_external_tokens > 0:
            first, _, pages = staged
            self._loads[request.request_id] = (first, pages[: num_external_tokens // self.layout.page_tokens])
        planned = self._plans.pop(request.request_id, None)
        if planned is None:
            return
        first, _, plan = planned
        n = num_external_tokens // self.layout.page_tokens
        if n == 0:
            self.runtime.release(plan)
            return
        from kvray.cluster.protocol import Plan

        tracked = self._requests[request.request_id]
        block_ids = blocks.get_block_ids()[0][first : first + n]
        sub = Plan(plan.lease, plan.hit_nodes[first : first + n], [])  # the worker ends the whole lease
        self._runtime_loads.append(RuntimeLoad(request.request_id, tracked.keys[first : first + n], block_ids, sub))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
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

    def _plan_load(self, meta: KVRayMetadata, req_id: str, tracked: _Tracked) -> None:
        """Hand the pages staged for ``req_id`` to the worker, with the blocks they fill."""
        load = self._loads.pop(req_id, None)
        if load is not None:
            first, pages = load
            meta.loads.append(PageLoad(tracked.block_ids[first : first + len(pages)], pages))
            self.counters["loaded_pages"] += len(pages)

    def _plan_save(self, meta: KVRayMetadata, req_id: str, tracked: _Tracked, computed: int, out) -> None:
        """Ask the worker for the prompt pages that become complete in this step and that
        kvray does not hold yet (pages it just loaded, for instance, are skipped)."""
        done = min((computed + out.num_scheduled_tokens.get(req_id, 0)) // self.layout.page_tokens, len(tracked.keys))
        cached = tracked.cached_pages if self.runtime is not None else self.store.match(tracked.keys[:done])
        first = max(tracked.saved_pages, cached)
        tracked.saved_pages = max(tracked.saved_pages, done)
        if first < done:
            parent = tracked.keys[first - 1] if first else None
            meta.saves.append(PageSave(tracked.keys[first:done], tracked.block_ids[first:done], parent))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        worker = connector_output.kv_connector_worker_meta
        if not isinstance(worker, KVRayWorkerMetadata):
            return
        for save, pages in worker.saved:
            try:
                stored = self.store.put_pages(save.keys, pages, self.store.fingerprint.digest, save.parent_key)
            except Exception as exc:  # storing is best effort: the pages are simply not cached
                self.counters["failures"] += 1
                log.warning("kvray could not store %d pages: %r", len(save.keys), exc)
            else:
                self.counters["saved_pages"] += stored

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._forget(request.request_id)
        return False, None

    def _track(self, request: Request) -> _Tracked | None:
        """State of a request whose KV depends on its token ids alone; ``None`` for the rest
        (images or other multimodal inputs, prompt embeddings, LoRA adapters), which kvray
        neither loads nor stores, since equal tokens would not mean equal KV."""
        tracked = self._requests.get(request.request_id)
        if tracked is None:
            if not request.prompt_token_ids or request.mm_features or request.lora_request is not None:
                return None
            if request.prompt_embeds is not None:
                return None
            salt = self.settings.salt if request.cache_salt is None else f"{self.settings.salt}|{request.cache_salt}"
            pages = self.runtime if self.runtime is not None else self.store
            keys = pages.keys(np.asarray(request.prompt_token_ids, dtype=np.int32), salt=salt)
            tracked = self._requests[request.request_id] = _Tracked(keys)
        return tracked

    def _forget(self, req_id: str) -> None:
        self._requests.pop(req_id, None)
        self._staged.pop(req_id, None)
        self._loads.pop(req_id, None)
        if (planned := self._plans.pop(req_id, None)) is not None:
            self.runtime.release(planned[2])

    def shutdown(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None
        if self._io is not None:
            self._io.shutdown(wait=True)  # pending loads and stores finish first
            self._io = None
        if self.runtime is not None:
            self.runtime.close()
            self.runtime = None

    # ==================================================================================
    # Worker side
    # ==================================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        context = self._vllm_config.compilation_config.static_forward_context
        backends = {context[name].attn_backend.get_name() for name in kv_caches}
        if len(backends) != 1:
            raise ConfigError(f"KVRayConnector needs one attention backend for all layers, got {sorted(backends)}")
        self._codec = BlockCodec(backends.pop(), list(kv_caches.values()), self.layout)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVRayMetadata)
        for load in meta.loads:
            self._write_blocks(load.block_ids, load.pages)
        for load in meta.runtime_loads:
            if self._io is None:  # this worker could not reach the runtime: every page is a miss
                self._loading[load.req_id] = (load.block_ids, _done(0))
            else:
                self._loading[load.req_id] = (load.block_ids, self._io.submit(self._load_from_runtime, load))

    def _write_blocks(self, block_ids: list[int], pages: np.ndarray) -> None:
        """Copy verified pages (``[n, page_nbytes]`` uint8) into vLLM's blocks ``block_ids``."""
        tensor = torch.from_numpy(pages).view(torch_dtype(self.layout))
        self._codec.write(block_ids, tensor.view(len(block_ids), *self.layout.page_shape))

    def _load_from_runtime(self, load: RuntimeLoad) -> int:
        """On the I/O thread: read the plan's pages (mapped host tier, or TCP from a peer)
        straight into the request's blocks; returns how many leading blocks hold their page."""
        loaded, pages = self.runtime.read(load.keys, load.plan)
        if loaded.pages:
            self._write_blocks(load.block_ids[: loaded.pages], pages)
        self.counters["loaded_pages"] += loaded.pages
        self.counters["lost_pages"] += len(load.keys) - loaded.pages
        for path, n in loaded.paths.items():
            self.counters[f"{path}_pages"] += n
        return loaded.pages

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose runtime load ended; the blocks of pages that did not arrive are
        reported by ``get_block_ids_with_load_errors`` in the same step."""
        done = set()
        for req_id, (block_ids, future) in list(self._loading.items()):
            if not future.done():
                continue
            try:
                loaded = future.result()
            except Exception as exc:  # a cache must never fail a request: the blocks are recomputed
                self.counters["failures"] += 1
                log.warning("kvray load for request %s failed, it recomputes: %r", req_id, exc)
                loaded = 0
            self._failed_blocks.update(block_ids[loaded:])
            del self._loading[req_id]
            done.add(req_id)
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # synchronous loads finish in start_load_kv, before the forward pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole blocks are copied out once all layers are written, in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVRayMetadata)
        for save in meta.saves:
            pages = self._codec.read(save.block_ids).contiguous()
            raw = pages.view(torch.uint8).reshape(len(save.keys), -1).numpy()
            if not meta.on_runtime:
                self._saved.append((save, raw))
            elif self._io is not None:  # the copy above is the worker's own: blocks may be reused now
                self._storing = [f for f in self._storing if not f.done()]
                self._storing.append(self._io.submit(self._store_on_runtime, save, raw))

    def _store_on_runtime(self, save: PageSave, raw: np.ndarray) -> None:
        """On the I/O thread: keep computed pages on this node's store (best effort)."""
        try:
            self.counters["saved_pages"] += self.runtime.put_pages(
                save.keys, raw, self.runtime.fingerprint.digest, save.parent_key
            )
        except Exception as exc:  # storing is best effort: the pages are simply not cached
            self.counters["failures"] += 1
            log.warning("kvray could not store %d pages on the runtime: %r", len(save.keys), exc)

    def flush(self) -> None:
        """Wait for this worker's loads and stores in flight (tests, benchmarks, shutdown)."""
        for future in [*self._storing, *(f for _, f in self._loading.values())]:
            future.exception()
        self._storing = []

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if not self._saved:
            return None
        meta, self._saved = KVRayWorkerMetadata(self._saved), []
        return meta


def _done(result: int) -> Future:
    future: Future = Future()
    future.set_result(result)
    return future
