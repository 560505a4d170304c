"""Gymnasium environment: the placement decisions of a trace replay, one step each.

Each step is one real decision of the cache (docs/design.md, "Placement"): where a new page
goes (a tier or not kept) or which page leaves a full tier (its destination is then one
tier down, or nowhere from the slowest). The observation is the decision's feature rows
(:mod:`kvray.policy.features`, padded to ``CANDIDATES`` rows, flattened); the action is
the index of the chosen row. The replay runs through the real
:class:`~kvray.core.manager.CacheManager` of a :class:`~kvray.sim.simulator.Simulator`: the
environment only answers, for the manager, the questions a policy would.

Reward is hindsight regret in units of one page's prefill time: the modeled cost the
choice adds at the page's next use (loaded from the tier it will have aged into, or
recomputed), plus ``slot_cost`` for a slot held by a page that is not used while cached
(what it displaced: the cost of a slot in a tight cache), minus that of the best choice
among the same options, capped at ``max_regret`` so that a few costly choices (dropping
a long chain) do not drown out the many small ones. Only the reward uses
the future; observations never do. Episodes are windows of ``episode_requests`` requests
starting at random points of the trace, after a warm-up that fills the cache with LRU.

Example::
    import gymnasium
    import kvray.rl.env  # registers kvray/Placement-v0
    from kvray.sim.cost import load_scenario
    from kvray.traces import read_trace

    env = gymnasium.make("kvray/Placement-v0", trace=read_trace("synthetic_trace.jsonl", limit=200),
                         scenario=load_scenario("h100-llama8b"))
    obs, info = env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step(env.action_space.sample())
"""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence

import gymnasium as gym
import numpy as np

from kvray.core.index import ROOT
from kvray.policy.base import PageContext
from kvray.policy.features import CANDIDATES, DROP_COST, FEATURES, FeaturePolicy, padded
from kvray.sim.cost import Scenario
from kvray.sim.simulator import Simulator, next_uses, session_of
from kvray.core.tiers import Tier
from kvray.traces import TraceRequest, full_blocks, unique_blocks

Decisions = Generator[np.ndarray, int, None]


