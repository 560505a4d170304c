"""PageStore: an in-process tiered KV page store that an engine can embed.

It joins the three parts of the design: chained keys (:mod:`kvray.core.keys`), the control
plane (:class:`~kvray.core.manager.CacheManager`: index, slot accounting, policy) and the data
plane (the tier pools holding bytes). Its verbs work on whole requests:

- ``store(tokens, kv)``: keep the KV of every full page not cached yet.
- ``lookup(tokens)``: how many leading tokens are cached (no bytes move).
- ``load(tokens)``: the KV of the longest cached prefix, checksum-verified; ``load_chunks``
  streams it a chunk at a time, read ahead, for prefixes larger than the engine has room for
  (these three, a request's KV as one tensor, in :mod:`kvray.core.request_kv`).
- ``put_pages`` / ``get_pages``: the same by keys and raw page bytes, for the runtime's
  transfers between nodes (pages travel with their model fingerprint).
- ``read_pages(keys, targets)``: the primitive under ``load`` and ``get_pages``, for
  callers with their own buffers: it copies each page into the view the caller names.

A page moves as a byte view of the caller's memory (:func:`kvray.core.pages.request_page`), so
storing or loading is one strided copy (memory tiers) or one write/read per contiguous
run (disk). Disk pages are hashed as they are written and verified on every read; memory
pages too when ``checksum_memory`` is set, and otherwise get their checksum the moment
they leave memory for disk. Pages read are pinned until copied out; a page that fails
its checksum is counted, dropped (with its descendants) and never returned, so a load
yields a shorter prefix, never wrong KV. A request whose input is invalid raises before
anything stored is touched.

One lock guards the index, the slot accounting and the counters: every change to them,
and every read of them that must add up (``stats``), happens under it; only the copies
of page bytes run outside it, on pinned pages.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

import numpy as np

from kvray.core.chain_writes import ChainWriters, DiskWrites
from kvray.core.config import StoreConfig
from kvray.core.errors import FingerprintMismatch, LayoutError, StorageError
from kvray.core.index import ROOT, parents_first
from kvray.core.keys import ModelFingerprint, page_keys
from kvray.core.manager import TIERS, CacheManager
from kvray.core.pages import (
    hash_page,
    runs,
)
from kvray.core.placement import LRUPolicy, PlacementPolicy, RequestInfo, RunPlace
from kvray.core.request_kv import RequestKV
from kvray.core.tiers import LOCAL_TIERS, DiskPool, HostPool, Pool, StoredPage, Tier
from kvray.core.tiers.directory import SlotDirectory, directory_name, mapped_reads_sound
from kvray.core.tiers.disk import verified
from kvray.core.write_budget import budget_stats

PageSource = Callable[[int], np.ndarray]


def _no_reads() -> Iterator[tuple[StoredPage | None, int]]:
    """The disk reads of a match without disk pages (closable, like the pool's)."""
    yield from ()  # page index within the request -> a byte view of it


class PageStore(RequestKV):
    """Tiered page store for one model layout.

    ``policy`` is the placement policy object the store's manager consults (LRU when none is
    given). The core never resolves a policy by name: callers that take names build it with
    :func:`kvray.policy.make_policy` (``PageStore(config, make_policy("arc"))``).

    Example::

        store = PageStore(StoreConfig(layout=layout, tiers=TierSizes(host=64, disk=1024), disk_dir="kv"))
        store.store(tokens, kv)                 # kv: [layers, 2, len(tokens), kv_heads, head_dim]
        hit = store.load(tokens)
        hit.tokens, hit.kv.shape
    """

    def __init__(self, config: StoreConfig, policy: PlacementPolicy | None = None) -> None:
        self.config = config
        self.layout = config.layout
        self.fingerprint = ModelFingerprint.of(config.layout, config.model_name, config.model_revision)
        nbytes = self.layout.page_nbytes
        sizes = config.tiers
        self.pools: dict[Tier, Pool] = {}
        if sizes.device:
            from kvray.core.tiers.device import DevicePool  # loads torch: only with an accelerator tier

            self.pools[Tier.DEVICE] = DevicePool(sizes.device, nbytes, checksum=config.checksum_memory)
        # With a shared host tier, engines on this node read its pages themselves, finding
        # them through the slot directory this store keeps current (kvray.core.tiers.directory).
        # Only where that lock-free protocol is sound: elsewhere the tier stays private and
        # engines read through the store.
        self.directory: SlotDirectory | None = None
        if sizes.host:
            shared = config.host_shared_memory if mapped_reads_sound() else None
            self.pools[Tier.HOST] = HostPool(sizes.host, nbytes, shared_name=shared, checksum=config.checksum_memory)
            if shared:
                self.directory = SlotDirectory.create(directory_name(shared), sizes.host)
        recovered: list[StoredPage] = []
        if sizes.disk:
            disk = DiskPool(config.disk_dir, sizes.disk, nbytes, self.fingerprint.digest, fsync=config.disk_fsync)
            self.pools[Tier.DISK] = disk
            recovered = disk.scan()
        self.manager = CacheManager(
            {Tier.DEVICE: sizes.device, Tier.HOST: sizes.host, Tier.DISK: sizes.disk},
            policy if policy is not None else LRUPolicy(),
            page_nbytes=nbytes,
            used_slots={Tier.DISK: [p.slot for p in recovered]},
        )
        self.manager.slot_freed = self._slot_freed
        self.manager.page_placed = self._page_placed
        self.metrics = self.manager.metrics
        self._lock = threading.RLock()
        self._writers = ChainWriters()  # a chain's disk pages written at once
        self._recover(recovered)

    def _recover(self, pages: list[StoredPage]) -> None:
        """Re-index pages found on disk, parents first; free those whose parent is gone, and
        every slot but one of a key found twice (one whose bytes verify): a slot freed (its header
        cleared, without fsync) before the page went back to disk elsewhere can survive a crash
        that the clear did not, and a key indexed twice would stop the store from starting at all."""
        first: dict[int, StoredPage] = {}
        repeats: list[StoredPage] = []
        for page in pages:
            kept = first.setdefault(page.key, page)
            if kept is not page:  # a key found twice: keep a copy whose bytes verify (the first if both do)
                if not self._verifies(kept) and self._verifies(page):
                    first[page.key], page = page, kept
                repeats.append(page)
        ordered, orphans = parents_first((page.key, page.parent_key, page) for page in first.values())
        handles: dict[int, int] = {}
        for key, parent_key, page in ordered:
            parent = ROOT if parent_key is None else handles[parent_key]
            handles[key] = self.manager.restore(key, Tier.DISK, page.slot, page.checksum, parent=parent)
        for page in [*orphans, *repeats]:
            self.manager.abort_store(Tier.DISK, page.slot)

    def _verifies(self, page: StoredPage) -> bool:
        """Whether a disk slot's bytes carry its header's checksum (read only for a key found twice)."""
        return self.pools[Tier.DISK].read_into(page.slot, np.empty(self.layout.page_nbytes, np.uint8), page.checksum)

    # -- keys ----------------------------------------------------------------------------
    def keys(self, tokens: Sequence[int] | np.ndarray, salt: str = "") -> list[int]:
        return page_keys(tokens, self.fingerprint, salt, max_tokens=self.config.max_request_tokens)

    # -- request verbs -------------------------------------------------------------------
    def lookup(self, tokens: Sequence[int] | np.ndarray, salt: str = "") -> int:
        """Leading tokens of ``tokens`` whose KV is cached (counts as a lookup, moves nothing)."""
        return self.match(self.keys(tokens, salt)) * self.layout.page_tokens

    def __contains__(self, key: int) -> bool:
        with self._lock:
            return key in self.manager.index

    def cached_keys(self) -> list[int]:
        with self._lock:
            return list(self.manager.index.keys())

    def chain_links(self) -> list[tuple[int, int | None]]:
        """``(key, parent key or None)`` of every page held: what a rebuild of a metadata
        index elsewhere (the Ray controller's) needs to put the chains back in order."""
        with self._lock:
            index = self.manager.index
            links = []
            for key in index.keys():
                parent = int(index.parent[index.handle_of(key)])
                links.append((key, None if parent == ROOT else index.key_of(parent)))
            return links

    def on_request(self, info: RequestInfo) -> None:
        """Tell the placement policy a request is arriving (before its lookup here), with
        what the caller measured (the engine's backlog, the tiers' costs) and, to a policy
        that asks, how busy this store's drive has been lately: its reads' share of the last
        second as the disk's ``load_util`` (``needs_link_util``), its writes' as
        ``disk_write_util`` (``needs_disk_util``), as the simulator tells them from its links
        (:mod:`kvray.core.busy`)."""
        policy = self.manager.policy
        disk = self.pools.get(Tier.DISK)
        if isinstance(disk, DiskPool) and (policy.needs_link_util or policy.needs_disk_util):
            info = replace(
                info,
                load_util={**(info.load_util or {}), Tier.DISK: disk.reads.share()} if policy.needs_link_util else info.load_util,
                disk_write_util=disk.writes.share() if policy.needs_disk_util else info.disk_write_util,
            )
        with self._lock:
            policy.on_request(info)

    def traffic(self) -> dict[Tier, tuple[int, int, int, int]]:
        """Per local tier: free slots, capacity, pages read out of it and pages written into it
        so far (hits, stores and moves): what a node reports of its occupancy and links."""
        with self._lock:
            metrics = self.metrics
            read, written = Counter(metrics.hit_pages), Counter(metrics.stored_by_tier)
            for move, pages in metrics.moved_pages.items():
                src, dst = move.split("->")
                read[src] += pages
                written[dst] += pages
            out = {}
            for tier in LOCAL_TIERS:
                slots = self.manager.slots.get(tier)
                free, capacity = (slots.capacity - slots.used, slots.capacity) if slots is not None else (0, 0)
                out[tier] = (free, capacity, read[tier.label], written[tier.label])
            return out

    def on_page_dropped(self, callback: Callable[[int], None]) -> None:
        """Call ``callback(key)`` whenever a page leaves this store (evicted, corrupt, lost)."""
        self.manager.page_dropped = callback

    def match(self, keys: Sequence[int]) -> int:
        """How many leading ``keys`` are cached: what an engine that already holds the keys
        asks before storing the rest of a chain (moves nothing, counts nothing)."""
        with self._lock:
            return self.manager.index.match(keys)

    # -- page verbs (runtime transfers) --------------------------------------------------
    def put_pages(
        self,
        keys: Sequence[int],
        pages: np.ndarray,
        fingerprint: bytes,
        parent_key: int | None = None,
        place: RunPlace | None = None,
    ) -> int:
        """Store raw pages (``[n, page_nbytes]`` uint8) of one chain of ``keys``; returns pages stored.

        ``parent_key`` is the key of the page just before ``keys[0]`` in its chain when the
        pages continue a cached prefix (an engine storing only the pages it computed);
        nothing is stored if that parent is no longer cached. ``place``: where ``keys`` sit
        in their request (a node storing its run of a chain another node began), as the
        policy is told; default a request of these pages alone.
        """
        if fingerprint != self.fingerprint.digest:
            raise FingerprintMismatch(
                f"pages carry model fingerprint {fingerprint.hex()}, this store holds {self.fingerprint.hex}"
            )
        pages = np.ascontiguousarray(pages)
        if pages.dtype != np.uint8 or pages.shape != (len(keys), self.layout.page_nbytes):
            raise LayoutError(f"pages must be uint8 [{len(keys)}, {self.layout.page_nbytes}], got {pages.dtype} {pages.shape}")
        return self._store_pages(list(keys), lambda i: pages[i], parent_key=parent_key, place=place)

    def get_pages(self, keys: Sequence[int]) -> tuple[list[int], np.ndarray]:
        """Raw bytes of the longest cached, verified prefix of ``keys``: (keys found, pages)."""
        out = np.empty((len(keys), self.layout.page_nbytes), dtype=np.uint8)
        got, _ = self.read_pages(keys, lambda i: out[i])
        return list(keys[:got]), out[:got]

    # -- the two paths every verb goes through -------------------------------------------
    def read_pages(self, keys: Sequence[int], targets: PageSource, hits: bool = True) -> tuple[int, dict[str, int]]:
        """Pin the cached prefix of ``keys``, copy each verified page into ``targets(i)``, unpin
        (``hits`` False: the caller counts the pages read later, ``touch_pages(..., looked_up=True)``).

        Returns the number of leading pages delivered and their count per tier; a page
        that fails verification ends the prefix and is dropped. Every target is resolved
        and checked before anything is pinned, so a caller's buffer too small for
        ``keys`` raises :class:`LayoutError` and costs no page; an error while copying
        (a disk that fails) propagates and drops nothing either: only bytes that fail
        their checksum condemn a page.
        """
        views = self._targets(targets, len(keys))
        return self._read_into(keys, views.__getitem__, lambda pages: [runs(views[i]) for i in range(pages)], hits)

    def _read_into(
        self, keys: Sequence[int], view: PageSource, page_runs: Callable[[int], list[list[np.ndarray]]], hits: bool = True
    ) -> tuple[int, dict[str, int]]:
        """:meth:`read_pages` into targets already known to hold one page each: ``view(i)``
        is page ``i``'s view, ``page_runs(n)`` the contiguous runs of the first ``n`` pages
        (what a disk read fills), asked for once, only when a disk page is matched."""
        with self._lock:
            match = self.manager.lookup(keys)
            self.manager.pin(match.handles)
        delivered = 0
        t0 = time.perf_counter()
        tiers, slots, checksums = match.tiers.tolist(), match.slots.tolist(), match.checksums.tolist()
        disk_reads = self._disk_reads(tiers, slots, page_runs)
        disk = Tier.DISK
        try:
            for i, expected in enumerate(checksums):
                tier = TIERS[tiers[i]]
                if tier is disk:
                    stored, digest = next(disk_reads)
                    if not verified(stored, digest, expected):
                        break
                elif not self._read_page(tier, slots[i], expected, view(i)):
                    break
                delivered += 1
        except BaseException:
            with self._lock:
                self.manager.unpin(match.handles)
            raise
        finally:
            disk_reads.close()  # read-ahead past a page that failed stops here
        with self._lock:
            self.manager.unpin(match.handles)
            if delivered < len(match):  # the loop stopped at a page that failed verification
                self.metrics.corrupt_pages += 1
                self.manager.drop(int(match.handles[delivered]))
            if hits:
                self._hit(match.handles[:delivered])
                self.metrics.loaded_pages += delivered
                self.metrics.observe("load", time.perf_counter() - t0)
        return delivered, {TIERS[t].label: n for t, n in sorted(Counter(tiers[:delivered]).items())}

    def _targets(self, targets: PageSource, pages: int) -> list[np.ndarray]:
        """``targets(i)`` for every page of a request, each checked to hold exactly one page."""
        views = []
        nbytes = self.layout.page_nbytes
        for i in range(pages):
            try:
                view = targets(i)
            except (IndexError, ValueError) as exc:
                raise LayoutError(f"target buffer has no room for page {i} of {pages}: {exc}") from None
            if not isinstance(view, np.ndarray) or view.dtype != np.uint8 or view.nbytes != nbytes:
                what = f"{view.dtype} {view.shape}" if isinstance(view, np.ndarray) else type(view).__name__
                raise LayoutError(f"target of page {i} of {pages} is {what}, not the {nbytes} bytes of one page")
            if not view.flags.c_contiguous and Tier.DISK in self.pools:
                try:
                    runs(view)  # a disk read writes these runs: each must be the target's own memory
                except LayoutError as exc:
                    raise LayoutError(f"target of page {i} of {pages}: {exc}") from None
            views.append(view)
        return views

    def _disk_reads(
        self, tiers: list[int], slots: list[int], page_runs: Callable[[int], list[list[np.ndarray]]]
    ) -> Iterator[tuple[StoredPage | None, int]]:
        """The disk pages among a match, read ahead concurrently (:meth:`DiskPool.read_many`)
        in match order; a page after one that fails verification may be read, never delivered.
        Nothing is read until the first disk page is asked for. The pool's own iterator, not
        one wrapping it: a generator level costs every page a resume."""
        disk = self.pools.get(Tier.DISK)
        on_disk = int(Tier.DISK)
        wanted = [i for i, tier in enumerate(tiers) if tier == on_disk] if isinstance(disk, DiskPool) else []
        if not wanted:
            return _no_reads()
        chunks = page_runs(wanted[-1] + 1)
        return disk.read_many([(slots[i], chunks[i]) for i in wanted])

    def touch_pages(self, keys: Sequence[int], load_s: float | None = None, looked_up: bool = False) -> int:
        """Count a hit on the cached prefix of ``keys`` that a reader copied out of the shared
        host tier itself (no bytes move here), or that ``read_pages(..., hits=False)`` read
        (``looked_up``: its lookup is counted already): its pages as loaded, and ``load_s``,
        the time the copy took, as a load's latency; returns pages touched."""
        with self._lock:
            match = self.manager.lookup(keys, count=not looked_up)
            self._hit(match.handles)
            self.metrics.loaded_pages += len(match)
            if load_s is not None:
                self.metrics.observe("load", load_s)
        return len(match)

    def _hit(self, handles: np.ndarray) -> None:
        """Recency and heat of pages just read, and the promotions the policy asks for."""
        self.manager.touch(handles)
        self.manager.promote(handles, self._move)

    def _store_pages(
        self,
        keys: list[int],
        sources: PageSource,
        priority: int = 0,
        parent_key: int | None = None,
        page_runs: Callable[[int], list[list[np.ndarray]]] | None = None,
        place: RunPlace | None = None,
    ) -> int:
        """Store the pages of one chain (after ``parent_key``'s page, if given) through the
        manager's chain writer, writing each page's bytes into the slot it gets; with
        ``disk_fsync`` the disk pages on :data:`~kvray.core.chain_writes.WRITERS` threads
        while the chain's next pages are placed (:mod:`kvray.core.chain_writes`: every
        write has returned, and a chain whose write failed is cut before that page, before
        the lock is let go). Buffered writes stay on the caller's thread (see there why).

        ``page_runs(n)``, where given, is the contiguous runs of the first ``n`` sources,
        made for the whole request at once (:func:`~kvray.core.pages.request_runs`) the first
        time a page goes to disk, instead of a view and its runs per page."""
        t0 = time.perf_counter()
        disk = self.pools.get(Tier.DISK)
        request_runs_once = functools.cache(lambda: page_runs(len(keys))) if page_runs is not None else None
        with self._lock:
            parent = ROOT
            if parent_key is not None:
                parent = self.manager.index.handle_of(parent_key)
                if parent is None:
                    return 0
            index, writes = self.manager.index, DiskWrites(self._writers)

            def write(i: int, key: int, tier: Tier, slot: int, under: int) -> int:
                under_key = None if under == ROOT else index.key_of(under)
                if tier is Tier.DISK and request_runs_once is not None and isinstance(disk, DiskPool):
                    job = functools.partial(disk.write_runs, slot, key, under_key, request_runs_once()[i])
                else:
                    job = functools.partial(self._write_page, tier, slot, key, under_key, sources(i))
                job = functools.partial(self._written, tier, job)
                return writes.submit(i, job) if tier is Tier.DISK and self.config.disk_fsync else job()

            def written(i: int, checksum: int) -> None:
                index.checksum[index.handle_of(keys[i])] = checksum

            cut = 0
            try:
                first_depth, request_pages = place or (0, None)
                stored = self.manager.store_chain(
                    keys,
                    self._move,
                    write,
                    parent=parent,
                    priority=priority,
                    first_depth=first_depth,
                    request_pages=request_pages,
                )
            finally:
                failed_at, failure = writes.finish(written)
                if failed_at is not None and (handle := index.handle_of(keys[failed_at])) is not None:
                    cut = self.manager.drop(handle)  # the page whose write failed and every page after it
            self.metrics.observe("store", time.perf_counter() - t0)
        if failure is not None:
            raise failure
        return stored - cut

    def _written(self, tier: Tier, write: Callable[[], int]) -> int:
        """``write()`` (a page into its slot; returns its checksum), a failure naming the tier's occupancy."""
        try:
            return write()
        except StorageError as exc:
            slots = self.manager.slots[tier]
            raise StorageError(f"{exc} ({tier.label} tier {slots.used}/{slots.capacity} slots in use)") from None

    # -- data plane ----------------------------------------------------------------------
    def _write_page(self, tier: Tier, slot: int, key: int, parent_key: int | None, page: np.ndarray) -> int:
        """Write ``page`` into ``slot``; return its checksum (UNHASHED for an unhashed memory page)."""
        return self.pools[tier].write(slot, key, parent_key, page)

    def _read_page(self, tier: Tier, slot: int, expected: int, page: np.ndarray) -> bool:
        """Copy ``slot`` into ``page``; False when the bytes fail verification."""
        return self.pools[tier].read_into(slot, page, expected)

    def _move_source(self, tier: Tier, slot: int, expected: int) -> np.ndarray | None:
        """A page's verified bytes to move from, or None: a host slot itself (the source stays
        intact until the move is published), else a copy read out of the tier."""
        view = self.pools[tier].view(slot)
        if isinstance(view, np.ndarray):
            verified = not self.config.checksum_memory or hash_page(view) == expected
            return view if verified else None
        buffer = np.empty(self.layout.page_nbytes, dtype=np.uint8)
        return buffer if self._read_page(tier, slot, expected, buffer) else None

    def _move(self, handle: int, src: Tier, src_slot: int, dst: Tier, dst_slot: int) -> int | None:
        """Data-plane half of a two-phase move: copy and verify; the source stays intact.

        Returns the page's checksum when the move computed it (a memory page reaching disk).
        """
        t0 = time.perf_counter()
        index = self.manager.index
        key, expected = index.key_of(handle), int(index.checksum[handle])
        page = self._move_source(src, src_slot, expected)
        if page is None:
            raise StorageError(f"{src.label} tier: page {key:#x} failed verification before its move")
        parent = int(index.parent[handle])
        digest = self._write_page(dst, dst_slot, key, None if parent == ROOT else index.key_of(parent), page)
        self.metrics.observe(f"{src.label}->{dst.label}", time.perf_counter() - t0)
        return digest if dst == Tier.DISK else None

    def _slot_freed(self, tier: Tier, slot: int) -> None:
        self.pools[tier].free(slot)
        if tier == Tier.HOST and self.directory is not None:
            self.directory.free(slot)

    def _page_placed(self, key: int, tier: Tier, slot: int, checksum: int) -> None:
        if tier == Tier.HOST and self.directory is not None:
            self.directory.publish(slot, key, checksum)

    def set_disk_write_budget(self, bytes_per_s: float | None) -> None:
        """Write at most ``bytes_per_s`` to the disk tier, in wall time (None: no cap); pages
        beyond it are not written there (:mod:`kvray.core.write_budget`)."""
        with self._lock:
            self.manager.set_disk_budget(bytes_per_s, time.monotonic)

    # -- state ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.manager.index)

    def stats(self) -> dict:
        """Counters, per-tier occupancy and fragmentation, and whether the device is a stand-in.

        Read under the store's lock, like every change to them: a slot allocator caught
        between its free list and its bitmap would report nonsense (or fail), and
        counters read mid-request would not add up.
        """
        with self._lock:
            snap = self.metrics.snapshot()
            snap["tiers"] = self.manager.occupancy()
            snap["disk_write_budget"] = budget_stats(self.manager.disk_budget)
            snap["policy"] = self.manager.policy.stats()
        if Tier.DEVICE in self.pools:
            snap["tiers"]["device"]["stand_in"] = self.pools[Tier.DEVICE].stand_in
        return snap

    def close(self) -> None:
        self._writers.close()
        if self.directory is not None:
            self.directory.close()  # marked closed before the pool it describes goes
        for pool in self.pools.values():
            pool.close()
