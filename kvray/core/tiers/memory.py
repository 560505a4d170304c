"""Host memory pools: one ``[capacity, page_nbytes]`` array each (the accelerator's pool,
:class:`~kvray.core.tiers.device.DevicePool`, builds on the same slots).

Pages are written and read through zero-copy slot views, so packing a page from an engine
tensor is one strided copy straight into the pool. A host pool can live in POSIX shared
memory (``shared_name``) so that other processes on the node map the same slots and load
pages without any copy through Ray (see :mod:`kvray.cluster`).
"""

from __future__ import annotations

import contextlib
import mmap
from multiprocessing import resource_tracker, shared_memory

import numpy as np

from kvray.core.errors import StorageError
from kvray.core.pages import UNHASHED, copy_page, hash_page

PAGE_ALIGN = 4096
MADV_POPULATE_WRITE = 23  # Linux 5.14+; Python's mmap module does not name it


def aligned_empty(rows: int, row_nbytes: int) -> np.ndarray:
    """An uninitialised ``[rows, row_nbytes]`` uint8 array starting on a 4 KiB boundary.

    Copies between a slot and an engine tensor run at memcpy speed only when the two
    addresses agree modulo 4 KiB or differ by a cache line or more: numpy's own buffers
    start 16 bytes past a page, torch's 64, and that 48-byte skew makes every load of the
    copy alias a store just issued (measured: ~20% slower page copies). Page-aligned
    slots, like a shared-memory pool's, avoid it for any cache-line-aligned tensor.
    """
    raw = np.empty(rows * row_nbytes + PAGE_ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % PAGE_ALIGN
    return raw[start : start + rows * row_nbytes].reshape(rows, row_nbytes)


def prefault(mapping: mmap.mmap, array: np.ndarray) -> None:
    """Fault every page of ``mapping`` (``array`` views the same bytes) in now, writable.

    A pool left untouched pays a page fault and a kernel zero-fill per 4 KiB inside the
    first ``store`` that reaches it: 0.4-1.5 GB/s on this VM against 10+ GB/s once
    resident, so a fresh process stored at a tenth of memory speed. Faulting at creation
    moves that cost to start-up (reported in docs/benchmarks.md as ms per GiB).
    ``MADV_POPULATE_WRITE`` does it in one call; older kernels refuse it and get one
    written byte per page instead. Transparent huge pages are asked for first, where
    the kernel grants them: their 2 MiB zero-fills make start-up ~2.5x slower per GiB,
    but steady-state page copies ran at 0.80 of memcpy against 0.75 with 4 KiB pages
    (numpy's own large buffers, the baseline's, get huge pages too; docs/benchmarks.md).
    """
    if array.size == 0:
        return
    with contextlib.suppress(OSError):  # kernels without THP, or with it disabled
        mapping.madvise(mmap.MADV_HUGEPAGE)
    try:
        mapping.madvise(MADV_POPULATE_WRITE)
    except OSError:
        flat = array.reshape(-1)
        flat[::PAGE_ALIGN] = flat[::PAGE_ALIGN]


def resident_empty(rows: int, row_nbytes: int) -> np.ndarray:
    """A ``[rows, row_nbytes]`` uint8 pool in its own anonymous mapping, page-aligned (see
    :func:`aligned_empty` for why that matters) and resident from the start (:func:`prefault`)."""
    mapping = mmap.mmap(-1, max(rows * row_nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    array = np.ndarray((rows, row_nbytes), dtype=np.uint8, buffer=mapping)
    prefault(mapping, array)
    return array


def attach_shared(name: str, nbytes: int, what: str) -> shared_memory.SharedMemory:
    """Map an existing segment of at least ``nbytes`` that another process created and owns.

    Python's resource tracker would unlink it when this (mapping-only) process exits;
    the creator owns its lifetime, so the mapping is taken off the tracker.
    """
    try:
        shm = shared_memory.SharedMemory(name=name, create=False)
    except OSError as exc:
        raise StorageError(f"{what} {name!r} cannot be mapped on this node: {exc}") from None
    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    if shm.size < nbytes:
        shm.close()
        raise StorageError(f"{what} {name!r} holds {shm.size} bytes, expected {nbytes}")
    return shm


class MemorySlots:
    """The :class:`~kvray.core.tiers.Pool` verbs of a pool whose slots are memory views.

    A page is one strided copy in or out of its slot. With ``checksum`` the page is hashed
    as it is written and verified as it is read (``checksum_memory``); without, it carries
    ``UNHASHED`` until it reaches disk, and a read always verifies.
    """

    checksum: bool

    def write(self, slot: int, key: int, parent_key: int | None, page: np.ndarray) -> int:
        copy_page(self.view(slot), page)
        return hash_page(page) if self.checksum else UNHASHED

    def read_into(self, slot: int, page: np.ndarray, expected: int) -> bool:
        copy_page(page, self.view(slot))
        return not self.checksum or hash_page(page) == expected

    def free(self, slot: int) -> None:
        """Nothing to clear: a memory slot's bytes are only reachable through the index."""


class HostPool(MemorySlots):
    """Page slots in host memory (optionally a named shared-memory segment).

    Example::

        pool = HostPool(capacity=8, page_nbytes=4096)
        pool.view(0)[:] = 7          # a uint8 array aliasing slot 0
    """

    kind = "host"
    stand_in = False

    def __init__(
        self, capacity: int, page_nbytes: int, shared_name: str | None = None, attach: bool = False, checksum: bool = False
    ) -> None:
        """``shared_name``: create that shared segment (this pool owns it), or with
        ``attach`` map the one another process's pool created (read it, never unlink it)."""
        self.capacity = capacity
        self.checksum = checksum
        self.page_nbytes = page_nbytes
        self._shm: shared_memory.SharedMemory | None = None
        self._owner = not attach
        size = max(capacity * page_nbytes, 1)
        if shared_name is None:
            array = resident_empty(capacity, page_nbytes)
        else:
            if attach:
                self._shm = attach_shared(shared_name, capacity * page_nbytes, "host tier")
            else:
                try:
                    self._shm = shared_memory.SharedMemory(name=shared_name, create=True, size=size)
                except OSError as exc:
                    raise StorageError(f"host tier: cannot create shared memory {shared_name!r}: {exc}") from None
            array = np.ndarray((capacity, page_nbytes), dtype=np.uint8, buffer=self._shm.buf)
            if not attach:
                prefault(self._shm._mmap, array)  # type: ignore[attr-defined]
        self._array = array

    @property
    def shared_name(self) -> str | None:
        return self._shm.name if self._shm else None

    def view(self, slot: int) -> np.ndarray:
        return self._array[slot]

    def close(self) -> None:
        if self._shm is not None:
            del self._array
            self._shm.close()
            if self._owner:
                with contextlib.suppress(FileNotFoundError):  # retired by a successor already
                    self._shm.unlink()
            self._shm = None
