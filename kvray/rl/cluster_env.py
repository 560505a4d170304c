"""Gymnasium environment for the cluster's choices: one step per request, rewarded by its TTFT.

The learner is the ``decide`` of a :class:`~kvray.policy.residual.ResidualRouter` running
in a :class:`~kvray.sim.cluster.ClusterSimulator`: at each request the router shows its
observation (:data:`~kvray.policy.residual.REQUEST_FEATURES`, then
:data:`~kvray.policy.residual.CANDIDATE_FEATURES` of the cost router's cheapest nodes) and
the action is its deviation from the cost router, one discrete choice per head of
:data:`~kvray.policy.residual.ACTION_HEADS` (a ``MultiDiscrete`` space): which candidate
serves, the share of the cached prefix to load (the rest is recomputed), prefetch yes/no,
replicate the hit chain to the serving node yes/no, the serving node's NVMe write budget (a
share of its drive's write rate, or none). The zero action is the cost router to the bit
(its write-budget choice keeps the node's budget, and an episode's router starts with none). The replay runs in
a :class:`~kvray.rl.env.PausedReplay`, so the simulator's own ``serve`` makes every
decision; the environment only answers the router's question.

Reward: minus the request's realised TTFT (queueing, loads and prefill included) plus
``engine_weight`` x the time it held its prefill engine, over the trace's mean full-prefill
time (so the return is proportional to the time saved), capped at ``max_cost``. The engine
term is the delay the request imposes on every request queued behind it: without it that
cost reaches the learner only through later requests' TTFTs, diluted by their own noise
(measured: PPO on the TTFT alone did not learn to prefetch, though prefetching every
request cuts mean TTFT 21-64% on the training cells at load 0.85). With a discount above 0
the learner also weighs what a choice does to the queues and links later requests meet. An episode is ``episode_requests`` requests from a random
point of the trace, after the requests before it (up to ``warmup_requests``) were served by
the cost router to fill the caches. Nothing of the trace's future enters an observation.

Example::
    import gymnasium
    import kvray.rl.cluster_env  # registers kvray/Cluster-v0
    from kvray.scenario import load_scenario
    from kvray.sim.workloads import WorkloadSpec, generate

    env = gymnasium.make("kvray/Cluster-v0", trace=generate(WorkloadSpec(sessions=20), seed=1),
                         scenario=load_scenario("h100-2node-train"), episode_requests=32)
    obs, info = env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step(env.action_space.sample())
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import gymnasium as gym
import numpy as np

from kvray.core.errors import ConfigError
from kvray.core.tiers import Tier
from kvray.policy.residual import ACTION_HEADS, CLIP, Decision, ResidualRouter, observation_size
from kvray.rl.env import PausedReplay
from kvray.scenario import Scenario
from kvray.sim.cluster import ClusterSimulator
from kvray.sim.node import node_capacities
from kvray.traces import TraceRequest, session_end_hints


class ClusterEnv(gym.Env):
    """Deviating from the cost router request by request, rewarded by the realised TTFT."""

    metadata = {"render_modes": []}

    def __init__(
        self,
        trace: Sequence[TraceRequest],
        scenario: Scenario,
        policy: str = "lru",
        capacities: Sequence[Mapping[Tier, int]] | None = None,
        capacity_fraction: float = 0.05,
        episode_requests: int = 256,
        warmup_requests: int = 512,
        max_cost: float = 50.0,
        engine_weight: float = 1.0,
    ) -> None:
        self.trace = list(trace)
        self.scenario = scenario
        self.nodes = len(scenario.node_scenarios())
        if self.nodes < 2:
            raise ConfigError(f"scenario {scenario.name!r} has {self.nodes} node: the environment takes a cluster")
        if len(self.trace) < 2:
            raise ConfigError("the environment needs a trace of at least 2 requests")
        self.policy = policy
        self.capacities = list(capacities) if capacities else node_capacities(scenario, self.trace, capacity_fraction)
        self.episode_requests = min(episode_requests, len(self.trace))
        self.warmup_requests = warmup_requests
        self.max_cost = max_cost
        self.engine_weight = engine_weight
        probe = ClusterSimulator(scenario, policy, None, self.capacities)
        self.reward_unit_ms = float(np.mean([probe.nodes[0].cost.prefill_ms(r.input_length) for r in self.trace]))
        # the clients' end-of-session hints, where the nodes' policy takes them (as in a replay)
        self.session_ends = session_end_hints(self.trace, probe.block_tokens) if probe.takes_session_ends else {}
        self.observation_space = gym.spaces.Box(-CLIP, CLIP, (observation_size(),), np.float32)
        self.action_space = gym.spaces.MultiDiscrete([size for _, size in ACTION_HEADS])
        self._episode: PausedReplay | None = None
        self._served: list[tuple[float, float]] = []  # (TTFT, engine time held) of the request just served

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self.close()
        self.router = ResidualRouter()  # the cost router while the caches warm up
        self.sim = ClusterSimulator(self.scenario, self.policy, self.router, self.capacities)
        self.sim.session_ends = self.session_ends
        start = int(self.np_random.integers(0, len(self.trace) - self.episode_requests + 1))
        for i in range(max(0, start - self.warmup_requests), start):
            self.sim.serve(self.trace[i], index=i)
        self._served.clear()
        self.router.decide = self._ask
        self._episode = PausedReplay(lambda: self._replay(start, start + self.episode_requests))
        obs = self._episode.start()
        return self._no_obs() if obs is None else obs, {}

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict]:
        assert self._episode is not None, "call reset() first"
        self._served.clear()
        obs = self._episode.answer([int(a) for a in action])
        ttft, engine = self._served[0] if self._served else (0.0, 0.0)
        reward = -min((ttft + self.engine_weight * engine) / self.reward_unit_ms, self.max_cost)
        info = {"ttft_ms": ttft, "engine_ms": engine}
        if obs is None:
            self._episode = None
            return self._no_obs(), reward, True, False, info
        return obs, reward, False, False, info

    def close(self) -> None:
        if self._episode is not None:
            self._episode.stop()
            self._episode = None
        super().close()

    def _replay(self, start: int, stop: int) -> None:
        nodes = self.sim.nodes
        for i in range(start, stop):
            busy = sum(n.queue.busy_ms for n in nodes)
            ttft = self.sim.serve(self.trace[i], index=i)[1]
            self._served.append((ttft, sum(n.queue.busy_ms for n in nodes) - busy))

    def _ask(self, obs: np.ndarray) -> Decision:
        """The router's ``decide``: show the observation, wait for the action."""
        return self._episode.ask(obs)

    def _no_obs(self) -> np.ndarray:
        return np.zeros(self.observation_space.shape, np.float32)


gym.register("kvray/Cluster-v0", entry_point=ClusterEnv)
