"""Direct TCP page transfers between nodes: the cross-node path without Ray calls.

Ray's object store and collective paths cost one or more actor calls per transfer (about
a millisecond each on a small machine), which is most of the time of moving a few MiB.
So each store actor also runs a :class:`PageServer`: a listening socket on its node's
address with one thread per connection. A client keeps one connection per peer node
(:class:`PeerLinks`) and asks for a run of pages by key; the server answers with the
length of the cached, verified prefix it holds and those pages, which the client receives
straight into its landing buffer. Stores go the same way: the client sends a run of
pages with their keys and chain parent, the server keeps them and answers how many it
stored and which pages it dropped meanwhile. Nothing is pickled and no actor method runs.

Every connection opens with the runtime's secret token (32 random bytes made when the
runtime starts and handed by the controller to its stores and clients only): a peer
without it is disconnected before it can name a key. The token is not encryption; page
bytes cross the network in the clear, as with Ray's own transfers (docs/security.md).

Wire format, little-endian, requests pipelined on a connection, answers in order::

    client -> server   token (32 bytes, once), then per request: u8 op, u32 n, and
                         LOAD:  n x 16-byte keys
                         STORE: u8 has_parent, 16-byte parent key, n x 16-byte keys,
                                n x page_nbytes bytes
    server -> client     LOAD:  u32 got (<= n), got x page_nbytes bytes
                         STORE: u32 stored, u32 d, d x 16-byte keys dropped

Example::

    server = PageServer(read=store_read, write=store_write, page_nbytes=4096,
                        token=token, host="127.0.0.1", max_pages=256)
    links = PeerLinks(token, page_nbytes=4096, timeout_s=10)
    got = links.load(server.address, keys).receive(buffer_rows)   # rows [0, got) hold the pages
    stored, dropped = links.store(server.address, keys, rows, parent=None).receive()
"""

from __future__ import annotations

import contextlib
import hmac
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvray.core.errors import ClusterError
from kvray.core.keys import KEY_BYTES, pack_keys, unpack_keys

TOKEN_BYTES = 32
REQUEST = struct.Struct("<BI")  # op, pages
COUNT = struct.Struct("<I")
PARENT = struct.Struct("<B16s")  # has parent, parent key
LOAD, STORE = 1, 2

PageReader = Callable[[Sequence[int], np.ndarray], int]  # (keys, out rows) -> pages written
PageWriter = Callable[[Sequence[int], np.ndarray, "int | None"], tuple[int, list[int]]]  # -> (stored, dropped)


