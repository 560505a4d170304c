"""What the per-page policy learns while it serves: delayed labels and a heuristic tripwire.

No runtime knows the future, but it learns it late: a candidate of an eviction decision is
labelled once it is read again (the requests since the decision), or once it is stored again
after it left (its ghost), or, when neither happens within :data:`HORIZON` requests, as not
reused. :class:`DelayedLabels` keeps the decisions waiting for their labels and hands back
the complete ones, which :meth:`~kvray.policy.reuse_model.ReuseModel.refit` fits the model
to: the same code in the simulator and in the runtime, since both tell the policy of the
same events.

:class:`ShadowTripwire` guards against a model that has gone wrong on a workload unlike its
training: a metadata-only LRU over the cache's whole capacity counts the prefix hits LRU
would have had; while the learned cache's decayed hits fall behind the shadow's by more
than a margin, the policy follows the heuristic (LRU order among its candidates), and it
trusts the model again once it is back within half the margin.

Example::

    import numpy as np
    from kvray.policy.page_features import FEATURES
    from kvray.policy.reuse_online import DelayedLabels

    labels = DelayedLabels(horizon=512)
    labels.decided(np.zeros((2, len(FEATURES)), dtype=np.float32), [101, 102], now=10)
    labels.used([101], now=14)
    rows, log_next_uses = labels.expire(now=600)      # 101: log1p(4); 102: never
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

import numpy as np

from kvray.policy.reuse_model import log_next_use

HORIZON = 1024  # requests after which a candidate not used again is labelled never reused
HALF_LIFE = 256.0  # requests: the tripwire's decayed hit counts


class DelayedLabels:
    """Decisions waiting for their candidates' next use."""

    def __init__(self, horizon: int = HORIZON) -> None:
        self.horizon = horizon
        self._open: deque[tuple[float, np.ndarray, np.ndarray]] = deque()  # (when, rows, distances)
        self._waiting: dict[int, list[tuple[np.ndarray, int, float]]] = {}  # key -> (distances, position, when)

    def __len__(self) -> int:
        return len(self._open)

    def decided(self, rows: np.ndarray, keys: Sequence[int], now: float) -> None:
        """A decision was taken at request ``now`` among the candidates ``keys`` (rows: their features)."""
        distances = np.full(len(keys), np.inf)
        self._open.append((now, rows, distances))
        for position, key in enumerate(keys):
            self._waiting.setdefault(key, []).append((distances, position, now))

    def used(self, keys: Sequence[int], now: float) -> None:
        """Pages read (or stored again) at request ``now``: their open decisions learn their next use."""
        waiting = self._waiting
        for key in keys:
            for distances, position, when in waiting.pop(key, ()):
                distances[position] = now - when

    def expire(self, now: float) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Decisions at least a horizon old, labelled (a candidate not used since: never);
        their rows and labels, oldest first."""
        rows, labels = [], []
        while self._open and now - self._open[0][0] >= self.horizon:
            _, r, distances = self._open.popleft()
            rows.append(r)
            labels.append(log_next_use(distances))
        if rows and len(self._waiting) > 4 * self.horizon:  # forget keys whose decisions all expired
            oldest = self._open[0][0] if self._open else now
            self._waiting = {k: [w for w in ws if w[2] >= oldest] for k, ws in self._waiting.items()}
            self._waiting = {k: ws for k, ws in self._waiting.items() if ws}
        return rows, labels


class ShadowTripwire:
    """Whether to follow the heuristic: the learned cache's decayed prefix hits against an
    LRU shadow's over the same number of pages."""

    def __init__(self, capacity: int, margin: float) -> None:
        self.capacity = max(capacity, 1)
        self.margin = margin
        self._shadow: OrderedDict[int, None] = OrderedDict()
        self._decay = 0.5 ** (1.0 / HALF_LIFE)
        self.real = 0.0
        self.shadow = 0.0
        self.tripped = False
        self.trips = 0

    def request(self, keys: Sequence[int]) -> None:
        """A request arrives: the shadow serves it (its hits are its cached prefix), counts decay."""
        shadow = self._shadow
        hits = 0
        for key in keys:
            if key not in shadow:
                break
            hits += 1
        self.real *= self._decay
        self.shadow = self.shadow * self._decay + hits
        for key in reversed(keys):  # the root most recent, as the real LRU touches it
            shadow[key] = None
            shadow.move_to_end(key)
        while len(shadow) > self.capacity:
            shadow.popitem(last=False)

    def hit(self, pages: int) -> None:
        """The learned cache served ``pages`` of the current request from its tiers; re-check."""
        self.real += pages

    def follow_heuristic(self) -> bool:
        """Trip when the real hits fall a margin behind the shadow's; recover within half of it."""
        if self.tripped:
            self.tripped = self.real < self.shadow * (1.0 - self.margin / 2)
        elif self.real < self.shadow * (1.0 - self.margin):
            self.tripped = True
            self.trips += 1
        return self.tripped
