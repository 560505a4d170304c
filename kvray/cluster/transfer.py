"""Direct TCP page transfers between nodes: the cross-node path without Ray calls.

Ray's object store and collective paths cost one or more actor calls per transfer (about
a millisecond each on a small machine), which is most of the time of moving a few MiB.
So each store actor also runs a :class:`PageServer`: a listening socket on its node's
address with one thread per connection. A client keeps one connection per peer node
(:class:`PeerLinks`) and asks for a run of pages by key; the server answers with the
length of the cached, verified prefix it holds and those pages, which the client receives
straight into its landing buffer. Stores go the same way: the client sends a run of
pages with their keys and chain parent, the server keeps them and answers how many it
stored, how many leading pages of the run it holds (``landed``: a store out of room keeps
a prefix, and the client commits only that), which pages it dropped meanwhile and its
state after the write (free slots per tier and bytes per link,
:class:`~kvray.cluster.observe.NodeReport`). Nothing is pickled and no actor method runs.

Both ends prove they hold the runtime's secret token (32 random bytes made when the
runtime starts and handed by the controller to its stores and clients only) before a key
crosses: each sends a fresh nonce and answers the other's with an HMAC-SHA256 under the
token, so the token itself never goes on the wire, a server at a stale address that lacks
it learns neither the token nor a key, and a client without it is disconnected before it
can name one. Every page travels with its xxh3-64 and is verified on arrival: a page that
fails ends a load's hit there (a shorter hit, never wrong KV) and a store's run there. The
checksums follow their pages, so each side hashes a batch of pages while the next one crosses.
Every count read off the wire is bounded before anything is sized by it. None of this is
encryption; page bytes cross the network in the clear, as with Ray's own transfers
(docs/security.md).

A server stays up for token holders whatever strangers do: a handshake has a deadline
(``handshake_s``), at most ``max_handshakes`` run at once (a new connection takes the
place of the oldest) and at most ``max_connections`` are open; a failed ``accept`` (out of
file descriptors, say) or a connection thread that cannot start is logged and retried
after a pause. Page buffers are taken per request from a pool that keeps one largest
request's worth between requests, so an idle connection holds none.

An authenticated connection idles between requests for as long as its client lives, so
both ends turn on TCP keepalive (:class:`Keepalive`): a peer whose host died or was cut
off (no FIN, no RST ever comes) is probed once the link has been silent ``idle_s`` and
the connection closed after ``probes`` unanswered probes, freeing the server's thread
and descriptor. Within a request every wait is bounded by ``request_s``: a client that
stops sending mid-request, or stops reading its answer, is hung up on.

The wire format (the handshake, each request and its answer) is in :mod:`kvray.cluster.wire`.

A request's first LOAD or STORE to a peer goes after a TELL of the whole request (its keys,
arrival and its client's end-of-session hint), in the same send: the simulator tells a
node's placement policy of each request whose pages it serves or stores (``_tell`` in
:mod:`kvray.sim.cluster`), and so does the runtime through this. The server hands it to ``read`` or ``write`` with the
request that follows; a read's store answers first and hears of it after
(:mod:`kvray.cluster.after_answer`), so a load never waits on the policy. A TELL that is
not what a client sends (no keys, an infinite time, a hint outside its pages, a second TELL
in a row) is logged and hung up on, as any framing error: nothing stored is touched.

Example::

    server = PageServer(read=store_read, write=store_write, page_nbytes=4096,
                        token=token, host="127.0.0.1", max_pages=256)
    links = PeerLinks(token, page_nbytes=4096, timeout_s=10)
    got = links.load(server.address, keys).receive(buffer_rows)   # rows [0, got) hold the pages
    answer = links.store(server.address, keys, rows, parent=None).receive()   # a Stored, or None: not kept
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import logging
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from threading import Lock, Thread

import numpy as np

from kvray.cluster.keepalive import Keepalive
from kvray.cluster.observe import NodeReport
from kvray.cluster.protocol import Stored
from kvray.cluster.row_pool import RowPool
from kvray.cluster.wire import (
    ARRIVAL,
    CHECKSUM,
    CLIENT_PROOF,
    COUNT,
    LOAD,
    MAX_DROPPED,
    NONCE_BYTES,
    PARENT,
    PROOF_BYTES,
    REPORT,
    REQUEST,
    SERVER_PROOF,
    STORE,
    TELL,
    TOKEN_BYTES,
    Told,
    WireError,
    pack_tell,
    proof,
    recv_bytes,
    recv_pages,
    send_pages,
    unpack_tell,
    verified,
)
from kvray.core.errors import ClusterError
from kvray.core.keys import KEY_BYTES, pack_keys, unpack_keys
from kvray.core.placement import RunPlace

log = logging.getLogger(__name__)

ACCEPT_PAUSE_S = (0.01, 1.0)  # first and longest pause after a failed accept
WARN_EVERY_S = 10.0
OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)

PageReader = Callable[[Sequence[int], np.ndarray, "Told | None"], int]  # (keys, out rows, told) -> pages written
PageWriter = Callable[[Sequence[int], np.ndarray, "int | None", "RunPlace | None", "Told | None"], Stored]


class PageServer:
    """Serves one store's pages to token holders; see the module docstring.

    ``read(keys, out, told)`` writes the cached, verified prefix of ``keys`` into rows of
    ``out`` and returns how many; the server never sends a page it did not get from it.
    ``write(keys, pages, parent, place, told)`` keeps a run of pages and returns its
    :class:`~kvray.cluster.protocol.Stored` answer; it only ever sees pages that passed
    their checksum. ``told``: the TELL before the request, else None. ``answered`` runs
    after each answer has been sent (what the store left for then). ``keepalive`` probes
    idle connections; ``request_s`` bounds each wait of the server within a request (see
    the module docstring).
    """

    def __init__(
        self,
        read: PageReader,
        write: PageWriter,
        page_nbytes: int,
        token: bytes,
        host: str,
        max_pages: int,
        *,
        handshake_s: float = 5.0,
        max_handshakes: int = 16,
        max_connections: int = 256,
        keepalive: Keepalive = Keepalive(),
        request_s: float = 60.0,
        answered: Callable[[], None] | None = None,
    ) -> None:
        self._read = read
        self._answered = answered
        self._write = write
        self._page_nbytes = page_nbytes
        self._token = token
        self._max_pages = max_pages
        self._handshake_s = handshake_s
        self._max_handshakes = max_handshakes
        self._max_connections = max_connections
        self._keepalive = keepalive
        self._request_s = request_s
        self._rows = RowPool(page_nbytes, keep_rows=max_pages)
        self._listener = socket.create_server((host, 0))
        self.address: tuple[str, int] = (host, self._listener.getsockname()[1])
        self.sent_bytes = 0
        self.received_bytes = 0
        self.rejected = 0  # connections closed before they proved the token (wrong, too slow, crowded out)
        self.corrupt = 0  # stored runs cut short by a page that failed its checksum
        self._pending: dict[socket.socket, None] = {}  # connections in their handshake, oldest first
        self._conns: set[socket.socket] = set()
        self._unreported: list[int] = []  # dropped keys beyond what the last answer could carry
        self._lock = Lock()
        self._closed = False
        self._warned = -WARN_EVERY_S  # when the accept loop last logged a warning
        Thread(target=self._accept, name="kvray-page-server", daemon=True).start()

    @property
    def kept_rows(self) -> int:
        """Page rows of buffer the server holds between requests."""
        return self._rows.kept_rows

    @property
    def connections(self) -> int:
        """Connections open now, in their handshake or authenticated."""
        with self._lock:
            return len(self._conns)

    # -- connections -------------------------------------------------------------------
    def _accept(self) -> None:
        """Accept until closed. A failed accept or a thread that cannot start costs a logged
        pause (doubling while the failures go on), never the server; out of descriptors, the
        oldest handshake is closed to free one for whoever waits in the backlog."""
        pause = ACCEPT_PAUSE_S[0]
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError as error:
                if self._closed:
                    return
                if error.errno in OUT_OF_RESOURCES:
                    self._evict_oldest_handshake()
                pause = self._pause(f"accept failed: {error}", pause)
                continue
            if not self._admit(conn):
                continue
            try:
                Thread(target=self._serve, args=(conn,), name="kvray-page-conn", daemon=True).start()
            except RuntimeError as error:  # no thread for it (a thread limit): turn this one away
                self._forget(conn)
                pause = self._pause(f"no thread for a connection: {error}", pause)
                continue
            pause = ACCEPT_PAUSE_S[0]

    def _pause(self, what: str, pause: float) -> float:
        """Log (a warning at most every ``WARN_EVERY_S``: a flood of connections can fail
        thousands of accepts) and wait; returns the next pause."""
        now = time.monotonic()
        quiet = now - self._warned < WARN_EVERY_S
        if not quiet:
            self._warned = now
        (log.debug if quiet else log.warning)("kvray page server %s: %s; retrying", self.address, what)
        time.sleep(pause)
        return min(2 * pause, ACCEPT_PAUSE_S[1])

    def _admit(self, conn: socket.socket) -> bool:
        """Track a new connection within the bounds. With every handshake place or every
        connection taken, the oldest handshake gives up its place (a peer that has not proved
        itself yet yields to one that may); with only authenticated peers, the newcomer is
        turned away."""
        with self._lock:
            if self._closed:
                conn.close()
                return False
            crowded = len(self._pending) >= self._max_handshakes or len(self._conns) >= self._max_connections
            if crowded and not self._evict_oldest_handshake_locked():
                self.rejected += 1
                conn.close()
                return False
            self._pending[conn] = None
            self._conns.add(conn)
        return True

    def _evict_oldest_handshake(self) -> None:
        with self._lock:
            self._evict_oldest_handshake_locked()

    def _evict_oldest_handshake_locked(self) -> bool:
        """Shut the oldest connection still in its handshake (its thread then fails it, counts
        it and closes it); False if there is none. Under the lock, as closes are, so the
        descriptor shut is never one reused by a newer socket."""
        victim = next(iter(self._pending), None)
        if victim is None:
            return False
        del self._pending[victim]
        self._conns.discard(victim)
        with contextlib.suppress(OSError):  # the peer already went away
            victim.shutdown(socket.SHUT_RDWR)
        return True

    def _forget(self, conn: socket.socket) -> None:
        with self._lock:
            self._pending.pop(conn, None)
            self._conns.discard(conn)
            conn.close()

    def _handshake(self, conn: socket.socket) -> bool:
        """Mutual proof of the token within ``handshake_s``; True once the client proved it
        and still holds its place."""
        deadline = time.monotonic() + self._handshake_s
        try:
            client_nonce = recv_bytes(conn, NONCE_BYTES, deadline)
            if client_nonce is None:
                return False
            server_nonce = secrets.token_bytes(NONCE_BYTES)
            conn.sendall(server_nonce + proof(self._token, SERVER_PROOF, client_nonce, server_nonce))
            peer_proof = recv_bytes(conn, PROOF_BYTES, deadline)
        except OSError:
            return False  # too slow, or gone
        if peer_proof is None or not hmac.compare_digest(
            peer_proof, proof(self._token, CLIENT_PROOF, client_nonce, server_nonce)
        ):
            return False
        with self._lock:
            if conn not in self._pending:
                return False  # crowded out meanwhile
            del self._pending[conn]
        return True

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._keepalive.apply(conn)
            if not self._handshake(conn):
                with self._lock:
                    self.rejected += 1
                return
            # Between requests an authenticated link idles for as long as its client lives
            # (keepalive finds a dead one); within a request each wait is bounded.
            conn.settimeout(None)
            told: Told | None = None
            while (head := recv_bytes(conn, REQUEST.size)) is not None:
                conn.settimeout(self._request_s)
                op, n = REQUEST.unpack(head)
                if n > self._max_pages or op not in (LOAD, STORE, TELL):
                    return  # not a kvray client of this runtime: hang up
                if op == TELL:
                    told = self._told(conn, n, told)
                    if told is None:
                        return
                    continue
                rows = self._rows.take(n)
                try:
                    answered = (self._load if op == LOAD else self._store)(conn, rows[:n], told)
                finally:
                    self._rows.give(rows)
                if not answered:
                    return
                told = None
                if self._answered is not None:
                    self._answered()
                conn.settimeout(None)
        except OSError:
            return  # the client went away (mid-request, or its host died: keepalive), or stalled past request_s
        finally:
            self._forget(conn)

    # -- requests ----------------------------------------------------------------------
    def _told(self, conn: socket.socket, n: int, pending: Told | None) -> Told | None:
        """A TELL's request (packed keys, arrival ms or None, session-end hint), for the LOAD or
        STORE after it; None (the caller hangs up) when the peer closed or sent what no client sends."""
        raw = recv_bytes(conn, ARRIVAL.size + n * KEY_BYTES)
        if raw is None:
            return None
        told = "a second TELL in a row" if pending else unpack_tell(raw, n)
        if isinstance(told, str):
            log.warning("kvray page server %s: %s is not what a kvray client sends; hanging up", self.address, told)
            return None
        return told

    def _load(self, conn: socket.socket, rows: np.ndarray, told: Told | None) -> bool:
        raw = recv_bytes(conn, len(rows) * KEY_BYTES)
        if raw is None:
            return False
        got = self._read(unpack_keys(raw), rows, told) if len(rows) else 0
        conn.sendall(COUNT.pack(got))
        conn.sendall(send_pages(conn, rows[:got]))
        with self._lock:
            self.sent_bytes += got * self._page_nbytes
        return True

    def _store(self, conn: socket.socket, rows: np.ndarray, told: Told | None) -> bool:
        n = len(rows)
        head = recv_bytes(conn, PARENT.size + n * KEY_BYTES)
        arrived = recv_pages(conn, rows) if head is not None else None
        claimed = recv_bytes(conn, n * CHECKSUM.itemsize) if arrived is not None else None
        if claimed is None:
            return False
        has_parent, parent, first_depth, request_pages = PARENT.unpack_from(head)
        if has_parent > 1:
            return False  # not a kvray client: hang up
        keys = unpack_keys(head[PARENT.size :])
        good = verified(arrived, claimed)
        with self._lock:
            self.received_bytes += rows.nbytes
            self.corrupt += int(good < n)
        # Even with no good page: the answer carries the store's report.
        place = RunPlace(first_depth, request_pages) if request_pages else None
        answer = self._write(keys[:good], rows[:good], int.from_bytes(parent, "little") if has_parent else None, place, told)
        dropped = self._reportable(answer.dropped)
        counts = COUNT.pack(answer.stored) + COUNT.pack(answer.landed) + COUNT.pack(len(dropped))
        conn.sendall(counts + pack_keys(dropped) + REPORT.pack(*answer.report.flat()))
        return True

    def _reportable(self, dropped: list[int]) -> list[int]:
        """The dropped keys this answer carries: at most ``MAX_DROPPED``, oldest first, the
        rest kept for the next answer."""
        with self._lock:
            self._unreported.extend(dropped)
            report, self._unreported = self._unreported[:MAX_DROPPED], self._unreported[MAX_DROPPED:]
        return report

    def close(self) -> None:
        with self._lock:
            self._closed = True
        with contextlib.suppress(OSError):  # never connected: nothing to shut down
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            for conn in self._conns:
                with contextlib.suppress(OSError):  # already closed by the peer
                    conn.shutdown(socket.SHUT_RDWR)  # its thread wakes up and closes it
            self._conns.clear()
            self._pending.clear()


@dataclass
class _Link:
    address: tuple[str, int]
    sock: socket.socket
    broken: bool = False
    unsettled: bool = False  # a load sent since the last ``settle``: its server may still run work after the answer


@dataclass
class _Pending:
    """A request sent on a peer link, waiting for its answer (``link`` None: never sent)."""

    links: PeerLinks
    link: _Link | None
    pages: int

    def abandon(self) -> None:
        """Its answer will not be read (an error cut the request short): the link is dropped,
        or the next request's read would take this answer for its own. A load's answer names
        no keys, and its pages pass their checksums wherever they are read."""
        if self.link is not None:
            self.link.broken = True

    def _answer(self, read: Callable[[socket.socket], object]) -> object | None:
        if self.link is None or self.link.broken:
            return None  # never sent, or the link lost its framing before this answer: a miss
        try:
            return read(self.link.sock)
        except OSError as error:
            if isinstance(error, WireError):
                log.warning("kvray page link to %s: %s; dropping the connection", self.link.address, error)
            self.link.broken = True  # answers after this one can no longer be framed
            return None
        except BaseException:
            self.link.broken = True  # an answer half read (an interrupt) leaves the rest unframed too
            raise


def _count(sock: socket.socket) -> int:
    head = recv_bytes(sock, COUNT.size)
    if head is None:
        raise OSError("peer closed the connection")
    return COUNT.unpack(head)[0]


class PendingLoad(_Pending):
    def receive(self, out: np.ndarray) -> int:
        """Receive the pages into rows of ``out``: how many lead with verified pages (0 if
        the peer failed: a miss). Rows past that may hold unverified bytes."""

        def read(sock: socket.socket) -> int:
            got = _count(sock)
            if got > self.pages:
                raise WireError(f"peer answered {got} pages for a request of {self.pages}")
            arrived = recv_pages(sock, out[:got])
            claimed = recv_bytes(sock, got * CHECKSUM.itemsize) if arrived is not None else None
            if claimed is None:
                raise OSError("peer closed the connection mid-answer")
            good = verified(arrived, claimed)
            if good < got:
                self.links.corrupt += 1
                log.warning(
                    "kvray page link to %s: page %d of %d failed its checksum; the hit ends there", self.link.address, good, got
                )
            return good

        return self._answer(read) or 0


class PendingStore(_Pending):
    def receive(self) -> Stored | None:
        """The peer's answer (what it stored and holds of the run, the keys it dropped
        meanwhile, its report), or None if the peer failed."""

        def read(sock: socket.socket) -> Stored:
            stored, landed = _count(sock), _count(sock)
            if stored > self.pages or landed > self.pages:
                raise WireError(f"peer stored {stored} and holds {landed} pages of a run of {self.pages}")
            dropped = _count(sock)
            if dropped > MAX_DROPPED:
                raise WireError(f"peer reported {dropped} dropped keys, more than an answer carries ({MAX_DROPPED})")
            raw = recv_bytes(sock, dropped * KEY_BYTES + REPORT.size)
            if raw is None:
                raise OSError("peer closed the connection")
            return Stored(
                stored,
                landed,
                unpack_keys(raw[: dropped * KEY_BYTES]),
                NodeReport.from_flat(REPORT.unpack(raw[dropped * KEY_BYTES :])),
            )

        return self._answer(read)


class PeerLinks:
    """One persistent, mutually authenticated connection per peer page server.

    Every wait on a link is bounded by ``timeout_s``; ``keepalive`` probes a link while it
    idles, so one to a server whose host died is closed (and reopened by the next request)
    before that request waits on it. ``corrupt`` counts answers cut short by a page that
    failed its checksum.
    """

    def __init__(self, token: bytes, page_nbytes: int, timeout_s: float, keepalive: Keepalive = Keepalive()) -> None:
        if len(token) != TOKEN_BYTES:
            raise ClusterError(f"transfer token must be {TOKEN_BYTES} bytes, got {len(token)}")
        self._token = token
        self._page_nbytes = page_nbytes
        self._timeout_s = timeout_s
        self._keepalive = keepalive
        self._links: dict[tuple[str, int], _Link] = {}
        self.corrupt = 0

    def _link(self, address: tuple[str, int]) -> _Link:
        link = self._links.get(address)
        if link is not None and not link.broken:
            return link
        if link is not None:
            link.sock.close()
        sock = socket.create_connection(address, timeout=self._timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._keepalive.apply(sock)
            self._handshake(sock)
        except OSError:
            sock.close()
            raise
        link = self._links[address] = _Link(address, sock)
        return link

    def _handshake(self, sock: socket.socket) -> None:
        """Have the server prove the token before anything else is sent, then prove it back."""
        client_nonce = secrets.token_bytes(NONCE_BYTES)
        sock.sendall(client_nonce)
        reply = recv_bytes(sock, NONCE_BYTES + PROOF_BYTES)
        if reply is None:
            raise OSError("peer closed the connection in the handshake")
        server_nonce, peer_proof = reply[:NONCE_BYTES], reply[NONCE_BYTES:]
        if not hmac.compare_digest(peer_proof, proof(self._token, SERVER_PROOF, client_nonce, server_nonce)):
            raise WireError("the peer does not hold this runtime's transfer token (a stale address?)")
        sock.sendall(proof(self._token, CLIENT_PROOF, client_nonce, server_nonce))

    def _send(self, address: tuple[str, int], write: Callable[[socket.socket], None]) -> _Link | None:
        """Send one request with ``write`` on the link to ``address``; None if that failed."""
        try:
            link = self._link(address)
            write(link.sock)
        except OSError as error:
            if isinstance(error, WireError):
                log.warning("kvray page link to %s: %s", address, error)
            self._drop(address)
            return None
        except BaseException:
            self._drop(address)  # a request half written (an interrupt): the server cannot frame what follows
            raise
        return link

    def load(self, address: tuple[str, int], keys: Sequence[int], told: Told | None = None) -> PendingLoad:
        """Ask for the cached prefix of ``keys`` (after a TELL of ``told``: the request's
        first call to this peer); :meth:`PendingLoad.receive` reads the answer."""
        request = pack_tell(told) + REQUEST.pack(LOAD, len(keys)) + pack_keys(keys)
        link = self._send(address, lambda sock: sock.sendall(request))
        if link is not None:
            link.unsettled = True
        return PendingLoad(self, link, len(keys))

    def settle(self) -> None:
        """Wait until every peer that served a load since the last call, its answers all
        received, has run what its store left for after them (:mod:`kvray.cluster.after_answer`):
        an empty LOAD to each, which a server answers only once the requests before it are done."""
        for link in [link for link in self._links.values() if link.unsettled and not link.broken]:
            link.unsettled = False
            sent = self._send(link.address, lambda sock: sock.sendall(REQUEST.pack(LOAD, 0)))
            PendingLoad(self, sent, 0).receive(np.empty((0, self._page_nbytes), dtype=np.uint8))

    def store(
        self,
        address: tuple[str, int],
        keys: Sequence[int],
        pages: np.ndarray,
        parent: int | None,
        place: RunPlace | None = None,
        told: Told | None = None,
    ) -> PendingStore:
        """Send a run of pages (rows of ``pages``, one per key) continuing ``parent``'s chain,
        at ``place`` in its request (after a TELL of ``told``, as :meth:`load`)."""
        pages = np.ascontiguousarray(pages)
        first_depth, request_pages = place or (0, 0)
        parent_key = (parent or 0).to_bytes(KEY_BYTES, "little")
        head = pack_tell(told) + REQUEST.pack(STORE, len(keys))
        head += PARENT.pack(parent is not None, parent_key, first_depth, request_pages)

        def write(sock: socket.socket) -> None:
            sock.sendall(head + pack_keys(keys))
            sock.sendall(send_pages(sock, pages))

        return PendingStore(self, self._send(address, write), len(keys))

    def _drop(self, address: tuple[str, int]) -> None:
        link = self._links.pop(address, None)
        if link is not None:
            link.sock.close()

    def close(self) -> None:
        for address in list(self._links):
            self._drop(address)