def _recv_exact(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from ``sock``; False if the peer closed first."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


def _recv_bytes(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    return bytes(buf) if _recv_exact(sock, memoryview(buf)) else None


class PageServer:
    """Serves one store's pages to token holders; see the module docstring.

    ``read(keys, out)`` writes the cached, verified prefix of ``keys`` into rows of ``out``
    and returns how many; the server never sends a page it did not get from it.
    ``write(keys, pages, parent)`` keeps a run of pages and returns (stored, keys dropped).
    """

    def __init__(self, read: PageReader, write: PageWriter, page_nbytes: int, token: bytes, host: str,
                 max_pages: int) -> None:
        self._read = read
        self._write = write
        self._page_nbytes = page_nbytes
        self._token = token
        self._max_pages = max_pages
        self._listener = socket.create_server((host, 0))
        self.address: tuple[str, int] = (host, self._listener.getsockname()[1])
        self.sent_bytes = 0
        self.received_bytes = 0
        self.rejected = 0
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="kvray-page-server", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="kvray-page-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            token = _recv_bytes(conn, TOKEN_BYTES)
            if token is None or not hmac.compare_digest(token, self._token):
                self.rejected += 1
                return
            rows = np.empty((0, self._page_nbytes), dtype=np.uint8)
            while (head := _recv_bytes(conn, REQUEST.size)) is not None:
                op, n = REQUEST.unpack(head)
                if n > self._max_pages or op not in (LOAD, STORE):
                    return  # not a kvray client of this runtime: hang up
                if len(rows) < n:
                    rows = np.empty((n, self._page_nbytes), dtype=np.uint8)
                if not (self._load if op == LOAD else self._store)(conn, rows[:n]):
                    return
        except OSError:
            return  # the client went away mid-request
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _load(self, conn: socket.socket, rows: np.ndarray) -> bool:
        raw = _recv_bytes(conn, len(rows) * KEY_BYTES)
        if raw is None:
            return False
        got = self._read(unpack_keys(raw), rows) if len(rows) else 0
        conn.sendall(COUNT.pack(got))
        if got:
            conn.sendall(memoryview(rows[:got]).cast("B"))
        self.sent_bytes += got * self._page_nbytes
        return True

    def _store(self, conn: socket.socket, rows: np.ndarray) -> bool:
        head = _recv_bytes(conn, PARENT.size)
        raw = _recv_bytes(conn, len(rows) * KEY_BYTES) if head is not None else None
        if raw is None or not _recv_exact(conn, memoryview(rows).cast("B")):
            return False
        has_parent, parent = PARENT.unpack(head)
        self.received_bytes += rows.nbytes
        stored, dropped = self._write(unpack_keys(raw), rows, int.from_bytes(parent, "little") if has_parent else None)
        conn.sendall(COUNT.pack(stored) + COUNT.pack(len(dropped)) + pack_keys(dropped))
        return True

    def close(self) -> None:
        with contextlib.suppress(OSError):  # never connected: nothing to shut down
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for conn in conns:
            with contextlib.suppress(OSError):  # already closed by the peer
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()


@dataclass
class _Link:
    sock: socket.socket
    broken: bool = False


@dataclass
class _Pending:
    """A request sent on a peer link, waiting for its answer (``link`` None: never sent)."""

    link: _Link | None
    pages: int

    def _answer(self, read: Callable[[socket.socket], object]) -> object | None:
        if self.link is None:
            return None
        try:
            return read(self.link.sock)
        except OSError:
            self.link.broken = True  # answers after this one can no longer be framed
            return None


def _count(sock: socket.socket) -> int:
    head = _recv_bytes(sock, COUNT.size)
    if head is None:
        raise OSError("peer closed the connection")
    return COUNT.unpack(head)[0]


class PendingLoad(_Pending):
    def receive(self, out: np.ndarray) -> int:
        """Receive the pages into rows of ``out``; 0 if the peer failed (a miss)."""

        def read(sock: socket.socket) -> int:
            got = _count(sock)
            if got > self.pages:
                raise OSError(f"peer answered {got} pages for a request of {self.pages}")
            if got and not _recv_exact(sock, memoryview(out[:got]).cast("B")):
                raise OSError("peer closed the connection mid-page")
            return got

        return self._answer(read) or 0


class PendingStore(_Pending):
    def receive(self) -> tuple[int, list[int]] | None:
        """(pages stored, keys the peer dropped meanwhile), or None if the peer failed."""

        def read(sock: socket.socket) -> tuple[int, list[int]]:
            stored, dropped = _count(sock), _count(sock)
            if stored > self.pages:
                raise OSError(f"peer stored {stored} pages of {self.pages}")
            raw = _recv_bytes(sock, dropped * KEY_BYTES)
            if raw is None:
                raise OSError("peer closed the connection")
            return stored, unpack_keys(raw)

        return self._answer(read)


class PeerLinks:
    """One persistent, authenticated connection per peer page server."""

    def __init__(self, token: bytes, page_nbytes: int, timeout_s: float) -> None:
        if len(token) != TOKEN_BYTES:
            raise ClusterError(f"transfer token must be {TOKEN_BYTES} bytes, got {len(token)}")
        self._token = token
        self._page_nbytes = page_nbytes
        self._timeout_s = timeout_s
        self._links: dict[tuple[str, int], _Link] = {}

    def _link(self, address: tuple[str, int]) -> _Link:
        link = self._links.get(address)
        if link is not None and not link.broken:
            return link
        if link is not None:
            link.sock.close()
        sock = socket.create_connection(address, timeout=self._timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(self._token)
        link = self._links[address] = _Link(sock)
        return link

    def _send(self, address: tuple[str, int], parts: Sequence[bytes | memoryview]) -> _Link | None:
        try:
            link = self._link(address)
            for part in parts:
                link.sock.sendall(part)
        except OSError:
            self._drop(address)
            return None
        return link

    def load(self, address: tuple[str, int], keys: Sequence[int]) -> PendingLoad:
        """Ask for the cached prefix of ``keys``; :meth:`PendingLoad.receive` reads the answer."""
        return PendingLoad(self._send(address, [REQUEST.pack(LOAD, len(keys)) + pack_keys(keys)]), len(keys))

    def store(self, address: tuple[str, int], keys: Sequence[int], pages: np.ndarray,
              parent: int | None) -> PendingStore:
        """Send a run of pages (rows of ``pages``, one per key) continuing ``parent``'s chain."""
        head = REQUEST.pack(STORE, len(keys)) + PARENT.pack(parent is not None, (parent or 0).to_bytes(KEY_BYTES, "little"))
        link = self._send(address, [head + pack_keys(keys), memoryview(np.ascontiguousarray(pages)).cast("B")])
        return PendingStore(link, len(keys))

    def _drop(self, address: tuple[str, int]) -> None:
        link = self._links.pop(address, None)
        if link is not None:
            link.sock.close()

    def close(self) -> None:
        for address in list(self._links):
            self._drop(address)
