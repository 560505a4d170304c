"""A chain's disk pages written on several threads at once, in the middle of its store.

:meth:`CacheManager.store_chain <kvray.core.manager.CacheManager.store_chain>` admits,
places and publishes a chain's pages one after another, and the simulator and the
training environment run the very same decisions, so the
:class:`~kvray.core.store.PageStore` keeps that order and moves only the bytes: a page the
policy sends to a durable disk tier is handed to one of :data:`WRITERS` threads and placed in the index
at once (the slot is reserved, the checksum to come), while the chain's next pages are
placed and the memory ones copied. Before the store's lock is let go every write has
returned, the checksums are in the index, and a chain whose write failed is cut before
that page (it and every page after it dropped): no reader ever sees a page whose bytes are
not on disk, and pages are published in chain order, up to the first write that failed.
A durable store (``StoreConfig.disk_fsync``) waits for the device on every page; two
threads keep two pages in flight. ``kvray bench --only disk_tier_vs_raw_file --quick``,
kvray / a one-thread raw ``pwritev`` + ``fdatasync`` loop, this and the one-thread store
alternating (four pairs, 11:07, loaded machine): 2 MiB pages 0.91-3.41 (median 0.99)
against 0.79-0.84 (0.80); 16 MiB pages 0.75-0.97 (0.89) against 0.76-0.84 (0.83).
Buffered writes stay on the caller's thread: they are copies into the page cache, and on
two threads they measured 0.30-0.67 of raw against 0.58-1.06 on one (three pairs at 2
and 16 MiB, the spread of a loaded machine, no gain). Past the kernel's dirty limit a buffered write
waits for the device too; that case is not measured here.

Example::

    from kvray.core.chain_writes import PENDING, ChainWriters, DiskWrites

    writers = ChainWriters()
    writes = DiskWrites(writers)
    assert writes.submit(3, lambda: 0xBEEF) == PENDING  # placed at once, its checksum to come
    writes.submit(1, lambda: 0xCAFE)  # ... the chain's other pages meanwhile ...
    published = []
    failed_at, failure = writes.finish(lambda position, checksum: published.append((position, checksum)))
    assert (failed_at, failure) == (None, None) and published == [(1, 0xCAFE), (3, 0xBEEF)]  # chain order
    writers.close()
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all

from kvray.core.errors import StorageError

WRITERS = 2  # a chain's disk pages written at once
PENDING = 0  # the checksum a page is placed with while its write runs


class ChainWriters:
    """The threads a store writes its chains' disk pages on, made with the first such page."""

    def __init__(self, threads: int = WRITERS) -> None:
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, write: Callable[[], int]) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="kvray-disk-write")
        return self._pool.submit(write)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()


class DiskWrites:
    """The disk writes of one chain store, by the page's position in the chain."""

    def __init__(self, writers: ChainWriters) -> None:
        self.writers = writers
        self._pending: list[tuple[int, Future]] = []

    def submit(self, position: int, write: Callable[[], int]) -> int:
        """Start ``write()`` (returns the page's checksum) on a writer thread; the checksum
        to place the page with meanwhile (:data:`PENDING`)."""
        self._pending.append((position, self.writers.submit(write)))
        return PENDING

    def finish(self, written: Callable[[int, int], None]) -> tuple[int | None, StorageError | None]:
        """Wait for every write; ``written(position, checksum)`` for each that succeeded
        before the first that failed, in chain order. Returns the position of the first
        failed write and its error (None, None when all succeeded)."""
        wait_all([future for _, future in self._pending])
        for position, future in sorted(self._pending, key=lambda pending: pending[0]):
            error = future.exception()
            if error is not None:
                if not isinstance(error, StorageError):
                    raise error
                return position, error
            written(position, future.result())
        return None, None
