"""Disk pool: page slots in one file per model fingerprint, surviving restarts.

Slot ``i`` of ``<dir>/<fingerprint>.kvpages`` starts at ``i * stride`` with a 128-byte
header (magic, key, parent key, fingerprint, checksum, length) followed by the page
bytes, written straight from the caller's buffers (an engine's KV tensor slices, no
staging copy) and hashed on the way. A new process pointed at the same directory rebuilds what it holds
by reading the headers (:meth:`DiskPool.scan`); a freed slot has its magic cleared so it
is never resurrected. The file name comes from the fingerprint alone, never from a user
string, so it is predictable: whoever can write the directory could plant a link or a file
of their own there. The pool therefore trusts a directory and a file only if they are
this user's and closed to group and others (0700 / 0600, whether kvray created them or
found them), opens neither through a symbolic link, and refuses anything else with an
error naming the path and what is wrong with it (see docs/security.md).
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
import struct
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import numpy as np
import xxhash

from kvray.core.busy import BusyShare
from kvray.core.errors import StorageError
from kvray.core.pages import hash_runs, runs

try:  # built with kvray (setup.py); without it page-cache reads copy, then hash
    from kvray.core import _pagecopy
except ImportError:
    _pagecopy = None

MAGIC = b"KVRAYPG1"
HEADER = struct.Struct("<8sHHI16s16s16sQQ")  # magic, version, flags, pad, key, parent, fingerprint, checksum, nbytes
HEADER_BYTES = 128
SLOT_HEADER = struct.Struct(HEADER.format + f"{HEADER_BYTES - HEADER.size}x")  # the header padded with zeros
VERSION = 2
FLAG_HAS_PARENT = 1
ALIGN = 4096
# A write or a page-cache read moves a page in batches of this many bytes, each hashed
# while it is still in cache (see DiskPool.write_runs and _read_cached). Measured on the
# tier rows of `kvray bench --only disk_tier` (L2 1 MiB a core, L3 32 MiB): 2 MiB beat
# 1 MiB by 0.01-0.02 of raw file I/O, 256 and 512 KiB lost 0.03-0.09 to the extra calls.
CACHED_BATCH_BYTES = 2 << 20
READERS = 4  # reads of one request in flight at once: queue depth for the device, see read_many
READ_BATCH_BYTES = 8 << 20  # pages in consecutive slots are read together, up to this much per call
IOV_MAX = 1024  # Linux's limit on the buffers of one preadv
SHORT_PAGE_BYTES = 240  # pages this small are not copied from the mapping (see _pagecopy.c)


def _batches(chunks: list[np.ndarray], limit: int) -> list[tuple[list[np.ndarray], int]]:
    """Consecutive groups of chunks of at most ``limit`` bytes each (a larger chunk alone),
    each with its size in bytes."""
    groups: list[tuple[list[np.ndarray], int]] = []
    group: list[np.ndarray] = []
    size = 0
    for chunk in chunks:
        if group and size + chunk.nbytes > limit:
            groups.append((group, size))
            group, size = [], 0
        group.append(chunk)
        size += chunk.nbytes
    groups.append((group, size))
    return groups


def _advance(views: list[memoryview], done: int) -> None:
    """Drop the first ``done`` bytes from ``views`` (what a short ``preadv``/``pwritev`` did)."""
    while views and done >= len(views[0]):
        done -= len(views[0])
        views.pop(0)
    if views and done:
        views[0] = views[0][done:]


def _refusal(path: Path, exc: OSError) -> str:
    """Why ``path`` could not be opened, in words a user can act on (``O_NOFOLLOW`` reports
    a link as ELOOP, or as ENOTDIR where a directory was asked for)."""
    if exc.errno == errno.ELOOP or (exc.errno == errno.ENOTDIR and path.is_symlink()):
        return "it is a symbolic link (kvray does not follow links in its disk tier)"
    return exc.strerror or str(exc)


def _check_private(path: Path, info: os.stat_result, what: str, private_mode: int) -> None:
    """Refuse ``path`` unless this user owns it and group and others have no access to it.

    A directory or file someone else owns, or can write, lets them plant or rewrite pages
    whose checksums they recompute (see docs/security.md); one they can read leaks KV.
    """
    uid = os.geteuid()
    if info.st_uid != uid:
        raise StorageError(f"disk tier: {what} {path} is owned by uid {info.st_uid}, not by this user (uid {uid})")
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077:
        raise StorageError(f"disk tier: {what} {path} has mode {mode:04o}, open to group or others (chmod {private_mode:o} it)")


def _open_private_directory(directory: Path) -> int:
    """Create ``directory`` (0700) if missing; a descriptor of it once it checks out as private."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise StorageError(f"disk tier: cannot create directory {directory}: {exc.strerror}") from None
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise StorageError(f"disk tier: cannot open directory {directory}: {_refusal(directory, exc)}") from None
    try:
        _check_private(directory, os.fstat(fd), "directory", 0o700)
    except StorageError:
        os.close(fd)
        raise
    return fd


