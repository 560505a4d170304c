"""The connector's worker side: pages into and out of vLLM's paged KV cache.

With an **in-process store** this side never talks to the store: it copies the pages the
scheduler side staged into the request's blocks before the forward pass, and copies newly
computed full blocks out after it; the copies go up in the step's output
(:mod:`kvray.engines.vllm.metadata`).

On a **kvray runtime** it moves the bytes itself, off vLLM's thread:

- it reads the pages of each plan the scheduler side made (from its node's mapped host
  tier, or by TCP from a peer node's page server) straight into the request's blocks, and
  reports the request in ``get_finished``. A page that does not arrive is reported with its
  block in ``get_block_ids_with_load_errors``, and vLLM (with
  ``kv_load_failure_policy="recompute"``, which the connector sets) recomputes from there:
  a shorter hit, never a failed request or wrong KV;
- it stores newly computed full blocks on its node's store, on a thread and client of
  their own: a store waits for the store actor's answer (about 50 ms per request on the
  served benchmark's agents at capacity, 15% of the I/O thread's time), and a load that
  queued behind it held the next request, whose blocks are allocated, out of the engine.

``on_load_end``, where set, runs on the I/O thread as each runtime load ends: an engine loop
with nothing to step while loads run (:mod:`kvray.harness.vllm_serving`) sleeps until then
instead of stepping vLLM empty every few milliseconds to learn it.

Pages hold K and V as ``[layers, 2, block_size, kv_heads, head_dim]`` whatever the
attention backend's physical block layout; :class:`~kvray.engines.vllm.codec.BlockCodec`
converts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvray.core.config import PageLayout
from kvray.core.errors import ConfigError
from kvray.engines.runtime import RuntimePages
from kvray.engines.vllm.codec import BlockCodec
from kvray.engines.vllm.metadata import KVRayMetadata, KVRayWorkerMetadata, PageSave, RuntimeLoad, SavedPages, new_counters

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from kvray.cluster.protocol import Loaded

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadInFlight:
    """A request's runtime load on the I/O thread: the blocks it fills, and how many leading
    ones got their page once it ends."""

    block_ids: list[int]
    loaded: Future  # -> int


class ConnectorWorker:
    """The worker side (see the module docstring); ``runtime``: the kvray runtime this
    worker reached, ``None`` with an in-process store (or when the runtime was not
    reachable from here: every page it is asked to read is then a miss).

    Example::

        worker = ConnectorWorker(vllm_config, layout, runtime=None)
        worker.register_kv_caches(kv_caches)
        worker.start_load_kv(metadata)            # before the forward pass
        worker.wait_for_save(metadata)            # after it
    """

    def __init__(self, vllm_config: VllmConfig, layout: PageLayout, runtime: RuntimePages | None) -> None:
        self.vllm_config = vllm_config
        self.layout = layout
        self.runtime = runtime
        self.counters = new_counters()
        self.codec: BlockCodec | None = None
        self._io = ThreadPoolExecutor(1, thread_name_prefix="kvray-io") if runtime is not None else None  # loads
        self._store_io, self._storer = self._open_storer()
        self._saved: list[SavedPages] = []
        self._loading: dict[str, LoadInFlight] = {}
        self._storing: list[Future] = []
        self._failed_blocks: set[int] = set()
        self.on_load_end: Callable[[], None] | None = None  # runs as each runtime load ends (module docstring)

    def _open_storer(self) -> tuple[ThreadPoolExecutor | None, RuntimePages | None]:
        """The thread and runtime handle stores use (see the module docstring); the loads'
        own when a second client cannot be opened."""
        if self.runtime is None:
            return None, None
        try:
            return ThreadPoolExecutor(1, thread_name_prefix="kvray-store"), self.runtime.twin()
        except Exception as exc:  # stores then wait behind loads, as one client must
            log.warning("kvray: no second runtime client for stores (%r): they share the loads' thread", exc)
            return self._io, self.runtime

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        context = self.vllm_config.compilation_config.static_forward_context
        backends = {context[name].attn_backend.get_name() for name in kv_caches}
        if len(backends) != 1:
            raise ConfigError(f"KVRayConnector needs one attention backend for all layers, got {sorted(backends)}")
        self.codec = BlockCodec(backends.pop(), list(kv_caches.values()), self.layout)

    def start_load_kv(self, meta: KVRayMetadata) -> None:
        """Copy staged pages into their blocks now; start the step's runtime loads."""
        started = time.perf_counter()
        for load in meta.loads:
            self.codec.write_bytes(load.block_ids, load.pages)
        self.counters["load_us"] += int((time.perf_counter() - started) * 1e6)
        for load in meta.runtime_loads:
            if self._io is None:  # this worker could not reach the runtime: every page is a miss
                self._loading[load.req_id] = LoadInFlight(load.block_ids, _done(0))
            else:
                future = self._io.submit(self._load_from_runtime, load)
                if self.on_load_end is not None:  # once it ended: the next step's get_finished reports it
                    future.add_done_callback(lambda _: self.on_load_end())
                self._loading[load.req_id] = LoadInFlight(load.block_ids, future)

    def _load_from_runtime(self, load: RuntimeLoad) -> int:
        """On the I/O thread: read the plan's pages (mapped host tier, or TCP from a peer)
        straight into the request's blocks; returns how many leading blocks hold their page."""
        started = time.perf_counter()
        loaded, pages = self.runtime.read(load.keys, load.plan)
        if loaded.pages:
            try:
                self.codec.write_bytes(load.block_ids[: loaded.pages], pages)
            finally:  # also when a copy failed: those queued must land before vLLM recomputes the blocks
                self.codec.wait_for_writes()  # this thread's stream: the forward's does not wait for it
        del pages  # a view of the client's buffer: none kept while the copies below run
        self.counters["load_us"] += int((time.perf_counter() - started) * 1e6)
        self.counters["loaded_pages"] += loaded.pages
        self.counters["lost_pages"] += len(load.keys) - loaded.pages
        for path, n in loaded.paths.items():
            self.counters[f"{path}_pages"] += n
        if load.replicate and loaded.pages:
            self._replicate(load, loaded)
        return loaded.pages

    def _replicate(self, load: RuntimeLoad, loaded: Loaded) -> None:
        """Copy the pages just read to the stores of the nodes the cluster policy's
        ``replicate`` named, from the client's buffer that still holds them; best effort."""
        try:
            self.counters["replicated_pages"] += sum(
                self.runtime.client.replicate(load.keys, load.plan, loaded, load.replicate).values()
            )
        except Exception as exc:  # a copy not kept is a later remote read, never a failed request
            self.counters["failures"] += 1
            log.warning("kvray could not copy %d pages to %s: %r", loaded.pages, ", ".join(load.replicate), exc)

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose runtime load ended; the blocks of pages that did not arrive are
        reported by ``get_block_ids_with_load_errors`` in the same step."""
        done = set()
        for req_id, load in list(self._loading.items()):
            if not load.loaded.done():
                continue
            try:
                loaded = load.loaded.result()
            except Exception as exc:  # a cache must never fail a request: the blocks are recomputed
                self.counters["failures"] += 1
                log.warning("kvray load for request %s failed, it recomputes: %r", req_id, exc)
                loaded = 0
            self._failed_blocks.update(load.block_ids[loaded:])
            del self._loading[req_id]
            done.add(req_id)
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def wait_for_save(self, meta: KVRayMetadata) -> None:
        """Copy the step's completed prompt blocks out (all layers are written by now): up to
        the scheduler side with the step's output, or onto the runtime by the store thread."""
        for save in meta.saves:
            pages = self.codec.read_bytes(save.block_ids)
            if not meta.on_runtime:
                self._saved.append(SavedPages(save, pages))
            elif self._store_io is not None:  # the copy above is the worker's own: blocks may be reused now
                # the loads' latest touch of this node (this request's hits): the write waits for it
                touch = self.runtime.client.last_touch if self._storer is not self.runtime else None
                self._storing = [f for f in self._storing if not f.done()]
                self._storing.append(self._store_io.submit(self._store_on_runtime, save, pages, touch))

    def _store_on_runtime(self, save: PageSave, pages: np.ndarray, touch) -> None:
        """On the store thread: keep computed pages on this node's store (best effort), after
        ``touch`` (the loads' client's, so the node's policy sees the hits first)."""
        storer = self._storer
        try:
            storer.client.follow(touch)
            self.counters["saved_pages"] += storer.put_pages(
                save.keys, pages, storer.fingerprint.digest, save.parent_key, save.route_key
            )
        except Exception as exc:  # storing is best effort: the pages are simply not cached
            self.counters["failures"] += 1
            log.warning("kvray could not store %d pages on the runtime: %r", len(save.keys), exc)

    def flush(self) -> None:
        """Wait for this worker's loads and stores in flight (tests, benchmarks, shutdown)."""
        for future in [*self._storing, *(load.loaded for load in self._loading.values())]:
            future.exception()
        self._storing = []

    def build_connector_worker_meta(self) -> KVRayWorkerMetadata | None:
        if not self._saved:
            return None
        meta, self._saved = KVRayWorkerMetadata(self._saved), []
        return meta

    def shutdown(self) -> None:
        for pool in {self._io, self._store_io} - {None}:
            pool.shutdown(wait=True)  # pending loads and stores finish first
        self._io = self._store_io = None
        if self._storer is not None and self._storer is not self.runtime:
            self._storer.close()
        self._storer = None
        if self.runtime is not None:
            self.runtime.close()
            self.runtime = None


def _done(result: int) -> Future:
    future: Future = Future()
    future.set_result(result)
    return future
