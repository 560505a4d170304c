"""TCP keepalive on the page servers' connections (:mod:`kvray.cluster.transfer`), a setting of the runtime."""

from __future__ import annotations

import socket

from pydantic import Field

from kvray.core.config import FrozenModel


class Keepalive(FrozenModel):
    """TCP keepalive on page-server connections (both ends): once a connection has been
    silent ``idle_s``, the kernel probes the peer every ``interval_s`` and closes the
    connection after ``probes`` probes go unanswered, so a connection to a host that died
    is gone within :attr:`bound_s` (60 s by default; the kernel's own default is over two
    hours). Whole seconds, as the kernel takes them.

    Probes only start on a connection with nothing unacknowledged: a host that died before
    acknowledging the last bytes of an answer (its ACK delayed, say) leaves the connection
    retransmitting for 15 minutes instead. So ``TCP_USER_TIMEOUT`` closes a connection
    whose sent bytes stay unacknowledged for :attr:`bound_s` as well.
    """

    idle_s: int = Field(default=30, ge=1, le=32767)
    interval_s: int = Field(default=10, ge=1, le=32767)
    probes: int = Field(default=3, ge=1, le=127)

    @property
    def bound_s(self) -> int:
        """How long after its last sign of life a dead peer's connection is closed at most."""
        return self.idle_s + self.interval_s * self.probes

    def apply(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, self.idle_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, self.interval_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, self.probes)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, self.bound_s * 1000)
