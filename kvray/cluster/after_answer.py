"""Policy work a store's page server leaves for after its answer, run in order before
anything later reaches the store.

A peer's TCP read (:mod:`kvray.cluster.transfer`) tells the source store's placement policy
of the request (``on_request``, on the request's first call to that store) and counts the
pages read as hits (recency, heat, and promotions, which may move pages between tiers):
what the simulator does to a node whose pages another node reads (``_tell`` in
:mod:`kvray.sim.cluster`). Neither changes the bytes sent, so the answer goes first and
the work follows on the connection's thread (:class:`AfterAnswer`): a remote load never
waits on the policy (an online refit of the learned policy runs in ``on_request``). Every
later call to the store runs whatever is still queued first (``NodeStore`` calls
:meth:`AfterAnswer.run` at its entry points), so nothing finds the store as if the read had
not happened, and the policy hears of each request before its hits, as in the simulator.

Example::

    after = AfterAnswer()
    after.add(lambda: store.on_request(info))      # queued by the read, in order
    after.add(lambda: store.touch_pages(keys, load_s, looked_up=True))
    after.run()                                    # after the answer, or first thing in the next call
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

logger = logging.getLogger(__name__)


class AfterAnswer:
    """Work queued in order, run once each by whichever thread calls :meth:`run` first."""

    def __init__(self) -> None:
        self._work: deque[Callable[[], None]] = deque()
        self._lock = threading.Lock()  # held while work runs: a caller of ``run`` waits for work another thread took

    def add(self, work: Callable[[], None]) -> None:
        self._work.append(work)

    def run(self) -> None:
        """Run everything queued, in order; returns once work other threads took is done too.

        A failing piece of work (a policy that raised) is logged and the rest runs: it
        belongs to a read already answered, not to whichever call runs it.
        """
        with self._lock:
            while self._work:
                work = self._work.popleft()
                try:
                    work()
                except Exception:
                    logger.exception("kvray store: a page server's policy work after its answer failed")
