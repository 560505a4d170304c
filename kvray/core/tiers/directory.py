"""The slot directory: which page each shared host slot holds, readable without asking anyone.

A node store keeps its host tier in POSIX shared memory so that an engine on the same
node can copy pages out of it itself, with no Ray call in the way. For that the engine
must know, without asking the store, which slot holds a key and whether the slot's bytes
are stable. The directory is a second small shared segment the store (the single
writer, under its lock) keeps current:

- per slot: the 128-bit key it holds (two uint64), its checksum, and a generation
  counter used as a seqlock. The generation is odd from the moment the slot is freed
  until a new page is fully written into it and published, and even while a published
  page sits there;
- a key -> slot table, open addressing with linear probing from the key's low bits (keys
  are xxh3-128 digests, already uniform) and backward-shift deletion, so probes never
  cross tombstones.

A reader copies a page optimistically: find the slot, read an even generation and the
key, copy, read the generation again. If it changed (the slot was freed, demoted,
evicted or rewritten meanwhile) or the key differs, the copy is discarded and the page
is a miss. The table is only a hint: a reader racing a deletion's backward shift may
miss an entry that is moving (a miss, never a wrong slot), because every slot it
finds is validated against the slot's own key and generation.

Memory ordering: on x86-64, whose TSO model keeps stores in program order and loads in
program order, plain numpy stores and loads (each a separate C call, which the compiler
cannot reorder across) make this seqlock correct: a reader that sees the same even
generation before and after its copy read bytes that were all written before that
generation was published. Python offers no fences, and on a weaker memory model
(aarch64, POWER) loads and stores to different words may be seen out of order: a reader
could pair a stale generation and key with a new page's bytes *and* its new checksum, so
``checksum_memory`` would not catch it either. A store therefore shares its host tier and
publishes a directory only where :func:`mapped_reads_sound` says so; elsewhere engines
read every page through the store's lock (``read_into``), which is slower but correct.

Example::
    import os
    from kvray.core.tiers.directory import SlotDirectory

    name = f"kvray_example_dir_{os.getpid()}"
    d = SlotDirectory.create(name, capacity=8)    # in the store
    d.publish(3, key=0x1234, checksum=0)         # after writing slot 3
    r = SlotDirectory.attach(name)               # in an engine
    assert r.find(0x1234) == 3
    r.close(); d.close()
"""

from __future__ import annotations

import contextlib
import os
import platform
import stat
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np

from kvray.core.errors import StorageError
from kvray.core.keys import MASK64
from kvray.core.pages import hash_page
from kvray.core.tiers.memory import HostPool, attach_shared

MAGIC = 0x6B7672617964_0001  # "kvrayd", layout version 1
OPEN, CLOSED = 1, 2
EMPTY = -1
SHM_DIR = Path("/dev/shm")  # where Linux keeps POSIX shared-memory segments
_HEADER = 8  # uint64 words: magic, capacity, table size, state, (reserved)
ORDERED_MACHINES = frozenset({"x86_64", "amd64"})  # total store order: the seqlock needs no fences


def mapped_reads_sound() -> bool:
    """Whether this machine keeps loads and stores in program order, as the seqlock needs
    (see the module docstring); ``platform.machine()`` names the architecture."""
    return platform.machine().lower() in ORDERED_MACHINES


