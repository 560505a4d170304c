"""Landing buffers: the same-node data plane between an engine and its node's store.

An engine process owns one POSIX shared-memory buffer of ``pages x page_nbytes`` bytes
(its request-sized KV staging area). The node's store actor maps the same segment by
name, once, and copies pages straight between its tiers and the buffer: a store, or a
load of pages on the store's disk tier, is one actor call carrying only keys and offsets,
and the page bytes cross no socket, no pickle and no object store. Pages on the store's
host tier need not even that call: the engine maps the host tier too
(:class:`~kvray.core.tiers.directory.SharedHostTier`) and copies them into the buffer itself.
Cross-node pages are received into the same buffer by the collective path, so the engine
always finds a request's KV in one place.

Example::

    buf = LandingBuffer.create(pages=64, page_nbytes=1 << 20)     # in the engine
    peer = LandingBuffer.attach(buf.name, 64, 1 << 20)            # in the store actor
    peer.pages[3][:] = 7; buf.pages[3][0]                         # -> 7
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat
import sys
from collections.abc import Container
from multiprocessing import shared_memory

import numpy as np

from kvray.core.errors import StorageError
from kvray.core.tiers.directory import SHM_DIR
from kvray.core.tiers.memory import attach_shared

LANDING_NAME = re.compile(r"kvray_(\d+)_[0-9a-f]{8}")  # a landing buffer's name: its engine's pid


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
    def create(cls, pages: int, page_nbytes: int) -> LandingBuffer:
        name = f"kvray_{os.getpid()}_{secrets.token_hex(4)}"  # what LANDING_NAME recognises
        try:
            shm = shared_memory.SharedMemory(name=name, create=True, size=max(pages * page_nbytes, 1))
        except OSError as exc:
            raise StorageError(f"landing buffer: cannot create shared memory {name!r}: {exc}") from None
        return cls(shm, pages, page_nbytes, owner=True)

    @classmethod
    def attach(cls, name: str, pages: int, page_nbytes: int) -> LandingBuffer:
        return cls(attach_shared(name, pages * page_nbytes, "landing buffer"), pages, page_nbytes, owner=False)

    @property
    def views_out(self) -> int:
        """Views of ``pages`` alive besides ``pages`` itself (every slice of it refers to it).
        Unmapping while one is alive would leave it pointing at freed memory."""
        return sys.getrefcount(self.pages) - 2  # the attribute and getrefcount's argument

    @property
    def owner_alive(self) -> bool:
        """Whether the process that created this buffer still runs (on this node: engines
        and the store share its PID namespace, as Ray's workers do). A segment whose name
        ``create`` did not make names no process: it counts as alive and is left alone."""
        made = LANDING_NAME.fullmatch(self.name)
        if made is None:
            return True
        try:
            os.kill(int(made[1]), 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True  # someone else's process
        return True

    @property
    def unlinkable(self) -> bool:
        """Whether the name still belongs to the segment mapped here and to this user, so
        removing it frees this buffer's memory and nothing else: a name since taken by
        another segment, or another user's segment, is not this store's to remove."""
        try:
            named = os.lstat(SHM_DIR / self.name)
            mapped = os.fstat(self._shm._fd)  # type: ignore[union-attr]  # the descriptor SharedMemory keeps
        except OSError:
            return False
        same = (named.st_dev, named.st_ino) == (mapped.st_dev, mapped.st_ino)
        return same and stat.S_ISREG(named.st_mode) and named.st_uid == os.geteuid()

    def close(self, unlink: bool | None = None) -> None:
        """Unmap (no view of ``pages`` may be in use: the memory goes away); the owner, or
        ``unlink=True``, also removes the segment's name."""
        if self._shm is None:
            return
        del self.pages
        self._shm.close()
        if self.owner if unlink is None else unlink:
            with contextlib.suppress(FileNotFoundError):  # unlinked by someone else meanwhile
                self._shm.unlink()
        self._shm = None


def reap_orphans(buffers: dict[str, LandingBuffer], busy: Container[str] = ()) -> list[str]:
    """Unmap and unlink the buffers in ``buffers`` (not named in ``busy``) whose creating
    process died; returns the names forgotten.

    Only a name ``create`` made (``kvray_<pid>_<8 hex>``) counts, and only this user's
    segment, still the one mapped, is unlinked: a caller can ask the store to map any
    name, and asking must not let it remove another program's segment named after a
    dead process.

    An engine killed with SIGKILL (or with its node's process group) never unlinks its
    buffer, and the segment would hold its memory in ``/dev/shm`` until the machine
    restarts; the store that mapped it is the one process left that knows it. A buffer
    being copied through is ``busy``: unmapping it would pull the memory from under the copy.
    """
    reaped = []
    for name, buf in list(buffers.items()):
        if name in busy or buf.owner_alive:
            continue
        buf.close(unlink=buf.unlinkable)
        del buffers[name]
        reaped.append(name)
    return reaped
