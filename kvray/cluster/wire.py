"""The page transfer's framing: its sizes, structs and op codes, the handshake's proof, and
reading and writing runs of pages with their checksums.

Both ends of a direct TCP transfer (:mod:`kvray.cluster.transfer`: a store's ``PageServer``
and a client's ``PeerLinks``) frame the same bytes, so the framing lives here once, apart
from what each end does with a request.

Wire format, little-endian, requests pipelined on a connection, answers in order::

    handshake  client -> server   c (32-byte nonce)
               server -> client   s (32-byte nonce), HMAC(token, "kvray page server v2" c s)
               client -> server   HMAC(token, "kvray page client v2" c s)
    requests   client -> server   u8 op, u32 n (<= max_pages), and
                                    TELL:  f64 arrival ms (NaN: the server's clock), i32 end-of-session
                                           hint (-1: none, else 0 <= h < n), n (>= 1) x 16-byte
                                           keys of the request; no answer, and the next request on
                                           the link must be its LOAD or STORE
                                    LOAD:  n x 16-byte keys
                                    STORE: u8 has_parent, 16-byte parent key, u32 first depth,
                                           u32 request pages (0: the run alone), n x 16-byte keys,
                                           n x page_nbytes bytes, n x u64 xxh3-64 of them
    answers    server -> client   LOAD:  u32 got (<= n), got x page_nbytes bytes, got x u64 xxh3-64
                                  STORE: u32 stored (<= n), u32 landed (<= n), u32 d (<= MAX_DROPPED),
                                         d x 16-byte keys dropped,
                                         11 x u64 NodeReport (free, capacity per tier; bytes per link)
"""

from __future__ import annotations

import hmac
import math
import socket
import struct
import time
from collections.abc import Iterator

import numpy as np
import xxhash

from kvray.core.errors import ClusterError
from kvray.core.keys import KEY_BYTES

TOKEN_BYTES = 32
NONCE_BYTES = 32
PROOF_BYTES = 32  # HMAC-SHA256
# The proofs name the format's version: a peer framing another version fails the handshake
# instead of misreading a request (v2: a TELL carries the end-of-session hint).
SERVER_PROOF, CLIENT_PROOF = b"kvray page server v2", b"kvray page client v2"
REQUEST = struct.Struct("<BI")  # op, pages
COUNT = struct.Struct("<I")
REPORT = struct.Struct("<11Q")  # NodeReport.flat()
PARENT = struct.Struct("<B16sII")  # has parent, parent key, the run's place in its request (RunPlace; 0 pages: none)
CHECKSUM = np.dtype("<u8")
LOAD, STORE, TELL = 1, 2, 3
ARRIVAL = struct.Struct("<di")  # a TELL's arrival ms (NaN for none), its end-of-session hint (-1 for none)
BATCH_BYTES = 1 << 20  # pages cross in batches of about this much, each hashed while the next one moves
MAX_DROPPED = 1 << 16  # dropped keys one STORE answer carries (1 MiB); the rest go with the next


# A request as a peer's policy is told of it (TELL): packed keys, arrival ms (None: the server's
# clock), its client's end-of-session hint (RequestInfo.ends_session_from; -1: none)
Told = tuple[bytes, "float | None", int]


def pack_tell(told: Told | None) -> bytes:
    """The TELL that goes before a request (nothing for None); a ClusterError for a request no
    server would take (no keys, an infinite arrival, a hint outside its pages), before anything is sent."""
    if told is None:
        return b""
    keys, arrival_ms, ends_from = told
    n = len(keys) // KEY_BYTES
    if not keys or len(keys) % KEY_BYTES or (arrival_ms is not None and not math.isfinite(arrival_ms)):
        raise ClusterError(f"cannot tell a peer of a request of {len(keys)} key bytes arriving at {arrival_ms} ms")
    if not -1 <= ends_from < n:
        raise ClusterError(f"cannot tell a peer of a request of {n} pages ending its session at page {ends_from}")
    return REQUEST.pack(TELL, n) + ARRIVAL.pack(math.nan if arrival_ms is None else arrival_ms, ends_from) + keys


def unpack_tell(raw: bytes, n: int) -> Told | str:
    """A TELL's body (``ARRIVAL`` and ``n`` keys) as the request it tells of, or what is wrong
    with it (what no kvray client sends)."""
    arrival_ms, ends_from = ARRIVAL.unpack_from(raw)
    if not n:
        return "a TELL of no keys"
    if math.isinf(arrival_ms):
        return f"a TELL at {arrival_ms} ms"
    if not -1 <= ends_from < n:
        return f"a TELL ending its session at page {ends_from} of {n}"
    return raw[ARRIVAL.size :], None if math.isnan(arrival_ms) else arrival_ms, ends_from


class WireError(OSError):
    """A peer sent what no page server or client of this runtime sends: the connection is
    dropped like a broken one, and the reason logged."""


def proof(token: bytes, role: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """Proof of the token for one connection: both fresh nonces make it useless on any
    other, the role makes a server's proof useless as a client's (no reflection)."""
    return hmac.digest(token, role + client_nonce + server_nonce, "sha256")


def recv_exact(sock: socket.socket, view: memoryview, deadline: float | None = None) -> bool:
    """Fill ``view`` from ``sock``; False if the peer closed first. With a ``deadline``
    (``time.monotonic``), the whole read must finish by then: a peer trickling a byte at a
    time gets no more time than a silent one."""
    got = 0
    while got < len(view):
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("deadline passed")
            sock.settimeout(left)
        n = sock.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


def recv_bytes(sock: socket.socket, n: int, deadline: float | None = None) -> bytes | None:
    buf = bytearray(n)
    return bytes(buf) if recv_exact(sock, memoryview(buf), deadline) else None


def batches(rows: np.ndarray) -> Iterator[np.ndarray]:
    step = max(1, BATCH_BYTES // max(rows.shape[1], 1))
    for start in range(0, len(rows), step):
        yield rows[start : start + step]


def send_pages(sock: socket.socket, rows: np.ndarray) -> bytes:
    """Send ``rows`` batch by batch and return the checksums of what was sent. Each batch is
    hashed once the kernel has it, while it is on the wire, so hashing adds little time."""
    checksums: list[int] = []
    for batch in batches(rows):
        sock.sendall(memoryview(batch).cast("B"))
        checksums.extend(xxhash.xxh3_64_intdigest(row) for row in batch)
    return np.array(checksums, dtype=CHECKSUM).tobytes()


def recv_pages(sock: socket.socket, rows: np.ndarray) -> np.ndarray | None:
    """Receive into ``rows`` batch by batch and return the checksums of what arrived (None if
    the peer closed first). Each batch is hashed while the next one arrives."""
    checksums = np.empty(len(rows), dtype=CHECKSUM)
    done = 0
    for batch in batches(rows):
        if not recv_exact(sock, memoryview(batch).cast("B")):
            return None
        checksums[done : done + len(batch)] = [xxhash.xxh3_64_intdigest(row) for row in batch]
        done += len(batch)
    return checksums


def verified(arrived: np.ndarray, claimed: bytes) -> int:
    """How many leading pages arrived as their sender hashed them: a run is only as good as its prefix."""
    bad = np.flatnonzero(arrived != np.frombuffer(claimed, dtype=CHECKSUM))
    return int(bad[0]) if len(bad) else len(arrived)