class PlacementEnv(gym.Env):
    """Admission and eviction decisions of a trace replay with modeled-cost regret rewards."""

    metadata = {"render_modes": []}

    def __init__(
        self,
        trace: Sequence[TraceRequest],
        scenario: Scenario,
        capacities: Mapping[Tier, int] | None = None,
        episode_requests: int = 400,
        slot_cost: float = 0.3,
        max_regret: float = 1.0,
    ) -> None:
        self.trace = list(trace)
        self.scenario = scenario
        self.capacities = dict(capacities or scenario.capacities())
        self.episode_requests = min(episode_requests, len(self.trace))
        self.futures = next_uses(self.trace)
        self.rate = max(unique_blocks(self.trace) / len(self.trace), 1.0)  # new pages per request
        self.warmup_requests = int(sum(self.capacities.values()) / self.rate)
        self.observation_space = gym.spaces.Box(-10.0, 10.0, (CANDIDATES * len(FEATURES),), np.float32)
        self.action_space = gym.spaces.Discrete(CANDIDATES)
        self.slot_cost = slot_cost
        self.max_regret = max_regret
        self._decisions: Decisions | None = None

    # -- gymnasium API -------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self.policy = FeaturePolicy()
        self.sim = Simulator(self.scenario, self.policy, self.capacities)
        last_start = len(self.trace) - self.episode_requests
        start = int(self.np_random.integers(0, last_start + 1))
        self._next_use: dict[int, float] = {}
        for i in range(max(0, start - self.warmup_requests), start):
            self._learn_future(i)
            self.sim.serve(self.trace[i])
        self.ttft_ms: list[float] = []
        self._decisions = self._replay(start, start + self.episode_requests)
        return next(self._decisions), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        assert self._decisions is not None, "call reset() first"
        self._reward = 0.0
        try:
            obs = self._decisions.send(int(action))
        except StopIteration:
            self._decisions = None
            info = {"mean_ttft_ms": float(np.mean(self.ttft_ms)) if self.ttft_ms else 0.0}
            return np.zeros(self.observation_space.shape, np.float32), self._reward, True, False, info
        return obs, self._reward, False, False, {}

    # -- the replay, paused at every decision ------------------------------------------
    def _learn_future(self, i: int) -> None:
        for key, nxt in zip(self.trace[i].hash_ids, self.futures[i].tolist()):
            self._next_use[key] = nxt

    def _replay(self, start: int, stop: int) -> Decisions:
        sim, manager = self.sim, self.sim.manager
        for i in range(start, stop):
            request = self.trace[i]
            self._now = i
            self._learn_future(i)
            hit_tiers, ttft = sim.begin(request)
            self.ttft_ms.append(ttft)
            keys, tenant = full_blocks(request.hash_ids, request.input_length, sim.block_tokens), session_of(request)
            parent = ROOT if not hit_tiers else manager.index.handle_of(keys[len(hit_tiers) - 1])
            for depth in range(len(hit_tiers), len(keys)):
                ctx = PageContext(depth=depth, request_pages=len(keys), tenant=tenant)
                options, rows = self.policy.admission_rows(ctx)
                choice = options[(yield self._obs(rows)) % len(options)]
                self._reward = -min(self._admission_regret(options, choice, keys[depth:]), self.max_regret)
                if choice is None or not (yield from self._room_under(parent, choice)):
                    break  # not kept: its descendants could never match
                slot = manager.reserve(choice, sim.mover)  # a slot is free: no eviction here
                parent = manager.complete_store(keys[depth], choice, slot, 0, parent=parent, depth=depth, ctx=ctx)

    def _room_under(self, parent: int, tier: Tier) -> Generator[np.ndarray, int, bool]:
        """Free a slot in ``tier`` while keeping ``parent`` (the chain a new page joins)."""
        if parent == ROOT:
            return (yield from self._make_room(tier))
        self.sim.manager.keep(parent)
        try:
            return (yield from self._make_room(tier))
        finally:
            self.sim.manager.release(parent)

    def _make_room(self, tier: Tier) -> Generator[np.ndarray, int, bool]:
        """Free a slot in ``tier``, asking which page leaves; False if none can. Mirrors
        :meth:`CacheManager.reserve`: a page that cannot leave is skipped (pinned) meanwhile."""
        manager, policy, pins = self.sim.manager, self.policy, self.sim.manager.index.pins
        refused: list[int] = []
        try:
            while manager.slots[tier].free_count == 0:
                candidates = policy.candidates(tier)
                if not candidates:
                    return False
                rows = policy.eviction_rows(tier, candidates)
                victim = candidates[(yield self._obs(rows)) % len(candidates)]
                dst = policy.demote_target(victim, tier)
                losses = [self._eviction_loss(h, tier, dst) for h in candidates]
                loss = losses[candidates.index(victim)]
                self._reward = -min(loss - min(losses), self.max_regret)
                if not (yield from self._evict(victim, dst)):
                    pins[victim] += 1
                    refused.append(victim)
        finally:
            for handle in refused:
                pins[handle] -= 1
        return True

    def _evict(self, victim: int, dst: Tier | None) -> Generator[np.ndarray, int, bool]:
        """Demote ``victim`` to ``dst`` (making room there first), else drop it: as
        :meth:`CacheManager.evict` does."""
        manager = self.sim.manager
        if dst is not None and dst in manager.slots:
            manager.keep(victim)
            try:
                room = yield from self._make_room(dst)
            finally:
                manager.release(victim)
            if room and manager.relocate(victim, dst, self.sim.mover):
                return True
        return manager.drop(victim) > 0

    def _obs(self, rows: np.ndarray) -> np.ndarray:
        return np.clip(padded(rows), -10.0, 10.0).reshape(-1)

    # -- hindsight costs (rewards only) --------------------------------------------------
    def _distance(self, key: int) -> float:
        return self._next_use.get(key, np.inf) - self._now

    def _kept_cost(self, tier: Tier, key: int) -> float:
        """Modeled cost (in page prefills) of keeping the page in ``tier``: at its next use
        it is loaded from the tier it has aged into by then (pages age down the tiers at
        the trace's rate of new pages); a page not used before it would leave the cache
        costs its recomputation, if it is used at all, plus ``slot_cost`` for the slot
        it held in vain."""
        distance = self._distance(key)
        reach = 0.0
        for t in sorted(self.capacities):
            if t >= tier:
                reach += self.capacities[t] / self.rate
                if distance <= reach:
                    return self.policy.tier_cost[t]
        return (DROP_COST if distance < np.inf else 0.0) + self.slot_cost

    def _dropped_cost(self, keys: Sequence[int]) -> float:
        """Recomputing each of ``keys`` that is used again (a page dropped takes the rest
        of its chain with it)."""
        return sum(DROP_COST for key in keys if self._distance(key) < np.inf)

    def _admission_regret(self, options: list[Tier | None], choice: Tier | None, keys: Sequence[int]) -> float:
        def loss(tier: Tier | None) -> float:
            return self._dropped_cost(keys) if tier is None else self._kept_cost(tier, keys[0])

        return loss(choice) - min(loss(t) for t in options)

    def _eviction_loss(self, handle: int, tier: Tier, dst: Tier | None) -> float:
        """Added cost of evicting the page. (A dropped page takes its cached descendants
        with it; they are not charged here: walking every candidate's subtree would cost
        more than the replay, and the oldest pages a policy picks from are mostly leaves.)"""
        key = self.sim.manager.index.key_of(handle)
        after = self._dropped_cost((key,)) if dst is None else self._kept_cost(dst, key)
        return after - self._kept_cost(tier, key)


gym.register("kvray/Placement-v0", entry_point=PlacementEnv)
