"""What the per-page policy learns while it serves: delayed labels and a heuristic tripwire.

No runtime knows the future, but it learns it late: a candidate of an eviction decision is
labelled once it is read again (the requests since the decision), or once it is stored again
after it left (its ghost), or, when neither happens within :data:`HORIZON` requests, as not
reused. :class:`DelayedLabels` keeps the decisions waiting for their labels and hands back
the complete ones, which :meth:`~kvray.policy.reuse_model.ReuseModel.refit` fits the model
to: the same code in the simulator and in the runtime, since both tell the policy of the
same events.

:class:`ShadowTripwire` guards against a model that has gone wrong on a workload unlike its
training: shadow caches of the model alone and of a few heuristics (LRU and S3-FIFO, with the
promotion of disk reads the real cache makes when it follows one) serve the same requests at
the real tier sizes; while a heuristic's shadow costs a margin less than the model's
(modeled time to first token, decayed), the real cache evicts as that heuristic does, until
the model's shadow leads again by the margin (HALP's and LeCaR's idea: keep the rule that is
ahead on this very workload).

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

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Protocol

import numpy as np

from kvray.core.index import PrefixIndex
from kvray.core.placement import PlacementPolicy, RequestInfo
from kvray.core.tiers import Tier
from kvray.policy.experts import ShadowCache
from kvray.policy.reuse_admission import write_wait
from kvray.policy.reuse_model import log_next_use
from kvray.scenario import PrefillQueue

HORIZON = 1024  # requests after which a candidate not used again is labelled never reused
HALF_LIFE = 256.0  # requests: the tripwire's decayed costs
SAMPLE = 8  # the shadows see one page key in SAMPLE, chosen by hash, at 1/SAMPLE of the tier sizes
_MIX = 0x9E3779B97F4A7C15  # Fibonacci hashing: trace keys may be small sequential ids
_MASK = (1 << 64) - 1


def sampled(keys: Sequence[int], sample: int) -> tuple[int, ...]:
    """The keys a ``1/sample`` spatial sample keeps (SHARDS): a key is in or out by its hash
    alone, so every request that reads a kept page reads it in the sample too, and a kept
    page's kept ancestors are the same in every chain it appears in (a key names its whole
    prefix): the kept keys of a chain are a chain of the contracted tree."""
    if sample == 1:
        return tuple(keys)
    bound = (1 << 64) // sample
    return tuple(k for k in keys if (k * _MIX) & _MASK < bound)


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
    """Which heuristic to follow, if any: shadow caches (:class:`~kvray.policy.experts.ShadowCache`,
    the real tier sizes) of the learned policy itself and of a few heuristics serve the same
    requests; the real cache follows the one whose decayed cost is lowest, switching only
    when it costs a margin less than the one followed (hysteresis: no flapping between
    near-equals), and the model first.

    Both sides of the comparison are shadows, so whatever the shadows do not model (moves
    between tiers, pins) is left out of both, and the learned policy's own shadow keeps
    running while the real cache follows a heuristic: the comparison stays counterfactual.
    (Comparing the real cache with the shadows instead tripped on agent-long@5% in the
    first requests and followed S3-FIFO for 94% of the decisions, 1.12x the best heuristic
    where the model alone is 0.89x: once following, the real cache costs what the followed
    shadow costs, and nothing says the model would do better.)

    The shadows are spatially sampled (SHARDS, Waldspurger et al., FAST'15): each sees only
    the page keys whose hash falls in a ``1/sample`` share, at ``1/sample`` of the tier sizes,
    and its costs count ``sample`` for each sampled page; a page's reuse distance in pages
    shrinks with the sample as the tiers do, so each shadow's hits stay an estimate of its
    full-size self's, at a ``sample``-th of the work (docs/sim-eval: the replay's CPU time).
    The learned policy's shadow is told each sampled page's depth and request length
    ``sample`` times its sampled ones, as its features were trained on full chains.

    A request's cost is its modeled time to first token where the request says what time
    costs (``RequestInfo.page_prefill_ms``: one prefill queue per shadow), else its page
    cost (a missed page 1, a hit its tier's load time relative to recomputing it). Counting
    hit pages alone missed the cells where the model lost: on agent-long@25% it hit as many
    pages as LRU (missed tokens 1.000x) but 7x as many from disk, 1.68x LRU's mean TTFT.
    Each page a shadow writes to disk adds the wait a write causes at the drive's utilisation
    (:func:`write_wait` of ``RequestInfo.disk_write_util``; 0 where the drive never queues, as
    on a single node): the shadows book no links, and on a cluster node a heuristic that
    promotes disk reads writes much more (each promoted page pushes a host page down and is
    written again when it leaves), which their hits alone did not show (docs/sim-eval/README.md,
    "Without hints on the fast-disk cluster cells").
    Each heuristic also runs as an *advisor* over the real cache (told of every event,
    acting only when followed), so it can name the next victim the moment it is followed.
    """

    def __init__(
        self,
        learned: PlacementPolicy,
        experts: Mapping[str, Callable[[], PlacementPolicy]],
        capacities: Mapping[Tier, int],
        margin: float,
        sample: int = SAMPLE,
    ) -> None:
        self.names = tuple(experts)
        self.margin = margin
        self.sample = sample
        small = {tier: max(1, round(n / sample)) if n else 0 for tier, n in capacities.items()}
        self.shadows = [ShadowCache(learned, small)] + [ShadowCache(build(), small) for build in experts.values()]
        self.advisors = [build() for build in experts.values()]
        self._decay = 0.5 ** (1.0 / HALF_LIFE)
        self.cost = np.zeros(len(self.shadows))  # decayed: the learned shadow's, then each heuristic's
        self._writes = np.zeros(len(self.shadows))  # each shadow's disk writes so far
        self.following: int | None = None
        self.trips = 0
        self._queues: list[PrefillQueue] = []

    def bind(self, index: PrefixIndex, capacities: Mapping[Tier, int]) -> None:
        for advisor in self.advisors:
            advisor.bind(index, capacities)

    def request(self, info: RequestInfo) -> None:
        """A request arrives: every shadow serves its sampled pages (each told of the request,
        sampled pages or none, so that its clock counts every request); the costs decay and add."""
        tier_cost = info.tier_cost or {t: 0.0 for t in Tier}
        keys = sampled(info.keys, self.sample)
        if keys:
            mine = replace(info, keys=keys, future=None)
            pages = np.array([shadow.serve(keys, tier_cost, mine)[0] for shadow in self.shadows]) * self.sample
        else:
            for shadow in self.shadows:
                shadow.manager.policy.on_request(replace(info, keys=()))
            pages = np.zeros(len(self.shadows))
        writes = np.array([shadow.disk_writes() for shadow in self.shadows], dtype=np.float64)
        # into the engine's queue with the hits' load times: the engine is held while its
        # request's loads wait on the drive (ClusterSimulator.serve), so a write's wait on the
        # loads queued behind it delays the requests queued behind those (the wait after the
        # queue instead: 8 of the 36 cluster cells beyond the band, worst 1.136x, against 6 and
        # 1.198x; with the hints up to 1.045x against 0.995x; docs/sim-eval/README.md)
        pages = pages + (writes - self._writes) * self.sample * write_wait(tier_cost.get(Tier.DISK, 0.0), info.disk_write_util)
        self._writes = writes
        if info.page_prefill_ms > 0:
            if not self._queues:
                self._queues = [PrefillQueue(info.engines) for _ in pages]
            service = pages * info.page_prefill_ms
            pages = service + [q.serve(info.arrival_ms, s) for q, s in zip(self._queues, service.tolist())]
        self.cost = self.cost * self._decay + pages
        self._follow()

    def _follow(self) -> None:
        """Follow the cheapest shadow (0: the learned policy), switching only when it leads
        the one followed by the margin."""
        now = 0 if self.following is None else 1 + self.following
        best = int(np.argmin(self.cost))
        if best != now and self.cost[best] < self.cost[now] * (1.0 - self.margin):
            if best and self.following is None:
                self.trips += 1
            self.following = best - 1 if best else None

    def follow(self) -> PlacementPolicy | None:
        """The heuristic advisor the real cache follows now, or None (the learned policy)."""
        return None if self.following is None else self.advisors[self.following]


class RecencyOwner(Protocol):
    """What :class:`RecencyLRU` reads: its owner's least recently used unpinned page of a tier."""

    def oldest(self, tier: Tier) -> int | None: ...


class RecencyLRU(PlacementPolicy):
    """The tripwire's LRU advisor (``stands_for``: LRU with or without promotion, promoting as
    it does) over the real cache, read off the reuse policy's recency
    column (:meth:`~kvray.policy.reuse.ReusePolicy.oldest`) when followed: that column orders each tier's pages
    exactly as :class:`~kvray.core.placement.LRUPolicy`'s ``OrderedDict``s do (a stamp per
    insert, a read batch stamped deepest first), so an LRU advisor told of every event of
    the real cache repeated the policy's own bookkeeping (docs/sim-eval, "Replay speed")."""

    def __init__(self, owner: RecencyOwner, stands_for: PlacementPolicy) -> None:
        self._owner = owner
        self.name = stands_for.name
        self._promote = stands_for.promote_target  # lru-promote's promotion, when followed

    def promote_target(self, handle: int, tier: Tier) -> Tier | None:
        return self._promote(handle, tier)

    def on_insert(self, handle: int, tier: Tier) -> None:
        """Nothing to keep: the owner's column is the order."""

    def on_access(self, handles: np.ndarray) -> None:
        """Nothing to keep: the owner's column is the order."""

    def on_remove(self, handle: int, tier: Tier) -> None:
        """Nothing to keep: the owner's column is the order."""

    def victim(self, tier: Tier) -> int | None:
        return self._owner.oldest(tier)
