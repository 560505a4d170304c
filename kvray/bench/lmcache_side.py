"""LMCache's side of ``kvray bench --only lmcache``, run by the LMCache environment's Python.

LMCache's storage engine (``LMCacheEngine`` with its unchanged ``local_cpu`` and
``local_disk`` backends) is driven here without a GPU: the connector it calls to move KV
between the engine and its memory objects is replaced by :class:`TensorConnector`, which
copies between CPU tensors. Run as a script, so it imports only LMCache, torch, numpy
and :mod:`side_by_side` (its own directory is on the path).
"""

from __future__ import annotations

import os
import time

import numpy as np
import side_by_side as sbs
import torch
from lmcache.v1.cache_engine import LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.metadata import LMCacheMetadata

CHUNK_BYTES = sbs.REQUEST_BYTES // (sbs.PROMPT_TOKENS // sbs.CHUNK_TOKENS)


class TensorConnector(GPUConnectorInterface):
    """Copies a request's KV (``kv=`` ``[layers, 2, tokens, heads, dim]``, on the CPU) into
    and out of LMCache's memory objects (``[2, layers, tokens, heads * dim]``).

    The copy is numpy's strided ``copyto`` over 16-bit views, the primitive kvray's host
    tier uses, so the two sides differ in their storage engines, not in the memcpy:
    torch's ``copy_`` of the transposed view ran several times slower on this machine.
    """

    def __init__(self) -> None:
        self.kvcaches = None

    @staticmethod
    def _views(memory_obj, kv: torch.Tensor, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """(the memory object, the request's tokens start:end), as same-shaped int16 arrays."""
        chunk = memory_obj.tensor.view(torch.int16).numpy().reshape(2, sbs.LAYERS, end - start, sbs.KV_HEADS, sbs.HEAD_DIM)
        return chunk, kv.view(torch.int16).numpy()[:, :, start:end].transpose(1, 0, 2, 3, 4)

    def from_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
        chunk, request = self._views(memory_obj, kwargs["kv"], start, end)
        np.copyto(chunk, request)

    def to_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
        chunk, request = self._views(memory_obj, kwargs["kv"], start, end)
        np.copyto(request, chunk)

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends):
            self.from_gpu(memory_obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends):
            self.to_gpu(memory_obj, start, end, **kwargs)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, sbs.LAYERS, num_tokens, sbs.KV_HEADS * sbs.HEAD_DIM])


class LMCacheSide:
    """One ``LMCacheEngine`` at a time: CPU pool only, or disk behind a staging pool."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        shape = (sbs.LAYERS, 2, sbs.PROMPT_TOKENS, sbs.KV_HEADS, sbs.HEAD_DIM)
        self.kv = torch.randn(shape).to(torch.bfloat16)
        self.out = torch.zeros_like(self.kv)  # resident before timing, as sbs.Side asks
        self.engine = None
        self.directory: str | None = None

    def _open(self, **config) -> None:
        metadata = LMCacheMetadata(
            model_name="bench", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
            kv_dtype=torch.bfloat16, kv_shape=(sbs.LAYERS, 2, sbs.CHUNK_TOKENS, sbs.KV_HEADS, sbs.HEAD_DIM),
        )  # fmt: skip
        cfg = LMCacheEngineConfig.from_defaults(chunk_size=sbs.CHUNK_TOKENS, save_unfull_chunk=False, **config)
        self.engine = LMCacheEngineBuilder.get_or_create("bench", cfg, metadata, TensorConnector(), None, None)
        self.engine.post_init()

    def open_host(self, chunks: int) -> None:
        self._open(local_cpu=True, max_local_cpu_size=chunks * CHUNK_BYTES / 2**30, local_disk=None)

    def open_disk(self, directory: str, chunks: int) -> None:
        """Disk behind a CPU pool that only stages (``local_cpu=False``): sized for every chunk
        in flight, since a smaller one makes ``store`` drop chunks while writes are queued."""
        self.directory = directory
        size = chunks * CHUNK_BYTES / 2**30
        self._open(local_cpu=False, max_local_cpu_size=size, local_disk=f"file://{directory}/", max_local_disk_size=2 * size)

    def store(self, tokens: np.ndarray) -> None:
        self.engine.store(torch.from_numpy(tokens), kv=self.kv)

    def flush(self) -> None:
        """Wait until the disk backend's asynchronous writes have finished."""
        disk = self.engine.storage_manager.storage_backends["LocalDiskBackend"]
        while disk.disk_worker.put_tasks:
            time.sleep(0.0005)

    def retrieve(self, tokens: np.ndarray) -> int:
        return int(self.engine.retrieve(torch.from_numpy(tokens), kv=self.out).sum())

    def lookup(self, tokens: np.ndarray | list[int]) -> int:
        return self.engine.lookup(torch.from_numpy(tokens) if isinstance(tokens, np.ndarray) else tokens)

    def files(self) -> list[str]:
        return [os.path.join(root, name) for root, _, names in os.walk(self.directory or "") for name in names]

    def close(self) -> None:
        LMCacheEngineBuilder.destroy("bench")
        self.engine = None


if __name__ == "__main__":
    sbs.main(LMCacheSide)
