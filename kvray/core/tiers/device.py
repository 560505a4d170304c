"""The accelerator tier: page slots in CUDA memory, staged through pinned host rows.

Its own module because it needs torch, which costs seconds to import: a process whose store
has no accelerator tier (a store actor on a CPU node) never loads it (kvray.lazy).
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from kvray.core.pages import UNHASHED, copy_page, hash_page
from kvray.core.tiers.memory import MemorySlots, resident_empty


class DevicePool(MemorySlots):
    """Page slots in accelerator memory; a CPU stand-in (``stand_in=True``) without CUDA.

    The stand-in keeps the tier's accounting and copy paths real on machines without an
    accelerator; :attr:`device` says which one is in use.

    On CUDA every page crosses through pinned host memory: a copy from pageable memory
    is staged by the driver through a pinned buffer of its own anyway, synchronously, so
    kvray packs the page (one strided host copy) straight into one of ``STAGING_PAGES``
    pinned rows and issues an asynchronous copy (``cudaMemcpyAsync``) on the pool's own
    stream. A write returns once its copy is queued, so packing the next page overlaps
    it; a row is reused only after its copy's event has fired. A read waits for its copy,
    since the caller gets the bytes. The rows are the pool's own lock's: a store copies
    pinned pages out outside its lock, so reads run on several threads at once and beside
    writes, and a row two copies shared would hand one of them the other's page. Copies on the pool's stream run in order, so a read
    of a slot always sees the last write to it; :meth:`view` waits for queued copies, so
    the tensor it returns is current on any stream.

    Example::

        pool = DevicePool(capacity=8, page_nbytes=4096)   # CUDA when present, else the stand-in
        pool.write(0, key=1, parent_key=None, page=np.full(4096, 7, np.uint8))
        out = np.empty(4096, np.uint8)
        assert pool.read_into(0, out, expected=0) and (out == 7).all()
    """

    kind = "device"
    STAGING_PAGES = 4

    def __init__(self, capacity: int, page_nbytes: int, device: str | None = None, checksum: bool = False) -> None:
        self.capacity = capacity
        self.checksum = checksum
        self.page_nbytes = page_nbytes
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.stand_in = self.device.type == "cpu"
        if self.stand_in:  # resident from the start, like a host pool (accelerator memory already is)
            self._host_view: np.ndarray | None = resident_empty(capacity, page_nbytes)
            self._tensor = torch.from_numpy(self._host_view)
        else:
            self._host_view = None
            self._tensor = torch.empty((capacity, page_nbytes), dtype=torch.uint8, device=self.device)
            self._staging = torch.empty((self.STAGING_PAGES, page_nbytes), dtype=torch.uint8, pin_memory=True)
            self._staging_rows = self._staging.numpy()
            self._stream = torch.cuda.Stream(device=self.device)
            self._copied: list[torch.cuda.Event | None] = [None] * self.STAGING_PAGES
            self._next_row = 0
            self._rows = threading.Lock()  # held from taking a staging row until its copy is queued (write) or read out

    def view(self, slot: int) -> np.ndarray | torch.Tensor:
        """Slot bytes: a numpy view for the CPU stand-in, a device tensor on an accelerator."""
        if self._host_view is not None:
            return self._host_view[slot]
        self.synchronize()
        return self._tensor[slot]

    def synchronize(self) -> None:
        """Wait until every queued copy has landed (nothing to wait for on the stand-in)."""
        if not self.stand_in:
            self._stream.synchronize()

    def _staging_row(self) -> int:
        """A pinned row no queued copy still reads or writes."""
        row = self._next_row
        self._next_row = (row + 1) % self.STAGING_PAGES
        if self._copied[row] is not None:
            self._copied[row].synchronize()
            self._copied[row] = None
        return row

    def write(self, slot: int, key: int, parent_key: int | None, page: np.ndarray) -> int:
        if self.stand_in:
            return super().write(slot, key, parent_key, page)
        with self._rows:
            row = self._staging_row()
            copy_page(self._staging_rows[row], page)
            with torch.cuda.stream(self._stream):
                self._tensor[slot].copy_(self._staging[row], non_blocking=True)
                done = torch.cuda.Event()
                done.record(self._stream)
            self._copied[row] = done
        return hash_page(page) if self.checksum else UNHASHED

    def read_into(self, slot: int, page: np.ndarray, expected: int) -> bool:
        if self.stand_in:
            return super().read_into(slot, page, expected)
        with self._rows:
            row = self._staging_row()
            with torch.cuda.stream(self._stream):
                self._staging[row].copy_(self._tensor[slot], non_blocking=True)
            self._stream.synchronize()
            copy_page(page, self._staging_rows[row])
        return not self.checksum or hash_page(page) == expected

    def close(self) -> None:
        self.synchronize()
        self._host_view = None
        self._tensor = torch.empty(0, dtype=torch.uint8)
