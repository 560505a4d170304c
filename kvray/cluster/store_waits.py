"""Waits a node store bounds itself: the collective's send and receive (:func:`within`),
and the delays and failures a test injects into its copies (:class:`InjectedFaults`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")


def within(timeout_s: float, what: str, work: Callable[[], T]) -> T:
    """``work()``, waited for at most ``timeout_s``, then a TimeoutError naming ``what`` and
    the setting that bounds it.

    For the collective's send and receive, which take no timeout (gloo's own is 30
    minutes): ``work`` runs on a thread of its own, which a timeout leaves blocked until
    gloo gives up, so ``work`` must keep alive whatever memory it reads or writes.
    """
    future: Future[T] = Future()

    def run() -> None:
        try:
            future.set_result(work())
        except BaseException as exc:  # handed to the waiting caller
            future.set_exception(exc)

    threading.Thread(target=run, name="kvray-collective", daemon=True).start()
    try:
        return future.result(timeout=timeout_s)
    except TimeoutError:
        if future.done():
            raise  # ``work`` itself timed out
        raise TimeoutError(
            f"{what} did not finish within peer_timeout_s={timeout_s:g} s (RuntimeConfig.peer_timeout_s)"
        ) from None


class InjectedFaults:
    """What :meth:`NodeStore.inject_faults <kvray.cluster.node_store.NodeStore.inject_faults>` armed: a delay and maybe an error for the next calls."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._left = 0
        self._delay_s = 0.0
        self._fail = False

    def arm(self, delay_s: float, fail: bool, calls: int) -> None:
        with self._lock:
            self._left, self._delay_s, self._fail = calls, delay_s, fail

    def apply(self) -> None:
        with self._lock:
            if not self._left:
                return
            self._left -= 1
            delay_s, fail = self._delay_s, self._fail
        time.sleep(delay_s)
        if fail:
            raise OSError("injected store fault (test hook)")
