"""``KVRayConnector``: vLLM's KV connector API (``KVConnectorBase_V1``) backed by kvray.

Load it with::

    KVTransferConfig(kv_connector="KVRayConnector", kv_connector_module_path="kvray.engines.vllm.connector",
                     kv_role="kv_both", kv_connector_extra_config={"host_pages": 4096})

(:func:`kv_transfer_config` writes that). vLLM makes one per role; this class is the
facade vLLM calls, as its own connectors are: it checks the engine's configuration once,
opens the pages and builds the side of its role, the scheduler's
(:class:`~kvray.engines.vllm.scheduler.ConnectorScheduler`, which owns an in-process
:class:`~kvray.core.store.PageStore`) or a worker's
(:class:`~kvray.engines.vllm.worker.ConnectorWorker`), and hands each call to it. The two
sides talk only through the metadata vLLM carries with each step
(:mod:`kvray.engines.vllm.metadata`), which works whether the worker shares the
scheduler's process or not.

On a **kvray runtime** (``kvray_runtime`` / ``kvray_ray_address`` in the extra config, or
``$KVRAY_RUNTIME`` / ``$KVRAY_RAY_ADDRESS``; :mod:`kvray.engines.runtime`) every engine
instance on every node shares one cache: the scheduler side pins the cached prefix and the
worker side reads it and stores new pages itself, so no page byte passes between the
sides; the runtime's cluster policy decides how much of a hit to load, prefetch and
replication (:mod:`kvray.engines.vllm.verbs`). A runtime that cannot be reached leaves the engine on its in-process store.

Pages hold K and V as ``[layers, 2, block_size, kv_heads, head_dim]`` (kvray's canonical
page layout, the same as the transformers adapter's); the page size is vLLM's block size.

Scope: one worker (tensor and pipeline parallel size 1), one full-attention KV cache group,
``kv_cache_dtype="auto"``, attention backends ``CPU_ATTN`` and ``FLASH_ATTN``. Anything else
is refused at start-up with a :class:`~kvray.core.errors.ConfigError` naming it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvray.core.config import PageLayout, validate
from kvray.core.errors import ConfigError
from kvray.core.store import PageStore
from kvray.engines.hf import DTYPE_NAMES
from kvray.engines.revision import checkpoint_revision
from kvray.engines.runtime import RuntimePages, runtime_target
from kvray.engines.vllm.metadata import KVRayMetadata
from kvray.engines.vllm.scheduler import ConnectorScheduler
from kvray.engines.vllm.settings import ConnectorSettings, connector_settings, store_config
from kvray.engines.vllm.verbs import wants_verbs
from kvray.engines.vllm.worker import ConnectorWorker
from kvray.policy import make_policy

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


def kv_transfer_config(settings: dict[str, Any] | None) -> KVTransferConfig:
    """vLLM's ``kv_transfer_config`` that loads ``KVRayConnector`` with ``settings`` as its
    ``kv_connector_extra_config`` (:class:`~kvray.engines.vllm.settings.ConnectorSettings`)."""
    return KVTransferConfig(
        kv_connector=KVRayConnector.__name__,
        kv_connector_module_path=__name__,
        kv_role="kv_both",
        kv_connector_extra_config=settings,
    )


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
    ``model_revision``), a hash of the model config and of the quantization vLLM runs the
    weights with (its method, which vLLM also sets for a checkpoint quantized beforehand and
    names per platform, and the settings given with it)."""
    model = vllm_config.model_config
    quantization = (model.quantization, model.quantization_config) if model.quantization else None
    return checkpoint_revision(model.hf_config, settings.model_revision or model.revision, quantization)


def open_store(vllm_config: VllmConfig, settings: ConnectorSettings) -> PageStore:
    """The scheduler side's in-process store."""
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


class KVRayConnector(KVConnectorBase_V1):
    """vLLM KV connector that loads cached prefixes from kvray and stores computed pages.

    Example::

        llm = LLM(model=path, enable_prefix_caching=False, kv_transfer_config=kv_transfer_config({"host_pages": 2048}))
        llm.llm_engine.engine_core.engine_core.scheduler.get_kv_connector().counters["loaded_pages"]
    """

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a later miss

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        settings = connector_settings(self._kv_transfer_config.kv_connector_extra_config)
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) != 1:
            raise ConfigError(
                f"KVRayConnector supports one KV cache group, this model has {len(kv_cache_config.kv_cache_groups)}"
            )
        layout = page_layout(vllm_config)
        runtime = open_runtime(vllm_config, settings)
        if runtime is not None:
            # a page that fails to arrive must mean recompute, never a failed request
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
            log.info("kvray runtime %s (node %s) for %s", settings.kvray_runtime, runtime.node_id, layout)
        self.connector_scheduler: ConnectorScheduler | None = None
        self.connector_worker: ConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            store = None
            if runtime is None:
                store = open_store(vllm_config, settings)
                log.info("kvray store for %s: %s, %d pages recovered", store.config.model_name, layout, len(store))
            verbs = runtime is not None and wants_verbs(runtime, settings.cluster_verbs)
            self.connector_scheduler = ConnectorScheduler(layout, settings.salt, store, runtime, verbs)
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = ConnectorWorker(vllm_config, layout, runtime)

    @property
    def scheduler(self) -> ConnectorScheduler:
        """This connector's scheduler side (the scheduler's connector only)."""
        assert self.connector_scheduler is not None, "not the scheduler's connector"
        return self.connector_scheduler

    @property
    def worker(self) -> ConnectorWorker:
        """This connector's worker side (a worker's connector only)."""
        assert self.connector_worker is not None, "not a worker's connector"
        return self.connector_worker

    @property
    def counters(self) -> dict[str, int]:
        """This side's counters (:func:`~kvray.engines.vllm.metadata.new_counters`)."""
        side = self.connector_scheduler if self.connector_scheduler is not None else self.connector_worker
        return side.counters

    def shutdown(self) -> None:
        if self.connector_scheduler is not None:
            self.connector_scheduler.shutdown()
        if self.connector_worker is not None:
            self.connector_worker.shutdown()

    # -- scheduler side ----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def on_new_request(self, request: Request) -> None:
        self.scheduler.on_new_request(request)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    # -- worker side -------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker.start_load_kv(self._metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # synchronous loads finish in start_load_kv, before the forward pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # whole blocks are copied out once all layers are written, in wait_for_save

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self._metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.get_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return None if self.connector_worker is None else self.connector_worker.build_connector_worker_meta()

    def _metadata(self) -> KVRayMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVRayMetadata)
        return meta
