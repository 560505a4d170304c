"""Gymnasium environment: which expert the cache follows, one window of requests per step.

The policy being trained is :class:`~kvray.policy.experts.ExpertsPolicy`: every expert
heuristic keeps its bookkeeping over the real cache and replays the same requests on a
shadow cache of its own; every ``WINDOW`` requests the policy asks its selector which
expert's admission and eviction the real cache follows next. Here the selector is the
learner: the observation is the policy's selector rows (:data:`SELECTOR_FEATURES`, one row
per expert, flattened), the action the index of the expert to follow. The replay runs
through the real :class:`~kvray.core.manager.CacheManager` of a
:class:`~kvray.sim.simulator.Simulator`, so the manager's store and eviction loop is the
only one; the environment only answers the policy's question.

Reward is the TTFT the simulator realises over the window that follows (queueing
included), as minus its ratio to recomputing every prompt of the window (capped at
``max_cost``); with a discount above 0 the learner weighs what a choice leaves in the
cache for later windows. Episodes are ``episode_windows`` windows starting at a random
point of the trace, after a warm-up that fills the cache (the policy follows LRU then).
Nothing of the trace's future enters an observation or a reward.

Example::
    import gymnasium
    import kvray.rl.env  # registers kvray/Placement-v0
    from kvray.scenario import load_scenario
    from kvray.traces import read_trace

    env = gymnasium.make("kvray/Placement-v0", trace=read_trace("synthetic_trace.jsonl", limit=300),
                         scenario=load_scenario("h100-llama8b"), episode_windows=2)
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
from kvray.policy.experts import EXPERTS, SELECTOR_FEATURES, WINDOW, ExpertsPolicy
from kvray.scenario import Scenario
from kvray.sim.simulator import Simulator
from kvray.traces import TraceRequest, unique_blocks


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
    """Choosing the expert to follow, window by window, rewarded by the realised TTFT."""

    metadata = {"render_modes": []}

    def __init__(
        self,
        trace: Sequence[TraceRequest],
        scenario: Scenario,
        capacities: Mapping[Tier, int] | None = None,
        episode_windows: int = 12,
        max_cost: float = 20.0,
    ) -> None:
        self.trace = list(trace)
        self.scenario = scenario
        self.capacities = dict(capacities or scenario.capacities())
        self.episode_requests = min(episode_windows * WINDOW, len(self.trace))
        rate = max(unique_blocks(self.trace) / len(self.trace), 1.0)  # new pages per request
        self.warmup_requests = int(sum(c for t, c in self.capacities.items() if t <= Tier.HOST) / rate)
        self.observation_space = gym.spaces.Box(-10.0, 10.0, (len(EXPERTS) * len(SELECTOR_FEATURES),), np.float32)
        self.action_space = gym.spaces.Discrete(len(EXPERTS))
        self.max_cost = max_cost
        self._episode: PausedReplay | None = None

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self.close()
        self.policy = ExpertsPolicy(selector=None)  # follows the first expert (LRU) while the cache warms up
        self.sim = Simulator(self.scenario, self.policy, self.capacities)
        start = int(self.np_random.integers(0, len(self.trace) - self.episode_requests + 1))
        start -= start % WINDOW  # the policy chooses at whole windows from the trace's start
        for request in self.trace[max(0, start - self.warmup_requests) : start]:
            self.sim.serve(request)
        self.ttft_ms: list[float] = []
        self.prefill_ms: list[float] = []
        self.policy.selector = self._ask
        self._episode = PausedReplay(lambda: self._replay(start, start + self.episode_requests))
        obs = self._episode.start()
        return self._no_obs() if obs is None else obs, {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        assert self._episode is not None, "call reset() first"
        self.ttft_ms.clear()
        self.prefill_ms.clear()
        obs = self._episode.answer(int(action))
        reward = -min(sum(self.ttft_ms) / max(sum(self.prefill_ms), 1e-9), self.max_cost)
        if obs is None:
            self._episode = None
            return self._no_obs(), reward, True, False, {}
        return obs, reward, False, False, {}

    def close(self) -> None:
        if self._episode is not None:
            self._episode.stop()
            self._episode = None
        super().close()

    def _replay(self, start: int, stop: int) -> None:
        """Serve the episode's requests; the policy asks :meth:`_ask` at every window."""
        for request in self.trace[start:stop]:
            _, ttft = self.sim.serve(request)
            self.ttft_ms.append(ttft)
            self.prefill_ms.append(self.sim.cost.prefill_ms(request.input_length))

    def _ask(self, rows: np.ndarray) -> int:
        """The selector of :attr:`policy`: show the rows, wait for the action."""
        return int(self._episode.ask(np.clip(rows, -10.0, 10.0).reshape(-1)))

    def _no_obs(self) -> np.ndarray:
        return np.zeros(self.observation_space.shape, np.float32)


gym.register("kvray/Placement-v0", entry_point=PlacementEnv)
