"""Direct TCP page transfers between nodes: the cross-node path without Ray calls.

Ray's object store and collective paths cost one or more actor calls per transfer (about
a millisecond each on a small machine), which is most of the time of moving a few MiB.
So each store actor also runs a :class:`PageServer`: a listening socket on its node's
address with one thread per connection. A client keeps one connection per peer node
(:class:`PeerLinks`) and asks for a run of pages by key; the server answers with the
length of the cached, verified prefix it holds and those pages, which the client receives
straight into its landing buffer. Nothing is pickled and no actor method runs.

Every connection opens with the runtime's secret token (32 random bytes made when the
runtime starts and handed by the controller to its stores and clients only): a peer
without it is disconnected before it can name a key. The token is not encryption; page
bytes cross the network in the clear, as with Ray's own transfers (docs/security.md).

Wire format, little-endian, one request at a time per connection, answers in order::

    client -> server   token (32 bytes, once), then per request: u32 n, n x 16-byte keys
    server -> client   u32 got (<= n), got x page_nbytes bytes

Example::

    server = PageServer(read=lambda keys, out: store_read(keys, out), page_nbytes=4096,
                        token=token, host="127.0.0.1", max_pages=256)
    links = PeerLinks(token, page_nbytes=4096, timeout_s=10)
    pending = links.request(server.address, keys)
    got = pending.receive(buffer_rows)          # rows [0, got) hold the pages
"""

from __future__ import annotations

import hmac
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvray.errors import ClusterError

TOKEN_BYTES = 32
COUNT = struct.Struct("<I")
KEY_BYTES = 16

PageReader = Callable[[Sequence[int], np.ndarray], int]  # (keys, out rows) -> pages written


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
    """

    def __init__(self, read: PageReader, page_nbytes: int, token: bytes, host: str, max_pages: int) -> None:
        self._read = read
        self._page_nbytes = page_nbytes
        self._token = token
        self._max_pages = max_pages
        self._listener = socket.create_server((host, 0))
        self.address: tuple[str, int] = (host, self._listener.getsockname()[1])
        self.sent_bytes = 0
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
            while (head := _recv_bytes(conn, COUNT.size)) is not None:
                (n,) = COUNT.unpack(head)
                if n > self._max_pages:
                    return  # not a kvray client of this runtime: hang up
                raw = _recv_bytes(conn, n * KEY_BYTES)
                if raw is None:
                    return
                keys = [int.from_bytes(raw[i : i + KEY_BYTES], "little") for i in range(0, len(raw), KEY_BYTES)]
                if len(rows) < n:
                    rows = np.empty((n, self._page_nbytes), dtype=np.uint8)
                got = self._read(keys, rows[:n]) if n else 0
                conn.sendall(COUNT.pack(got))
                if got:
                    conn.sendall(memoryview(rows[:got]).cast("B"))
                self.sent_bytes += got * self._page_nbytes
        except OSError:
            return  # the client went away mid-request
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def close(self) -> None:
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # never connected: nothing to shut down
        self._listener.close()
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed by the peer
            conn.close()


@dataclass
class PendingRun:
    """A request sent on a peer link, waiting for its answer."""

    link: _Link | None
    pages: int

    def receive(self, out: np.ndarray) -> int:
        """Receive the answer into rows of ``out``; 0 pages if the peer failed (a miss)."""
        link = self.link
        if link is None:
            return 0
        try:
            head = _recv_bytes(link.sock, COUNT.size)
            if head is None:
                raise OSError("peer closed the connection")
            (got,) = COUNT.unpack(head)
            if got > self.pages:
                raise OSError(f"peer answered {got} pages for a request of {self.pages}")
            if got and not _recv_exact(link.sock, memoryview(out[:got]).cast("B")):
                raise OSError("peer closed the connection mid-page")
            return got
        except OSError:
            link.broken = True  # answers after this one can no longer be framed
            return 0


@dataclass
class _Link:
    sock: socket.socket
    broken: bool = False


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

    def request(self, address: tuple[str, int], keys: Sequence[int]) -> PendingRun:
        """Send a request for ``keys``; the answer is read by :meth:`PendingRun.receive`."""
        try:
            link = self._link(address)
            link.sock.sendall(COUNT.pack(len(keys)) + b"".join(k.to_bytes(KEY_BYTES, "little") for k in keys))
        except OSError:
            self._drop(address)
            return PendingRun(None, len(keys))
        return PendingRun(link, len(keys))

    def _drop(self, address: tuple[str, int]) -> None:
        link = self._links.pop(address, None)
        if link is not None:
            link.sock.close()

    def close(self) -> None:
        for address in list(self._links):
            self._drop(address)
