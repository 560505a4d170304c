"""PageStore: an in-process tiered KV page store that an engine can embed.

It joins the three parts of the design: chained keys (:mod:`kvray.keys`), the control
plane (:class:`~kvray.manager.CacheManager`: index, slot accounting, policy) and the data
plane (the tier pools holding bytes). Its verbs work on whole requests:

- ``store(tokens, kv)``: keep the KV of every full page not cached yet.
- ``lookup(tokens)``: how many leading tokens are cached (no bytes move).
- ``load(tokens)``: the KV of the longest cached prefix, checksum-verified.
- ``put_pages`` / ``get_pages``: the same by keys and raw page bytes, for the runtime's
  transfers between nodes (pages travel with their model fingerprint).
- ``read_pages(keys, targets)``: the primitive under ``load`` and ``get_pages``, for
  engines with their own cache layout (vLLM's paged blocks): it scatters each page into
  the byte runs the caller names.

A page moves as the list of contiguous byte runs it is made of in the caller's memory
(:func:`kvray.pages.page_chunks`), so storing or loading is one copy (memory tiers) or one
``pwritev``/``preadv`` (disk) per page, with its checksum. Pages read are pinned until
copied out; a page that fails its checksum is counted, dropped (with its descendants) and
never returned, so a load yields a shorter prefix, never wrong KV. A request whose input
is invalid raises before anything stored is touched.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvray.config import StoreConfig
from kvray.errors import FingerprintMismatch, LayoutError, StorageError
from kvray.index import ROOT
from kvray.keys import ModelFingerprint, as_token_array, page_keys
from kvray.manager import CacheManager
from kvray.pages import check_request_kv, checksum, copy_bytes, page_chunks, request_bytes, slot_runs, torch_dtype, transfer
from kvray.policy import PageContext, PlacementPolicy, make_policy
from kvray.tiers import DevicePool, DiskPool, HostPool, StoredPage, Tier

Chunks = list[np.ndarray]  # flat uint8 host arrays whose concatenation is one page
ChunkSource = Callable[[int], Chunks]  # page index within the request -> its chunks


@dataclass(frozen=True)
class LoadResult:
    """KV of a request's longest cached prefix."""

    tokens: int  # leading tokens whose KV is in ``kv``
    kv: torch.Tensor  # [layers, 2, tokens, kv_heads, head_dim]
    pages_by_tier: dict[str, int]


