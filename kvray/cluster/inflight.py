"""Pages a request of this process is computing, so that another request of the same
process that would compute them too waits for them instead.

Under concurrency the requests of one conversation or agent overlap: a request whose next
page another request is computing right now missed it, computed it again and stored it
again (a lookup, a write and a commit per duplicate). At 64 concurrent clients of
``kvray bench --only concurrency`` the requests missed 2.2x the pages one client missed
(3,383 against 1,567 of 19,918), and each miss is a store. A request
(:meth:`~kvray.cluster.client.KvrayClient.request`) claims the pages it may compute, and
once its lookup answers, only those it will (the others are cached on another node);
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
    plan = client.lookup(keys)
    claim = claim and claim.narrow(keys[plan.hit_pages:])          # the pages it computes
    ...                                                            # load, compute, store
    if claim is not None:
        claim.end()                                                # waiters go on
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence


class Claim:
    """The pages one request may compute; :meth:`narrow` once its lookup says which it
    will, :meth:`end` when it is done. Either lets whoever waits on it go on."""

    def __init__(self, pages: InFlightPages, runtime: str, names: list[tuple[str, int]]) -> None:
        self._pages, self.runtime, self._names = pages, runtime, names
        self.done = threading.Event()
        self.narrowed = False  # ended only to be replaced by a claim on fewer pages

    def narrow(self, keys: Sequence[int]) -> Claim | None:
        """The claim on ``keys`` alone (the pages the request's lookup did not find
        cached: it computes them), this one ended; None when ``keys`` is empty. A request
        waiting on a page that another node holds waits a lookup, not a whole request."""
        replacement = self._pages._replace(self, keys)
        self.narrowed = True
        self.done.set()
        return replacement

    def end(self) -> None:
        self._pages._replace(self, ())
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
        claim nothing (None). A claim narrowed meanwhile is asked again: ``keys[0]`` may
        be among the pages it computes. Check and claim are one step, so of two requests
        that would compute the same page one does."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                other = self._claims.get((runtime, keys[0]))
                if other is None:
                    return self._register(runtime, keys)
            if not other.done.wait(max(deadline - time.monotonic(), 0.0)) or not other.narrowed:
                return None

    def _register(self, runtime: str, keys: Sequence[int]) -> Claim | None:
        names = [(runtime, key) for key in keys if (runtime, key) not in self._claims]
        if not names:
            return None
        claim = Claim(self, runtime, names)
        for name in names:
            self._claims[name] = claim
        return claim

    def _replace(self, claim: Claim, keys: Sequence[int]) -> Claim | None:
        """End ``claim``'s names and claim ``keys`` instead, in one step."""
        with self._lock:
            for name in claim._names:
                if self._claims.get(name) is claim:
                    del self._claims[name]
            return self._register(claim.runtime, keys) if keys else None


IN_FLIGHT = InFlightPages()
