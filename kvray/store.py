"""PageStore: an in-process tiered KV page store that an engine can embed.

It joins the three parts of the design: chained keys (:mod:`kvray.keys`), the control
plane (:class:`~kvray.manager.CacheManager`: index, slot accounting, policy) and the data
plane (the tier pools holding bytes). Its verbs work on whole requests:

- ``store(tokens, kv)``: keep the KV of every full page not cached yet.
- ``lookup(tokens)``: how many leading tokens are cached (no bytes move).
- ``load(tokens)``: the KV of the longest cached prefix, checksum-verified.
- ``put_pages`` / ``get_pages``: the same by keys and raw page bytes, for the runtime's
  transfers between nodes (pages travel with their model fingerprint).

Pages read are pinned until copied out; a page that fails its checksum is counted,
dropped and never returned, so a load yields a shorter prefix, never wrong KV. A request
whose input is invalid raises before anything stored is touched.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvray.config import StoreConfig
from kvray.errors import FingerprintMismatch, LayoutError, RequestError, StorageError
from kvray.keys import ModelFingerprint, as_token_array, page_keys
from kvray.manager import CacheManager, Match
from kvray.pages import check_request_kv, checksum, page_view, token_slice, torch_dtype
from kvray.policy import PageContext, PlacementPolicy, make_policy
from kvray.tiers import DevicePool, DiskPool, HostPool, Tier

PageSink = Callable[[int, torch.Tensor], None]


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
        recovered = []
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
        for page in recovered:
            self.manager.index.add(page.key, Tier.DISK, page.slot, page.checksum)
            self.manager.policy.on_insert(self.manager.index.handle_of(page.key), Tier.DISK)
        self.manager.slot_freed = self._slot_freed
        self.metrics = self.manager.metrics
        self._staging = np.empty(nbytes, dtype=np.uint8)
        self._lock = threading.RLock()

    # -- keys ----------------------------------------------------------------------------
    def keys(self, tokens: Sequence[int] | np.ndarray, salt: str = "") -> list[int]:
        return page_keys(tokens, self.fingerprint, salt, max_tokens=self.config.max_request_tokens)

    # -- request verbs -------------------------------------------------------------------
    def lookup(self, tokens: Sequence[int] | np.ndarray, salt: str = "") -> int:
        """Leading tokens of ``tokens`` whose KV is cached (counts as a lookup, moves nothing)."""
        keys = self.keys(tokens, salt)
        with self._lock:
            return len(self.manager.lookup(keys)) * self.layout.page_tokens

    def store(self, tokens: Sequence[int] | np.ndarray, kv: torch.Tensor, salt: str = "", priority: int = 0) -> int:
        """Keep the KV of each full page of ``tokens`` that is not cached yet; returns pages stored."""
        arr = as_token_array(tokens, self.config.max_request_tokens)
        check_request_kv(self.layout, kv, arr.size)
        keys = self.keys(arr, salt)
        return self._store_pages(keys, lambda i, dst: dst.copy_(token_slice(self.layout, kv, i)), priority)

    def load(
        self, tokens: Sequence[int] | np.ndarray, salt: str = "", out: torch.Tensor | None = None
    ) -> LoadResult:
        """KV of the longest cached prefix of ``tokens``, every page checksum-verified.

        ``out`` (shape ``[layers, 2, >=tokens, kv_heads, head_dim]``) receives the KV in
        place; otherwise a new tensor is returned.
        """
        keys = self.keys(tokens, salt)
        page = self.layout.page_tokens
        if out is None:
            out = torch.empty(self.layout.request_shape(len(keys) * page), dtype=torch_dtype(self.layout))
        elif out.dtype != torch_dtype(self.layout) or out.dim() != 5 or out.shape[2] < len(keys) * page:
            raise LayoutError(f"out tensor {tuple(out.shape)} {out.dtype} cannot hold {len(keys) * page} tokens")
        got, by_tier = self.read_pages(keys, lambda i, src: token_slice(self.layout, out, i).copy_(src))
        return LoadResult(got * page, out[:, :, : got * page], by_tier)

    # -- page verbs (runtime transfers) --------------------------------------------------
    def put_pages(self, keys: Sequence[int], pages: np.ndarray, fingerprint: bytes) -> int:
        """Store raw pages (``[n, page_nbytes]`` uint8) under ``keys``; returns pages stored."""
        if fingerprint != self.fingerprint.digest:
            raise FingerprintMismatch(
                f"pages carry model fingerprint {fingerprint.hex()}, this store holds {self.fingerprint.hex}"
            )
        pages = np.asarray(pages)
        if pages.dtype != np.uint8 or pages.shape != (len(keys), self.layout.page_nbytes):
            raise LayoutError(
                f"pages must be uint8 [{len(keys)}, {self.layout.page_nbytes}], got {pages.dtype} {pages.shape}"
            )
        tensor = torch.from_numpy(pages)
        return self._store_pages(list(keys), lambda i, dst: dst.view(torch.uint8).view(-1).copy_(tensor[i]))

    def get_pages(self, keys: Sequence[int]) -> tuple[list[int], np.ndarray]:
        """Raw bytes of the longest cached, verified prefix of ``keys``: (keys found, pages)."""
        out = np.empty((len(keys), self.layout.page_nbytes), dtype=np.uint8)
        target = torch.from_numpy(out)
        got, _ = self.read_pages(keys, lambda i, src: target[i].copy_(src.reshape(-1).view(torch.uint8)))
        return list(keys[:got]), out[:got]

    # -- the two paths every verb goes through -------------------------------------------
    def read_pages(self, keys: Sequence[int], sink: PageSink) -> tuple[int, dict[str, int]]:
        """Pin the cached prefix, verify and hand each page (a view) to ``sink``; unpin.

        Returns the number of leading pages delivered; a corrupt page ends the prefix.
        """
        with self._lock:
            match = self.manager.lookup(keys)
            self.manager.pin(match.handles)
        delivered = 0
        t0 = time.perf_counter()
        try:
            for i in range(len(match)):
                if not self._deliver(match, i, sink):
                    break
                delivered += 1
        finally:
            with self._lock:
                self.manager.unpin(match.handles)
                if delivered < len(match):
                    self._drop_corrupt(int(match.handles[delivered]))
                self.manager.touch(match.handles[:delivered])
                self.manager.promote(match.handles[:delivered], self._move)
                self.metrics.observe("load", time.perf_counter() - t0)
        by_tier: dict[str, int] = {}
        for tier in match.tiers[:delivered].tolist():
            by_tier[Tier(tier).label] = by_tier.get(Tier(tier).label, 0) + 1
        return delivered, by_tier

    def _deliver(self, match: Match, i: int, sink: PageSink) -> bool:
        tier, slot, expected = Tier(int(match.tiers[i])), int(match.slots[i]), int(match.checksums[i])
        raw = self._read_slot(tier, slot, self._staging if tier == Tier.DISK else None)
        if raw is None or ((tier == Tier.DISK or self.config.verify_reads) and checksum(raw) != expected):
            return False
        sink(i, page_view(self.layout, raw))
        return True

    def _read_slot(self, tier: Tier, slot: int, staging: np.ndarray | None) -> torch.Tensor | None:
        pool = self.pools[tier]
        if isinstance(pool, DiskPool):
            stored = pool.read_into(slot, staging)
            return torch.from_numpy(staging) if stored is not None else None
        return pool.view(slot)

    def _drop_corrupt(self, handle: int) -> None:
        self.metrics.corrupt_pages += 1
        if self.manager.index.pins[handle] == 0:
            self.manager.drop(handle)

    def _store_pages(self, keys: list[int], fill: PageSink, priority: int = 0) -> int:
        stored = 0
        t0 = time.perf_counter()
        with self._lock:
            for i, key in enumerate(keys):
                if key in self.manager.index:
                    continue
                ctx = PageContext(depth=i, request_pages=len(keys), priority=priority)
                tier = self.manager.admit(ctx)
                slot = None if tier is None else self.manager.reserve(tier, self._move)
                if slot is None:
                    continue  # not kept: the policy declined or every page of the tier is pinned
                try:
                    digest = self._write_slot(tier, slot, key, fill, i)
                except StorageError:
                    self.manager.abort_store(tier, slot)
                    raise
                self.manager.complete_store(key, tier, slot, digest, depth=i, ctx=ctx)
                stored += 1
            self.metrics.observe("store", time.perf_counter() - t0)
        return stored

    def _write_slot(self, tier: Tier, slot: int, key: int, fill: PageSink, i: int) -> int:
        pool = self.pools[tier]
        if isinstance(pool, DiskPool):
            staging = torch.from_numpy(self._staging)
            fill(i, page_view(self.layout, staging))
            digest = checksum(self._staging)
            pool.write(slot, key, self._staging, digest)
            return digest
        view = pool.view(slot)
        fill(i, page_view(self.layout, view))
        return checksum(view)

    def _move(self, handle: int, src: Tier, src_slot: int, dst: Tier, dst_slot: int) -> None:
        """Data-plane half of a two-phase move: copy, verify, and leave the source intact."""
        t0 = time.perf_counter()
        key = self.manager.index.key_of(handle)
        expected = int(self.manager.index.checksum[handle])
        raw = self._read_slot(src, src_slot, np.empty(self.layout.page_nbytes, dtype=np.uint8))
        if raw is None or checksum(raw) != expected:
            raise StorageError(f"{src.label} tier: page {key:#x} failed verification before its move")
        dst_pool = self.pools[dst]
        if isinstance(dst_pool, DiskPool):
            dst_pool.write(dst_slot, key, raw.cpu().numpy(), expected)
        else:
            dst_pool.view(dst_slot).copy_(raw)
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
