"""A node's NVMe write budget: at most so many bytes per second go into its disk tier.

Under contention a drive that takes every demotion and every new page stalls the loads that
read it, so the cluster policy may cap what a node writes to disk (its
``disk_write_budget`` verb; :mod:`kvray.policy.cluster`). The cap is a token bucket of
bytes on a clock of the caller's: wall time in a node's store, modeled time in the
simulator (:mod:`kvray.sim.cluster`), so both worlds enforce the same rule. A page write the
bucket cannot pay for is not made: a new page is not stored there (the chain stops, as when
the policy refuses a page), a page demoted from host memory is dropped instead of written.
Either way nothing is half written: the budget is checked before a slot is taken (and
paid once the page is written), so a refused page is a later miss, never a torn or wrong one.

Example::

    from kvray.core.write_budget import WriteBudget

    clock = iter([0.0, 0.0, 0.0, 0.0, 1.0]).__next__   # seconds: made at 0, three asks at 0, one at 1
    budget = WriteBudget(bytes_per_s=2048, page_nbytes=1024, clock=clock)
    for _ in range(2):                                   # the burst is one second's: two pages
        assert budget.allows()
        budget.pay()                                     # the page was written
    assert not budget.allows()
    assert budget.allows()                               # a second later, two more pages' worth
"""

from __future__ import annotations

import math
from collections.abc import Callable

from kvray.core.errors import ConfigError

BURST_S = 1.0  # the bucket holds this long's budget: a burst after an idle second is taken whole


def checked_rate(bytes_per_s: float | None) -> float | None:
    """A budget's rate, validated where it enters (a policy's answer, a setting): None (no
    budget) or a finite number of bytes per second above zero."""
    if bytes_per_s is None:
        return None
    if isinstance(bytes_per_s, bool) or not isinstance(bytes_per_s, (int, float)):
        raise ConfigError(f"disk write budget: expected bytes per second or None, got {bytes_per_s!r}")
    if not math.isfinite(bytes_per_s) or bytes_per_s <= 0:
        raise ConfigError(f"disk write budget must be a finite number of bytes per second above 0, got {bytes_per_s}")
    return float(bytes_per_s)


class WriteBudget:
    """Token bucket of bytes written to one disk tier (see the module docstring): it fills at
    ``bytes_per_s`` up to one burst (``BURST_S`` seconds' worth, at least one page), starting
    full; :meth:`allows` says whether it pays for one page of ``page_nbytes``, :meth:`pay` pays. ``clock``: seconds,
    never read as going backwards (a clock that does adds nothing)."""

    def __init__(self, bytes_per_s: float, page_nbytes: int, clock: Callable[[], float]) -> None:
        self.page_nbytes = page_nbytes
        self.clock = clock
        self.taken_bytes = 0
        self.refused_pages = 0
        self.bytes_per_s, self._burst = self._rate_and_burst(bytes_per_s)
        self._tokens = self._burst
        self._last = clock()

    def _rate_and_burst(self, bytes_per_s: float) -> tuple[float, float]:
        rate = checked_rate(bytes_per_s)
        if rate is None:
            raise ConfigError("WriteBudget needs a rate: a node without a budget has no WriteBudget")
        return rate, max(float(self.page_nbytes), rate * BURST_S)

    def set_rate(self, bytes_per_s: float) -> None:
        """A new rate from now on (the bucket keeps what it holds, up to the new burst)."""
        self._refill()
        self.bytes_per_s, self._burst = self._rate_and_burst(bytes_per_s)
        self._tokens = min(self._tokens, self._burst)

    def _refill(self) -> None:
        now = self.clock()
        if now > self._last:
            self._tokens = min(self._burst, self._tokens + (now - self._last) * self.bytes_per_s)
            self._last = now

    def allows(self) -> bool:
        """Whether the budget pays for one more page now; False (counted as refused) when it
        cannot. The caller writes the page, then :meth:`pay` s for it."""
        self._refill()
        if self._tokens < self.page_nbytes:
            self.refused_pages += 1
            return False
        return True

    def pay(self) -> None:
        """One page was written: its bytes leave the bucket."""
        self._tokens -= self.page_nbytes
        self.taken_bytes += self.page_nbytes


def budget_stats(budget: WriteBudget | None) -> dict | None:
    """A budget's state for a store's stats: its rate, bytes it let through, pages it refused."""
    if budget is None:
        return None
    return {"bytes_per_s": budget.bytes_per_s, "taken_bytes": budget.taken_bytes, "refused_pages": budget.refused_pages}
