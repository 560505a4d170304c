"""Pages a request of this process is computing, so that another request of the same
process that would compute them too waits for them instead.

Under concurrency the requests of one conversation or agent overlap: a request whose next
page another request is computing right now missed it, computed it again and stored it
again (a lookup, a write and a commit per duplicate). At 64 concurrent clients of
``kvray bench --only concurrency`` the requests missed 2.2x the pages one client missed
(3,383 against 1,567 of 19,918), and each miss is a store. A request
(:meth:`~kvray.cluster.client.KvrayClient.request`) claims the pages it may compute;
another that finds its first page not held on this node claimed waits, at most its
client's ``timeout_s``, until the claim ends (the claimant stored them, or gave up), then
looks up: usually a local plan off the mapped host tier, no controller call. The claim is
taken before the lookup, in the same step as the check: claimed after it, two requests of
one session passed the check together for as long as a lookup took (hundreds of ms under
load: 13 of 928 requests waited). A claim always ends when its request does, whatever
happened in it; a request waits only when it claims nothing, so no two requests wait on
each other. Per process: requests of two processes still compute a page twice.

Example::

    claim = IN_FLIGHT.claim("kvray", keys[held:], timeout_s=60.0)  # None: waited for another's
    ...                                                            # look up, load, compute, store
    if claim is not None:
        claim.end()                                                # waiters go on
"""

from __future__ import annotations

import threading
from collections.abc import Sequence


class Claim:
    """The pages one request is computing; :meth:`end` lets whoever waits for them go on."""

    def __init__(self, pages: InFlightPages, names: list[tuple[str, int]]) -> None:
        self._pages, self._names, self.done = pages, names, threading.Event()

    def end(self) -> None:
        self._pages._forget(self)
        self.done.set()


class InFlightPages:
    """This process's claims, by (runtime name, page key); see the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._claims: dict[tuple[str, int], Claim] = {}

    def claim(self, runtime: str, keys: Sequence[int], timeout_s: float) -> Claim | None:
        """Claim ``keys`` (a request's pages from the first its node does not hold) for the
        calling request, those no one here claimed yet; or, when another request of this
        process claimed ``keys[0]``, wait until its claim ends (at most ``timeout_s``) and
        claim nothing (None). Check and claim are one step, so of two requests that would
        compute the same page one does."""
        with self._lock:
            other = self._claims.get((runtime, keys[0]))
            if other is None:
                names = [(runtime, key) for key in keys if (runtime, key) not in self._claims]
                claim = Claim(self, names)
                for name in names:
                    self._claims[name] = claim
                return claim
        other.done.wait(timeout_s)
        return None

    def _forget(self, claim: Claim) -> None:
        with self._lock:
            for name in claim._names:
                if self._claims.get(name) is claim:
                    del self._claims[name]


IN_FLIGHT = InFlightPages()