def _open_private_file(path: Path, directory_fd: int) -> int:
    """Open (or create, 0600) the slot file inside the already checked directory.

    Opened relative to the directory's descriptor, so the directory cannot be swapped
    between its check and this open, and with ``O_NOFOLLOW``, so a link planted at the
    predictable name is refused instead of followed to a file it would overwrite.
    """
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path.name, flags, 0o600, dir_fd=directory_fd)
    except OSError as exc:
        raise StorageError(f"disk tier: cannot open {path}: {_refusal(path, exc)}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise StorageError(f"disk tier: {path} is not a regular file")
        if info.st_nlink != 1:
            raise StorageError(f"disk tier: {path} has {info.st_nlink} hard links; its pages must be its own")
        _check_private(path, info, "file", 0o600)
    except StorageError:
        os.close(fd)
        raise
    return fd


def verified(stored: StoredPage | None, digest: int, expected: int) -> bool:
    """A page read back is the one indexed: its header and its bytes both carry ``expected``."""
    return stored is not None and stored.checksum == expected and digest == expected


class StoredPage(NamedTuple):
    """What a slot's header says it holds (a tuple: one is made per page read, and a frozen
    dataclass cost ~2 µs more each, a measurable share of a page-cache read)."""

    slot: int
    key: int
    parent_key: int | None  # None: the first page of a chain
    fingerprint: bytes
    checksum: int
    nbytes: int


class DiskPool:
    """Fixed-size page slots in a file under ``directory``.

    Example::

        pool = DiskPool("/tmp/kv", capacity=16, page_nbytes=4096, fingerprint=fp.digest)
        digest = pool.write(0, key, None, page)          # page: a uint8 page view
        assert pool.read_into(0, out, expected=digest)   # False: missing, torn or corrupt
    """

    kind = "disk"
    stand_in = False

    def __init__(self, directory: str | Path, capacity: int, page_nbytes: int, fingerprint: bytes, fsync: bool = False) -> None:
        self.directory = Path(directory)
        self.capacity = capacity
        self.page_nbytes = page_nbytes
        self.fingerprint = fingerprint
        self.fsync = fsync
        self.stride = -(-(HEADER_BYTES + page_nbytes) // ALIGN) * ALIGN
        self._readers: ThreadPoolExecutor | None = None
        self._nowait = hasattr(os, "RWF_NOWAIT")  # until the file system refuses it (Linux 4.14+)
        self._mapped = _pagecopy is not None and page_nbytes > SHORT_PAGE_BYTES  # until mapping fails
        self._map: mmap.mmap | None = None
        self._map_lock = threading.Lock()
        self.path = self.directory / f"{fingerprint.hex()}.kvpages"
        # how busy the drive's reads and writes have been lately (their read and write calls;
        # copies served from the page cache are not drive time), told to a policy that asks
        # (RequestInfo.load_util, disk_write_util: PageStore.on_request)
        self.reads = BusyShare()
        self.writes = BusyShare()
        directory_fd = _open_private_directory(self.directory)
        try:
            self._fd = _open_private_file(self.path, directory_fd)
        finally:
            os.close(directory_fd)
        if hasattr(os, "posix_fadvise"):
            # A slot is read whole, by one preadv: the kernel's read-ahead can only add the
            # neighbouring slots, which belong to other requests. With this VM's 8 MiB
            # read-ahead it held a cold 64 MiB request of 8 MiB pages at 0.58-0.61 GB/s,
            # against 1.51-1.68 without it (docs/benchmarks.md, "kvray against LMCache").
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)

    def _header(self, key: int, parent_key: int | None, checksum: int) -> bytes:
        flags = 0 if parent_key is None else FLAG_HAS_PARENT
        return SLOT_HEADER.pack(
            MAGIC, VERSION, flags, 0, key.to_bytes(16, "little"), (parent_key or 0).to_bytes(16, "little"),
            self.fingerprint, checksum, self.page_nbytes,
        )  # fmt: skip

    def view(self, slot: int) -> None:
        """Disk slots are not addressable memory: moves read them out first."""
        return None

    def write(self, slot: int, key: int, parent_key: int | None, page: np.ndarray) -> int:
        """Write a page view run by run, straight from the caller's buffer; return its checksum."""
        return self.write_runs(slot, key, parent_key, runs(page))

    def read_into(self, slot: int, page: np.ndarray, expected: int) -> bool:
        """Read ``slot`` into a page view; True only if its header and its bytes carry ``expected``."""
        return verified(*self.read_runs(slot, runs(page)), expected)

    def write_runs(self, slot: int, key: int, parent_key: int | None, chunks: list[np.ndarray]) -> int:
        """Write one page, given as byte chunks that add up to ``page_nbytes``; return its checksum.

        Chunks go out in ``pwritev`` batches of :data:`CACHED_BATCH_BYTES`, each hashed
        just before it is written: the hash pulls the batch into cache and the kernel's
        copy then reads it from there, so the engine's memory is read once, not twice.
        The header (with the checksum) goes last, so a write cut short leaves a slot
        without a valid header, which a restart ignores and a read rejects.
        """
        offset = slot * self.stride + HEADER_BYTES
        hasher = xxhash.xxh3_64()
        update, fd, clock = hasher.update, self._fd, time.monotonic
        io = 0.0  # time in the write calls, not in hashing
        started: float | None = None  # the write call under way, if any
        try:
            for batch, nbytes in self._cached_batches(chunks):
                for chunk in batch:
                    update(chunk)
                started = clock()
                written = os.pwritev(fd, batch, offset)  # the chunks themselves: no view per chunk
                if written < nbytes:
                    self._pwritev_all(batch, offset, skip=written)
                io += clock() - started
                started = None
                offset += nbytes
            digest = hasher.intdigest()
            header = self._header(key, parent_key, digest)
            started = clock()
            if os.pwrite(fd, header, slot * self.stride) < HEADER_BYTES:
                self._pwritev_all([np.frombuffer(header, np.uint8)], slot * self.stride)
            if self.fsync:
                os.fdatasync(self._fd)
        except OSError as exc:
            self._clear(slot)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise StorageError(f"disk tier {self.directory}: no space left writing slot {slot}") from None
            raise StorageError(f"disk tier {self.directory}: write of slot {slot} failed: {exc.strerror}") from None
        finally:  # the call under way when it ended or failed (a failed write held the drive too)
            ended = clock()
            if started is not None:
                io += ended - started
            # buffered writes are page-cache copies, timed all the same: the kernel makes
            # them wait once dirty pages outrun the drive
            self.writes.add(ended - io, ended)
        return digest

    def _cached_batches(self, chunks: list[np.ndarray]) -> list[tuple[list[np.ndarray], int]]:
        """A page's chunks (adding up to ``page_nbytes``) in batches of :data:`CACHED_BATCH_BYTES`:
        a page no larger is one batch, without walking its chunks."""
        if self.page_nbytes <= CACHED_BATCH_BYTES:
            return [(chunks, self.page_nbytes)]
        return _batches(chunks, CACHED_BATCH_BYTES)

    def _pwritev_all(self, chunks: list[np.ndarray], offset: int, skip: int = 0) -> int:
        """Write ``chunks`` at ``offset``, their first ``skip`` bytes already written
        (finishing short writes); return the end offset."""
        views = [memoryview(c).cast("B") for c in chunks]
        offset += skip
        _advance(views, skip)
        while views:
            written = os.pwritev(self._fd, views, offset)
            offset += written
            _advance(views, written)
        return offset

    def _preadv_all(self, chunks: list[np.ndarray | bytearray], offset: int, flags: int = 0, skip: int = 0) -> bool:
        """Fill ``chunks`` from ``offset``, their first ``skip`` bytes already read; False if
        the file ends first. With ``RWF_NOWAIT`` also False (``BlockingIOError``) as soon as a
        byte is not in the page cache."""
        views = [memoryview(c).cast("B") for c in chunks]
        want = sum(v.nbytes for v in views) - skip
        _advance(views, skip)
        return self._preadv_upto(views, offset + skip, flags) == want

    def read_runs(self, slot: int, chunks: list[np.ndarray]) -> tuple[StoredPage | None, int]:
        """Read ``slot`` into ``chunks``: (its header, or None if missing or torn; the
        checksum of the bytes read).

        Header and page are one ``preadv``, so a page not in the page cache reaches the
        device as one request of the whole page (split only by the device's own limit),
        not a header read followed by a ramp of read-ahead; the bytes are hashed after.
        """
        header = bytearray(HEADER_BYTES)
        started = time.monotonic()
        try:
            whole = self._preadv_all([header, *chunks], slot * self.stride)
        except OSError as exc:  # the device failed, not the page: the store keeps it and reports
            raise StorageError(f"disk tier {self.directory}: read of slot {slot} failed: {exc.strerror}") from None
        finally:  # the read call alone (not the hashing after it); one that finds nothing held the drive too
            self.reads.add(started, time.monotonic())
        if not whole:
            return None, 0
        page = self._parse(slot, bytes(header))
        if page is None:
            return None, 0
        return page, hash_runs(chunks)

    def _read_cached(self, slot: int, chunks: list[np.ndarray]) -> tuple[bytes | bytearray | None, int] | None:
        """Read ``slot`` into ``chunks`` if every byte of it is in the page cache, else None
        (nothing waits on the device): its raw header (None if the file ends inside the
        slot: torn) and the checksum of the bytes read, for :meth:`_parse` to judge later.

        With :mod:`kvray.core._pagecopy`, from the file's mapping: the page is hashed in the
        same pass that copies it into ``chunks`` (:meth:`_read_mapped`). Without it, batches
        of :data:`CACHED_BATCH_BYTES` by ``preadv`` with ``RWF_NOWAIT``, each hashed right
        after while it is still in cache: a second pass, though over cached bytes.
        """
        if self._mapped:
            return self._read_mapped(slot, chunks)
        if not self._nowait:
            return None
        header = bytearray(HEADER_BYTES)
        hasher = xxhash.xxh3_64()
        update, fd, nowait = hasher.update, self._fd, os.RWF_NOWAIT
        offset = slot * self.stride
        try:
            for i, (batch, nbytes) in enumerate(self._cached_batches(chunks)):
                if i == 0:
                    batch, nbytes = [header, *batch], nbytes + HEADER_BYTES
                got = os.preadv(fd, batch, offset, nowait)  # the chunks themselves: no view per chunk
                if got < nbytes and not self._preadv_all(batch, offset, nowait, skip=got):
                    return None, 0  # the file ends inside the slot: torn
                offset += nbytes
                for chunk in batch[1:] if i == 0 else batch:
                    update(chunk)
        except BlockingIOError:
            return None
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise StorageError(f"disk tier {self.directory}: read of slot {slot} failed: {exc.strerror}") from None
            self._nowait = False  # a file system without RWF_NOWAIT: every read goes to the readers
            return None
        return header, hasher.intdigest()

    def _read_mapped(self, slot: int, chunks: list[np.ndarray]) -> tuple[bytes | None, int] | None:
        """:meth:`_read_cached` from the file's mapping: the page's bytes copied and hashed in
        one pass (``_pagecopy.copy_hash``): 0.94 / 0.81 of a plain ``preadv`` for 2 / 16 MiB
        pages where ``preadv`` then xxh3 measured 0.63 / 0.57 (medians of three alternated
        ``kvray bench --only disk_tier`` runs each, load average 13-20 on the 2 cores).

        ``copy_hash`` copies nothing unless every page of the slot is in the page cache
        (``mincore``), and a slot cut off under it (the file truncated by someone else: an
        access past the end raises ``SIGBUS``) comes back None too; either way the device
        path (:meth:`read_runs`) then reads it, and finds it torn if it is. The header is
        read with ``pread``, which reports a short file instead of faulting.
        """
        mapping = self._mapping()
        if mapping is None:
            return None
        start = slot * self.stride
        try:
            header = os.pread(self._fd, HEADER_BYTES, start)
        except OSError as exc:
            raise StorageError(f"disk tier {self.directory}: read of slot {slot} failed: {exc.strerror}") from None
        if len(header) < HEADER_BYTES:
            return None, 0  # the file ends inside the slot: torn
        digest = _pagecopy.copy_hash(chunks, mapping, start + HEADER_BYTES, True)
        return None if digest is None else (header, digest)

    def _mapping(self) -> mmap.mmap | None:
        """The slot file mapped read-only, all ``capacity`` slots of it (the file is made that
        long first, sparse: a mapping cannot grow with the file), or None where the file
        cannot be mapped (every read then goes the ``preadv`` way)."""
        if self._map is None and self._mapped:
            with self._map_lock:
                if self._map is None and self._mapped:
                    length = self.capacity * self.stride
                    try:
                        if os.fstat(self._fd).st_size < length:
                            os.ftruncate(self._fd, length)
                        self._map = mmap.mmap(self._fd, length, mmap.MAP_SHARED, mmap.PROT_READ)
                    except (OSError, ValueError):
                        self._mapped = False
        return self._map

    def read_many(self, pages: list[tuple[int, list[np.ndarray]]]) -> Iterator[tuple[StoredPage | None, int]]:
        """:meth:`read_runs` for each ``(slot, chunks)``, in order.

        Pages in the page cache are copied and hashed here, on the caller's thread
        (:meth:`_read_cached`): handing them to threads costs more than it saves. They are
        all copied first and their headers parsed after, at the first page asked for: each
        2 MiB copy evicts the interpreter's data from the core's 1 MiB L2, so Python run
        between copies costs several times what it costs run together. From the
        first page that is not, the rest go to :data:`READERS` threads at once (``preadv``
        and xxh3 release the GIL), so the device has several pages in flight and page i is
        hashed while page i+1 is read; pages in consecutive slots go as one read
        (:meth:`_batched`). Closing the iterator early (a page failed verification) cancels the reads not started and waits for those running, so no
        chunk is written after.
        """
        cached: list[tuple[bytes | bytearray | None, int]] = []
        for slot, chunks in pages:  # page-cache copies: no drive time (reads)
            read = self._read_cached(slot, chunks)
            if read is None:
                break
            cached.append(read)
        for (slot, _), (header, digest) in zip(pages, cached):
            page = None if header is None else self._parse(slot, header)
            yield (page, digest) if page is not None else (None, 0)
        cold = pages[len(cached) :]
        if len(cold) < 2:
            yield from (self.read_runs(slot, chunks) for slot, chunks in cold)
            return
        if self._readers is None:
            self._readers = ThreadPoolExecutor(READERS, thread_name_prefix="kvray-disk-read")
        futures: list[Future[list[tuple[StoredPage | None, int]]]] = [
            self._readers.submit(self._read_batch, batch) for batch in self._batched(cold)
        ]
        try:
            for future in futures:
                yield from future.result()
        finally:
            for future in futures:
                future.cancel()
            for future in futures:
                if not future.cancelled():
                    future.exception()

    def _batched(self, pages: list[tuple[int, list[np.ndarray]]]) -> list[list[tuple[int, list[np.ndarray]]]]:
        """Runs of pages in consecutive slots, each at most ``READ_BATCH_BYTES`` and ``IOV_MAX``
        buffers: a long prefix stored in order lies in consecutive slots, and one read of
        several MiB runs at the device's sequential speed where one read per 64 KiB run of a
        page (a strided engine tensor) measured a tenth of it on a cold cache."""
        batches: list[list[tuple[int, list[np.ndarray]]]] = []
        limit = max(1, READ_BATCH_BYTES // self.stride)
        buffers = 0
        for slot, chunks in pages:
            last = batches[-1] if batches else None
            need = len(chunks) + 2  # header, runs, the padding up to the next slot
            if last and last[-1][0] + 1 == slot and len(last) < limit and buffers + need <= IOV_MAX:
                last.append((slot, chunks))
                buffers += need
            else:
                batches.append([(slot, chunks)])
                buffers = need
        return batches

    def _read_batch(self, batch: list[tuple[int, list[np.ndarray]]]) -> list[tuple[StoredPage | None, int]]:
        """:meth:`read_runs` of pages in consecutive slots with one ``preadv``; each page's
        header is parsed and its bytes hashed after it, as one read of its own would."""
        if len(batch) == 1:
            return [self.read_runs(*batch[0])]
        headers = [bytearray(HEADER_BYTES) for _ in batch]
        gap = bytearray(self.stride - HEADER_BYTES - self.page_nbytes)
        views: list[memoryview] = []
        for i, ((_, chunks), header) in enumerate(zip(batch, headers)):
            views.append(memoryview(header))
            views.extend(memoryview(c).cast("B") for c in chunks)
            if gap and i < len(batch) - 1:
                views.append(memoryview(gap))
        started = time.monotonic()
        try:
            got = self._preadv_upto(views, batch[0][0] * self.stride)
        except OSError as exc:  # the device failed, not the page: the store keeps it and reports
            raise StorageError(f"disk tier {self.directory}: read of slots {batch[0][0]}.. failed: {exc.strerror}") from None
        finally:
            self.reads.add(started, time.monotonic())
        results: list[tuple[StoredPage | None, int]] = []
        for i, ((slot, chunks), header) in enumerate(zip(batch, headers)):
            page = self._parse(slot, bytes(header)) if got >= (i * self.stride + HEADER_BYTES + self.page_nbytes) else None
            results.append((page, hash_runs(chunks)) if page is not None else (None, 0))
        return results

    def _preadv_upto(self, views: list[memoryview], offset: int, flags: int = 0) -> int:
        """Fill ``views`` from ``offset`` (finishing short reads, ``IOV_MAX`` buffers per
        call); the bytes read, fewer only where the file ends."""
        total, first = 0, 0
        while first < len(views):
            n = os.preadv(self._fd, views[first : first + IOV_MAX], offset + total, flags)
            if n == 0:
                break
            total += n
            while first < len(views) and n >= len(views[first]):
                n -= len(views[first])
                first += 1
            if first < len(views) and n:
                views[first] = views[first][n:]
        return total

    def _parse(self, slot: int, header: bytes | bytearray) -> StoredPage | None:
        magic, version, flags, _, key, parent, fingerprint, checksum, nbytes = HEADER.unpack_from(header)
        if magic != MAGIC or version != VERSION or fingerprint != self.fingerprint or nbytes != self.page_nbytes:
            return None
        parent_key = int.from_bytes(parent, "little") if flags & FLAG_HAS_PARENT else None
        return StoredPage(slot, int.from_bytes(key, "little"), parent_key, fingerprint, checksum, nbytes)

    def free(self, slot: int) -> None:
        self._clear(slot)

    def _clear(self, slot: int) -> None:
        try:
            os.pwrite(self._fd, b"\0" * len(MAGIC), slot * self.stride)
        except OSError:
            pass  # a slot we cannot clear reads back as torn or fails its checksum

    def scan(self) -> list[StoredPage]:
        """Headers of every slot that holds a page of this fingerprint (restart recovery).

        Slots never written are holes of a sparse file (:meth:`_mapping` makes the file
        ``capacity`` slots long): ``SEEK_DATA`` skips them, so a restart reads the headers of
        the slots written, not of the whole capacity (a file system without it reports
        everything as data: every slot is read then)."""
        end = min(self.capacity, os.fstat(self._fd).st_size // self.stride + 1)
        found = []
        slot = 0
        while slot < end:
            try:
                slot = max(slot, os.lseek(self._fd, slot * self.stride, os.SEEK_DATA) // self.stride)
            except OSError as exc:
                if exc.errno == errno.ENXIO:
                    break  # nothing but holes from this slot on
                if exc.errno != errno.EINVAL:  # EINVAL: no SEEK_DATA here, read every slot
                    raise StorageError(f"disk tier {self.directory}: scan failed: {exc.strerror}") from None
            if slot >= end:
                break
            header = os.pread(self._fd, HEADER_BYTES, slot * self.stride)
            if len(header) == HEADER_BYTES and (page := self._parse(slot, header)) is not None:
                found.append(page)
            slot += 1
        return found

    def close(self) -> None:
        if self._readers is not None:
            self._readers.shutdown(wait=True, cancel_futures=True)
            self._readers = None
        with self._map_lock:
            if self._map is not None:
                self._map.close()
                self._map = None
            self._mapped = False
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
