"""Landing buffers: the same-node data plane between an engine and its node's store.

An engine process owns one POSIX shared-memory buffer of ``pages x page_nbytes`` bytes
(its request-sized KV staging area). The node's store actor maps the same segment by
name, once, and copies pages straight between its tiers and the buffer: a store, or a
load of pages on the store's disk tier, is one actor call carrying only keys and offsets,
and the page bytes cross no socket, no pickle and no object store. Pages on the store's
host tier need not even that call: the engine maps the host tier too
(:class:`~kvray.tiers.directory.SharedHostTier`) and copies them into the buffer itself.
Cross-node pages are received into the same buffer by the collective path, so the engine
always finds a request's KV in one place.

Example::

    buf = LandingBuffer.create(pages=64, page_nbytes=1 << 20)     # in the engine
    peer = LandingBuffer.attach(buf.name, 64, 1 << 20)            # in the store actor
    peer.pages[3][:] = 7; buf.pages[3][0]                         # -> 7
"""

from __future__ import annotations

import os
import secrets
from multiprocessing import shared_memory

import numpy as np

from kvray.errors import StorageError
from kvray.tiers.memory import attach_shared


class LandingBuffer:
    """A ``[pages, page_nbytes]`` uint8 array in a named shared-memory segment."""

    def __init__(self, shm: shared_memory.SharedMemory, pages: int, page_nbytes: int, owner: bool) -> None:
        self._shm = shm
        self.owner = owner
        self.capacity = pages
        self.page_nbytes = page_nbytes
        self.pages = np.ndarray((pages, page_nbytes), dtype=np.uint8, buffer=shm.buf)

    @property
    def name(self) -> str:
        return self._shm.name

    @classmethod
    def create(cls, pages: int, page_nbytes: int, prefix: str = "kvray") -> LandingBuffer:
        name = f"{prefix}_{os.getpid()}_{secrets.token_hex(4)}"
        try:
            shm = shared_memory.SharedMemory(name=name, create=True, size=max(pages * page_nbytes, 1))
        except OSError as exc:
            raise StorageError(f"landing buffer: cannot create shared memory {name!r}: {exc}") from None
        return cls(shm, pages, page_nbytes, owner=True)

    @classmethod
    def attach(cls, name: str, pages: int, page_nbytes: int) -> LandingBuffer:
        return cls(attach_shared(name, pages * page_nbytes, "landing buffer"), pages, page_nbytes, owner=False)

    def close(self) -> None:
        if self._shm is None:
            return
        del self.pages
        self._shm.close()
        if self.owner:
            self._shm.unlink()
        self._shm = None