class PageStore:
    """Tiered page store for one model layout.

    Example::

        store = PageStore(StoreConfig(layout=layout, tiers=TierSizes(host=64, disk=1024), disk_dir="kv"))
        store.store(tokens, kv)                 # kv: [layers, 2, len(tokens), kv_heads, head_dim]
        hit = store.load(tokens)
        hit.tokens, hit.kv.shape
    """

    def __init__(self, config: StoreConfig, policy: PlacementPolicy | None = None) -> None:
        self.config = config
        self.layout = config.layout
        self.fingerprint = ModelFingerprint.of(config.layout, config.model_name)
        nbytes = self.layout.page_nbytes
        sizes = config.tiers
        self.pools: dict[Tier, DevicePool | HostPool | DiskPool] = {}
        if sizes.device:
            self.pools[Tier.DEVICE] = DevicePool(sizes.device, nbytes)
        if sizes.host:
            self.pools[Tier.HOST] = HostPool(sizes.host, nbytes, shared_name=config.host_shared_memory)
        recovered: list[StoredPage] = []
        if sizes.disk:
            disk = DiskPool(config.disk_dir, sizes.disk, nbytes, self.fingerprint.digest, fsync=config.disk_fsync)
            self.pools[Tier.DISK] = disk
            recovered = disk.scan()
        self.manager = CacheManager(
            {Tier.DEVICE: sizes.device, Tier.HOST: sizes.host, Tier.DISK: sizes.disk},
            policy or make_policy(config.policy),
            page_nbytes=nbytes,
            used_slots={Tier.DISK: [p.slot for p in recovered]},
        )
        self.manager.slot_freed = self._slot_freed
        self.metrics = self.manager.metrics
        self._lock = threading.RLock()
        self._recover(recovered)

    def _recover(self, pages: list[StoredPage]) -> None:
        """Re-index pages found on disk, parents first; free those whose parent is gone."""
        children: dict[int | None, list[StoredPage]] = defaultdict(list)
        for page in pages:
            children[page.parent_key].append(page)
        stack = [(page, ROOT) for page in children.pop(None, [])]
        while stack:
            page, parent = stack.pop()
            handle = self.manager.restore(page.key, Tier.DISK, page.slot, page.checksum, parent=parent)
            stack.extend((child, handle) for child in children.pop(page.key, []))
        for orphans in children.values():
            for page in orphans:
                self.manager.abort_store(Tier.DISK, page.slot)

    # -- keys ----------------------------------------------------------------------------
    def keys(self, tokens: Sequence[int] | np.ndarray, salt: str = "") -> list[int]:
        return page_keys(tokens, self.fingerprint, salt, max_tokens=self.config.max_request_tokens)

    # -- request verbs -------------------------------------------------------------------
    def lookup(self, tokens: Sequence[int] | np.ndarray, salt: str = "") -> int:
        """Leading tokens of ``tokens`` whose KV is cached (counts as a lookup, moves nothing)."""
        keys = self.keys(tokens, salt)
        with self._lock:
            return self.manager.index.match(keys) * self.layout.page_tokens

    def store(self, tokens: Sequence[int] | np.ndarray, kv: torch.Tensor, salt: str = "", priority: int = 0) -> int:
        """Keep the KV of each full page of ``tokens`` that is not cached yet; returns pages stored."""
        arr = as_token_array(tokens, self.config.max_request_tokens)
        check_request_kv(self.layout, kv, arr.size)
        kv_bytes = request_bytes(kv)
        return self._store_pages(self.keys(arr, salt), lambda i: page_chunks(self.layout, kv_bytes, i), priority)

    def load(
        self, tokens: Sequence[int] | np.ndarray, salt: str = "", out: torch.Tensor | None = None
    ) -> LoadResult:
        """KV of the longest cached prefix of ``tokens``, every page checksum-verified.

        ``out`` (contiguous ``[layers, 2, >=tokens, kv_heads, head_dim]``) receives the KV
        in place; otherwise a new tensor is returned.
        """
        keys = self.keys(tokens, salt)
        tokens_wanted = len(keys) * self.layout.page_tokens
        if out is None:
            out = torch.empty(self.layout.request_shape(tokens_wanted), dtype=torch_dtype(self.layout))
        elif (
            out.dtype != torch_dtype(self.layout)
            or tuple(out.shape[:2]) + tuple(out.shape[3:]) != self.layout.request_shape(0)[:2] + self.layout.request_shape(0)[3:]
            or out.shape[2] < tokens_wanted
            or not out.is_contiguous()
        ):
            raise LayoutError(
                f"out tensor {tuple(out.shape)} {out.dtype} cannot hold {tokens_wanted} tokens of layout "
                f"{self.layout.request_shape(tokens_wanted)} {self.layout.dtype} (contiguous)"
            )
        if out.device.type != "cpu":
            raise LayoutError(f"out tensor must be in host memory, got {out.device}")
        out_bytes = request_bytes(out)
        got, by_tier = self.read_pages(keys, lambda i: page_chunks(self.layout, out_bytes, i))
        return LoadResult(got * self.layout.page_tokens, out[:, :, : got * self.layout.page_tokens], by_tier)

    # -- page verbs (runtime transfers) --------------------------------------------------
    def put_pages(self, keys: Sequence[int], pages: np.ndarray, fingerprint: bytes) -> int:
        """Store raw pages (``[n, page_nbytes]`` uint8) of one chain of ``keys``; returns pages stored."""
        if fingerprint != self.fingerprint.digest:
            raise FingerprintMismatch(
                f"pages carry model fingerprint {fingerprint.hex()}, this store holds {self.fingerprint.hex}"
            )
        pages = np.ascontiguousarray(pages)
        if pages.dtype != np.uint8 or pages.shape != (len(keys), self.layout.page_nbytes):
            raise LayoutError(
                f"pages must be uint8 [{len(keys)}, {self.layout.page_nbytes}], got {pages.dtype} {pages.shape}"
            )
        return self._store_pages(list(keys), lambda i: [pages[i]])

    def get_pages(self, keys: Sequence[int]) -> tuple[list[int], np.ndarray]:
        """Raw bytes of the longest cached, verified prefix of ``keys``: (keys found, pages)."""
        out = np.empty((len(keys), self.layout.page_nbytes), dtype=np.uint8)
        got, _ = self.read_pages(keys, lambda i: [out[i]])
        return list(keys[:got]), out[:got]

    # -- the two paths every verb goes through -------------------------------------------
    def read_pages(self, keys: Sequence[int], targets: ChunkSource) -> tuple[int, dict[str, int]]:
        """Pin the cached prefix of ``keys``, scatter each verified page into ``targets(i)``, unpin.

        Returns the number of leading pages delivered and their count per tier; a page
        that fails verification ends the prefix and is dropped.
        """
        with self._lock:
            match = self.manager.lookup(keys)
            self.manager.pin(match.handles)
        delivered = 0
        t0 = time.perf_counter()
        try:
            for i in range(len(match)):
                tier, slot, expected = Tier(int(match.tiers[i])), int(match.slots[i]), int(match.checksums[i])
                if not self._read_page(tier, slot, expected, targets(i)):
                    break
                delivered += 1
        finally:
            with self._lock:
                self.manager.unpin(match.handles)
                if delivered < len(match):
                    self.metrics.corrupt_pages += 1
                    self.manager.drop(int(match.handles[delivered]))
                self.manager.touch(match.handles[:delivered])
                self.manager.promote(match.handles[:delivered], self._move)
                self.metrics.observe("load", time.perf_counter() - t0)
        labels, counts = np.unique(match.tiers[:delivered], return_counts=True)
        return delivered, {Tier(int(t)).label: int(n) for t, n in zip(labels, counts)}

    def _store_pages(self, keys: list[int], sources: ChunkSource, priority: int = 0) -> int:
        """Store the pages of one chain in order; stop at the first page not kept, since
        its descendants could never be matched."""
        stored = 0
        parent = ROOT
        t0 = time.perf_counter()
        with self._lock:
            for i, key in enumerate(keys):
                handle = self.manager.index.handle_of(key)
                if handle is None:
                    handle = self._store_one(i, key, parent, len(keys), sources, priority)
                    if handle is None:
                        break
                    stored += 1
                parent = handle
            self.metrics.observe("store", time.perf_counter() - t0)
        return stored

    def _store_one(self, i: int, key: int, parent: int, pages: int, sources: ChunkSource, priority: int) -> int | None:
        """Reserve, write and publish one page. Its parent is kept meanwhile, so making
        room never drops the chain it is joining."""
        tier = self.manager.admit(PageContext(depth=i, request_pages=pages, priority=priority))
        if tier is None:
            return None
        if parent != ROOT:
            self.manager.keep(parent)
        try:
            slot = self.manager.reserve(tier, self._move)
            if slot is None:
                return None  # nothing in the tier can leave
            parent_key = None if parent == ROOT else self.manager.index.key_of(parent)
            try:
                digest = self._write_page(tier, slot, key, parent_key, sources(i))
            except StorageError:
                self.manager.abort_store(tier, slot)
                raise
        finally:
            if parent != ROOT:
                self.manager.release(parent)
        return self.manager.complete_store(key, tier, slot, digest, parent=parent, depth=i)

    # -- data plane ----------------------------------------------------------------------
    def _write_page(self, tier: Tier, slot: int, key: int, parent_key: int | None, chunks: Chunks) -> int:
        pool = self.pools[tier]
        if isinstance(pool, DiskPool):
            digest = checksum(chunks)
            pool.write(slot, key, parent_key, chunks, digest)
            return digest
        return transfer(chunks, slot_runs(pool.view(slot), chunks), into_slot=True)

    def _read_page(self, tier: Tier, slot: int, expected: int, chunks: Chunks) -> bool:
        pool = self.pools[tier]
        if isinstance(pool, DiskPool):
            stored = pool.read_into(slot, chunks)
            return stored is not None and stored.checksum == expected and checksum(chunks) == expected
        runs = slot_runs(pool.view(slot), chunks)
        if not self.config.verify_reads:
            for chunk, run in zip(chunks, runs):
                copy_bytes(chunk, run)
            return True
        return transfer(chunks, runs, into_slot=False) == expected

    def _move(self, handle: int, src: Tier, src_slot: int, dst: Tier, dst_slot: int) -> None:
        """Data-plane half of a two-phase move: copy and verify; the source stays intact."""
        t0 = time.perf_counter()
        index = self.manager.index
        key, expected = index.key_of(handle), int(index.checksum[handle])
        buffer = np.empty(self.layout.page_nbytes, dtype=np.uint8)
        if not self._read_page(src, src_slot, expected, [buffer]):
            raise StorageError(f"{src.label} tier: page {key:#x} failed verification before its move")
        parent = int(index.parent[handle])
        self._write_page(dst, dst_slot, key, None if parent == ROOT else index.key_of(parent), [buffer])
        self.metrics.observe(f"{src.label}->{dst.label}", time.perf_counter() - t0)

    def _slot_freed(self, tier: Tier, slot: int) -> None:
        pool = self.pools[tier]
        if isinstance(pool, DiskPool):
            pool.free(slot)

    # -- state ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.manager.index)

    def stats(self) -> dict:
        """Counters, per-tier occupancy and fragmentation, and whether the device is a stand-in."""
        snap = self.metrics.snapshot()
        snap["tiers"] = self.manager.occupancy()
        if Tier.DEVICE in self.pools:
            snap["tiers"]["device"]["stand_in"] = self.pools[Tier.DEVICE].stand_in
        return snap

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