class SlotDirectory:
    """Key, checksum and generation of every shared host slot, plus a key -> slot table.

    The store creates and writes it (``publish``, ``free``); engines attach read-only
    and use ``find`` and ``stable``. See the module docstring for the protocol.
    """

    def __init__(self, shm: shared_memory.SharedMemory, owner: bool) -> None:
        self._shm = shm
        self.owner = owner
        magic, capacity, table_size = np.frombuffer(shm.buf, dtype=np.uint64, count=3).tolist()
        if magic != MAGIC or table_size & (table_size - 1) or shm.size < self._nbytes(capacity, table_size):
            shm.close()
            raise StorageError(f"shared segment {shm.name!r} is not a kvray slot directory")
        self.capacity = capacity
        header = np.ndarray((_HEADER,), dtype=np.uint64, buffer=shm.buf)
        offset = _HEADER * 8
        self._header = header
        self.keys = np.ndarray((self.capacity, 2), dtype=np.uint64, buffer=shm.buf, offset=offset)
        offset += self.keys.nbytes
        self.generations = np.ndarray((self.capacity,), dtype=np.uint64, buffer=shm.buf, offset=offset)
        offset += self.generations.nbytes
        self.checksums = np.ndarray((self.capacity,), dtype=np.uint64, buffer=shm.buf, offset=offset)
        offset += self.checksums.nbytes
        self.table = np.ndarray((table_size,), dtype=np.int64, buffer=shm.buf, offset=offset)
        self._mask = table_size - 1

    @property
    def name(self) -> str:
        return self._shm.name

    @staticmethod
    def _nbytes(capacity: int, table_size: int) -> int:
        return _HEADER * 8 + capacity * 4 * 8 + table_size * 8

    @classmethod
    def create(cls, name: str, capacity: int) -> SlotDirectory:
        """A new directory of ``capacity`` slots, all free (odd generation)."""
        table_size = 1 << max(2 * capacity - 1, 1).bit_length()  # load factor <= 1/2
        try:
            shm = shared_memory.SharedMemory(name=name, create=True, size=cls._nbytes(capacity, table_size))
        except OSError as exc:
            raise StorageError(f"slot directory: cannot create shared memory {name!r}: {exc}") from None
        header = np.ndarray((_HEADER,), dtype=np.uint64, buffer=shm.buf)
        header[:4] = (MAGIC, capacity, table_size, OPEN)
        directory = cls(shm, owner=True)
        directory.generations[:] = 1
        directory.table[:] = EMPTY
        del header
        return directory

    @classmethod
    def attach(cls, name: str) -> SlotDirectory:
        """Map a store's directory (read-only use; the store owns its lifetime)."""
        return cls(attach_shared(name, _HEADER * 8, "slot directory"), owner=False)

    @property
    def open(self) -> bool:
        """False once the store closed it: its slots no longer mean anything."""
        return int(self._header[3]) == OPEN

    # -- writer (the store, under its lock) -------------------------------------------------
    def publish(self, slot: int, key: int, checksum: int) -> None:
        """Slot ``slot`` now holds the fully written page ``key``."""
        self.free(slot)  # no-op unless the slot still showed an older page
        self.keys[slot] = (key & MASK64, key >> 64)
        self.checksums[slot] = checksum
        self.generations[slot] += 1  # even: stable from here on
        i = (key & MASK64) & self._mask
        while self.table[i] != EMPTY:
            i = (i + 1) & self._mask
        self.table[i] = slot

    def free(self, slot: int) -> None:
        """Slot ``slot`` stops holding its page (moved, evicted, dropped or never published)."""
        if not self.generations[slot] & 1:
            self.generations[slot] += 1  # odd first: a reader copying it now will notice
            self._unlink(slot)

    def _home(self, slot: int) -> int:
        return int(self.keys[slot, 0]) & self._mask

    def _unlink(self, slot: int) -> None:
        """Remove ``slot``'s table entry, shifting later entries of its probe run back."""
        i = self._home(slot)
        while self.table[i] != slot:
            i = (i + 1) & self._mask
        j = i
        while True:
            j = (j + 1) & self._mask
            entry = int(self.table[j])
            if entry == EMPTY:
                break
            home = self._home(entry)
            if (j - home) & self._mask >= (j - i) & self._mask:  # its home is not in (i, j]
                self.table[i] = entry
                i = j
        self.table[i] = EMPTY

    # -- readers ------------------------------------------------------------------------------
    def find(self, key: int) -> int:
        """The slot a published page ``key`` is in, or EMPTY (a hint; see :meth:`stable`)."""
        lo, hi = key & MASK64, key >> 64
        i = lo & self._mask
        for _ in range(len(self.table)):
            slot = int(self.table[i])
            if slot == EMPTY:
                break
            if 0 <= slot < self.capacity and int(self.keys[slot, 0]) == lo and int(self.keys[slot, 1]) == hi:
                return slot
            i = (i + 1) & self._mask
        return EMPTY

    def stable(self, slot: int, key: int) -> tuple[int, int] | None:
        """(generation, checksum) if ``slot`` holds ``key`` published, else None.

        The first read of an optimistic copy; the copy is good only if the generation
        is unchanged after it (:meth:`unchanged`).
        """
        generation = int(self.generations[slot])
        if generation & 1:
            return None
        checksum = int(self.checksums[slot])
        if int(self.keys[slot, 0]) != key & MASK64 or int(self.keys[slot, 1]) != key >> 64:
            return None
        return generation, checksum

    def unchanged(self, slot: int, generation: int) -> bool:
        return int(self.generations[slot]) == generation

    def close(self) -> None:
        """Unmap; the owner marks the directory closed first and unlinks it."""
        if self._shm is None:
            return
        if self.owner:
            self._header[3] = CLOSED
        del self._header, self.keys, self.generations, self.checksums, self.table
        self._shm.close()
        if self.owner:
            with contextlib.suppress(FileNotFoundError):  # retired by a successor already
                self._shm.unlink()
        self._shm = None


