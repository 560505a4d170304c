"""Answers many clients of one process share: one call in flight per question and period.

Every :class:`~kvray.cluster.client.KvrayClient` re-reads, on a timer, which host segment
its node's store serves and who the runtime's members are. A process with many clients
(a server's request threads; the concurrency benchmark runs 42 a process) asked once per
client: at 64 clients the stores answered about one ``host_tier`` call per request served,
and the clients spent as much CPU on those answers as on the requests' own calls. Here
the first client due asks, and the others take the same answer until it is ``period_s``
old.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import ray


class SharedAnswers:
    """One call in flight per process for a question every client asks on a timer (which
    host segment this node's store serves, who the members are): a process with many
    clients (a server's request threads, the concurrency benchmark's 42 a process) asks once
    per ``period_s``, not once per client, where every client asking for itself made the
    store answer about one ``host_tier`` call per request served.

    Example::

        answers = SharedAnswers(1.0)
        future = answers.ask("store-a", lambda: store.host_tier.remote())  # a second client gets the same future
    """

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self._lock = threading.Lock()
        self._asked: dict[object, tuple[Future, float]] = {}

    def ask(self, key: object, call: Callable[[], ray.ObjectRef], fresh: bool = False) -> Future:
        """The answer to ``call()`` (an object ref) for ``key``, asked anew if the last ask is
        older than ``period_s`` or ``fresh`` (a client that must see the state from now on)."""
        now = time.monotonic()
        with self._lock:
            held = self._asked.get(key)
            if fresh or held is None or now - held[1] >= self.period_s:
                held = self._asked[key] = (call().future(), now)
            return held[0]
