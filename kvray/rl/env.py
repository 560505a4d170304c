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

import queue
import threading
from collections.abc import Callable, Mapping, Sequence

import gymnasium as gym
import numpy as np

from kvray.core.tiers import Tier
from kvray.policy.agent import AgentPolicy, Decision
from kvray.policy.features import CANDIDATES, DROP_COST, FEATURES, padded
from kvray.sim.cost import Scenario
from kvray.sim.simulator import Simulator, next_uses
from kvray.traces import TraceRequest, full_blocks, unique_blocks


class _Stopped(Exception):
    """Unwinds a paused replay that is abandoned (a new episode, or the env closed)."""


_DONE = object()  # the replay ran to its end
_STOP = object()  # the answer that abandons a paused replay


class PausedReplay:
    """A replay run in a thread of its own that pauses at every question it asks.

    The manager asks its policy synchronously, deep inside the store and eviction loop,
    while gymnasium hands each answer in later through ``step``: the thread keeps that
    call stack waiting. Exactly one of the two threads runs at any time (each waits for
    the other's hand-off), so the replay is as deterministic as a plain call.

    Example::

        replay = PausedReplay(lambda: print(replay.ask("question?")))
        replay.start()            # "question?"
        replay.answer(42)         # prints 42, returns None: the replay is over
    """

    def __init__(self, run: Callable[[], None]) -> None:
        self._questions: queue.SimpleQueue = queue.SimpleQueue()
        self._answers: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, args=(run,), daemon=True)
        self.over = False

    def _run(self, run: Callable[[], None]) -> None:
        try:
            run()
        except _Stopped:
            return
        except BaseException as exc:  # handed to the caller's thread, raised there
            self._questions.put(exc)
            return
        self._questions.put(_DONE)

    def ask(self, question: object) -> object:
        """In the replay's thread: pause until the question is answered."""
        self._questions.put(question)
        answer = self._answers.get()
        if answer is _STOP:
            raise _Stopped
        return answer

    def start(self) -> object | None:
        """Run up to the first question and return it (None: the replay asked nothing)."""
        self._thread.start()
        return self._next()

    def answer(self, answer: object) -> object | None:
        """Answer the open question; the next question, or None once the replay is over."""
        if self.over:
            return None
        self._answers.put(answer)
        return self._next()

    def _next(self) -> object | None:
        item = self._questions.get()
        if item is _DONE or isinstance(item, BaseException):
            self.over = True
            self._thread.join()
            if item is not _DONE:
                raise item
            return None
        return item

    def stop(self) -> None:
        """Abandon the replay where it paused."""
        if not self.over and self._thread.is_alive():
            self._answers.put(_STOP)
            self._thread.join()
        self.over = True


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
        self._episode: PausedReplay | None = None
        # per tier: each tier from it down, with how far ahead (in requests) a page kept
        # there is still in that tier, as it ages down at ``rate``
        self._reach: dict[Tier, list[tuple[Tier, float]]] = {}
        for tier in self.capacities:
            reach, steps = 0.0, []
            for t in sorted(self.capacities):
                if t >= tier:
                    reach += self.capacities[t] / self.rate
                    steps.append((t, reach))
            self._reach[tier] = steps

    # -- gymnasium API -------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self.close()
        self.policy = AgentPolicy()  # LRU's decisions while the cache warms up
        self.sim = Simulator(self.scenario, self.policy, self.capacities)
        last_start = len(self.trace) - self.episode_requests
        start = int(self.np_random.integers(0, last_start + 1))
        self._next_use: dict[int, float] = {}
        for i in range(max(0, start - self.warmup_requests), start):
            self._learn_future(i)
            self.sim.serve(self.trace[i])
        self.ttft_ms: list[float] = []
        self.policy.agent = self._ask
        self._episode = PausedReplay(lambda: self._replay(start, start + self.episode_requests))
        obs = self._episode.start()
        return self._no_obs() if obs is None else obs, {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        assert self._episode is not None, "call reset() first"
        self._reward = 0.0
        obs = self._episode.answer(int(action))
        if obs is None:
            self._episode = None
            info = {"mean_ttft_ms": float(np.mean(self.ttft_ms)) if self.ttft_ms else 0.0}
            return self._no_obs(), self._reward, True, False, info
        return obs, self._reward, False, False, {}

    def close(self) -> None:
        if self._episode is not None:
            self._episode.stop()
            self._episode = None
        super().close()

    # -- the replay, paused at every decision ------------------------------------------
    def _learn_future(self, i: int) -> None:
        for key, nxt in zip(self.trace[i].hash_ids, self.futures[i].tolist()):
            self._next_use[key] = nxt

    def _replay(self, start: int, stop: int) -> None:
        """Serve the episode's requests; the policy asks :meth:`_ask` at every decision."""
        for i in range(start, stop):
            request = self.trace[i]
            self._now = i
            self._learn_future(i)
            self._keys = full_blocks(request.hash_ids, request.input_length, self.sim.block_tokens)
            _, ttft = self.sim.serve(request)
            self.ttft_ms.append(ttft)

    def _ask(self, decision: Decision) -> int:
        """The agent of :attr:`policy`: show the decision, wait for the action, score its regret."""
        action = int(self._episode.ask(self._obs(decision.rows)))
        choices = decision.choices
        choice = choices[action % len(choices)]
        if decision.ctx is not None:
            regret = self._admission_regret(choices, choice, self._keys[decision.ctx.depth :])
        else:
            dst = self.policy.demote_target(choice, decision.tier)
            losses = [self._eviction_loss(h, decision.tier, dst) for h in choices]
            regret = losses[action % len(choices)] - min(losses)
        self._reward = -min(regret, self.max_regret)
        return action

    def _no_obs(self) -> np.ndarray:
        return np.zeros(self.observation_space.shape, np.float32)

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
        for t, reach in self._reach[tier]:
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