def directory_name(host_name: str) -> str:
    """The directory segment beside the shared host pool ``host_name``."""
    return f"{host_name}_dir"


def _own_segment(info: os.stat_result) -> bool:
    """Whether a /dev/shm entry is a segment this user made: a regular file of its uid.
    Another user's file (or a link) matching a store's name is theirs to keep, and
    touching it would fail or, as root, destroy it."""
    return stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid()


def retire(host_name: str) -> None:
    """Mark a dead store's directory closed (its readers drop it at once) and unlink its
    segments: a store killed without ``close`` leaves them behind until the machine reboots.
    Segments that are not this user's own (see :func:`_own_segment`) are left alone."""
    directory = SHM_DIR / directory_name(host_name)
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    with contextlib.suppress(OSError, ValueError), open(os.open(directory, flags), "r+b") as segment:
        if _own_segment(os.fstat(segment.fileno())):
            header = np.memmap(segment, dtype=np.uint64, mode="r+", shape=(_HEADER,))
            if int(header[0]) == MAGIC:
                header[3] = CLOSED
            del header
    for path in (directory, SHM_DIR / host_name):
        with contextlib.suppress(FileNotFoundError):
            if _own_segment(path.lstat()):
                path.unlink()


def retire_predecessors(prefix: str) -> list[str]:
    """Retire every host tier named ``prefix...`` that is this user's (an earlier incarnation
    of a store, killed before it could close them); returns the names retired."""
    retired = []
    for path in SHM_DIR.glob(f"{prefix}*"):
        with contextlib.suppress(FileNotFoundError):  # retired meanwhile
            if not path.name.endswith("_dir") and _own_segment(path.lstat()):
                retire(path.name)
                retired.append(path.name)
    return retired


class SharedHostTier:
    """An engine's mapping of a node store's shared host tier and its slot directory.

    Example::

        tier = SharedHostTier.attach("kvray_bench_1a2b_5f3e", capacity=72, page_nbytes=1 << 21)
        tier.held(keys)                       # leading pages published there
        tier.read(keys, rows, verify=False)   # copies the validated prefix into rows
    """

    def __init__(self, pool: HostPool, directory: SlotDirectory) -> None:
        self.pool = pool
        self.directory = directory

    @classmethod
    def attach(cls, name: str, capacity: int, page_nbytes: int) -> SharedHostTier:
        directory = SlotDirectory.attach(directory_name(name))
        if directory.capacity != capacity:
            directory.close()
            raise StorageError(f"slot directory of {name!r} has {directory.capacity} slots, expected {capacity}")
        try:
            pool = HostPool(capacity, page_nbytes, shared_name=name, attach=True)
        except StorageError:
            directory.close()
            raise
        return cls(pool, directory)

    @property
    def name(self) -> str:
        return self.pool.shared_name

    @property
    def open(self) -> bool:
        return self.directory.open

    def held(self, keys: list[int]) -> int:
        """How many leading ``keys`` are published in the host tier right now."""
        for i, key in enumerate(keys):
            slot = self.directory.find(key)
            if slot == EMPTY or self.directory.stable(slot, key) is None:
                return i
        return len(keys)

    def read(self, keys: list[int], rows: np.ndarray, verify: bool) -> int:
        """Copy the leading pages of ``keys`` that validate into ``rows``; returns how many.

        A page validates if its slot held it, published, before and after the copy (and,
        with ``verify``, its bytes match its checksum); the first that does not ends the
        prefix. Bytes copied for a page that failed are left in ``rows`` past the count.
        """
        directory = self.directory
        for i, key in enumerate(keys):
            slot = directory.find(key)
            seen = directory.stable(slot, key) if slot != EMPTY else None
            if seen is None:
                return i
            np.copyto(rows[i], self.pool.view(slot))
            if not directory.unchanged(slot, seen[0]) or (verify and hash_page(rows[i]) != seen[1]):
                return i
        return len(keys)

    def close(self) -> None:
        self.pool.close()
        self.directory.close()
