"""What the connector's two sides pass each other, and the counters both keep.

vLLM carries :class:`KVRayMetadata` from the scheduler side to the worker side with every
step, and :class:`KVRayWorkerMetadata` back in the step's output, whether the worker
shares the scheduler's process or not. With an in-process store, page bytes travel inside
them (staged pages down, computed pages up); on a kvray runtime only keys, block ids and
the lookup's plan do, and the worker moves the bytes itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

if TYPE_CHECKING:
    from kvray.cluster.protocol import Plan

LOAD_PATHS = ("mapped", "local", "tcp", "object_store", "collective")  # see kvray.cluster.client


def new_counters() -> dict[str, int]:
    """One side's counters, all at zero. Both sides keep the same names, so that the sum
    of the two (what a test or benchmark reads) has every one: the scheduler counts
    lookups and hits (and, with an in-process store, pages loaded and saved), the worker
    what it loaded and stored on a kvray runtime (``<path>_pages``: pages by transfer
    path; ``lost_pages``: pages a plan promised that did not arrive); ``lookup_us`` and
    ``load_us``: wall time the scheduler side spent looking prefixes up (in-process: read
    and verified too) and the worker copying or reading pages into blocks, so a served
    benchmark can split a request's TTFT. The cluster policy's verbs
    (:mod:`kvray.engines.vllm.verbs`): ``decisions`` asked, ``recomputed_hit_pages`` (cached
    pages vLLM computed as a load split told it), ``prefetched_pages`` (copied to this node
    while the request waited), ``replicated_pages`` (copied after loading to the nodes the policy named, by the worker)."""
    counters = {"lookups": 0, "hit_pages": 0, "loaded_pages": 0, "saved_pages": 0, "failures": 0, "lost_pages": 0,
                "lookup_us": 0, "load_us": 0, "decisions": 0, "recomputed_hit_pages": 0, "prefetched_pages": 0,
                "replicated_pages": 0}  # fmt: skip
    counters.update({f"{path}_pages": 0 for path in LOAD_PATHS})
    return counters


@dataclass(frozen=True)
class PageLoad:
    """Staged pages to copy into ``block_ids`` (one page per block), before the forward."""

    block_ids: list[int]
    pages: np.ndarray  # [n, page_nbytes] uint8, verified


@dataclass(frozen=True)
class PageSave:
    """Full prompt blocks to copy out after the forward, the page keys they get, the key
    of the cached page their chain continues (``None`` from the first page) and, on a kvray
    runtime, the key the prompt's chain is routed by
    (:meth:`~kvray.engines.runtime.RuntimePages.route_key`): the pages commit to the
    controller shard the prompt's lookups ask, whichever part of it they are."""

    keys: list[int]
    block_ids: list[int]
    parent_key: int | None
    route_key: int | None = None


@dataclass(frozen=True)
class RuntimeLoad:
    """Pages the worker reads from the kvray runtime into ``block_ids``, by itself: the
    pages' keys and the scheduler's plan (the pinned lease and the node of each page);
    ``replicate``: then copy them to these nodes' stores (the cluster policy's verb)."""

    req_id: str
    keys: list[int]
    block_ids: list[int]
    plan: Plan
    replicate: tuple[str, ...] = ()


@dataclass(frozen=True)
class SavedPages:
    """Pages the worker copied out of vLLM's cache for one :class:`PageSave`."""

    save: PageSave
    pages: np.ndarray  # [n, page_nbytes] uint8, the worker's own copy


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
    """Pages copied out of vLLM's cache this step, for the scheduler side to store."""

    saved: list[SavedPages] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVRayWorkerMetadata)
        return KVRayWorkerMetadata(self.saved + other.saved)
