"""The placement environment: registered, valid for gymnasium, its actions choose the
expert the real cache follows, its reward is the realised TTFT, and its observations never
see the trace's future."""

import gymnasium as gym
import numpy as np
from gymnasium.utils.env_checker import check_env

import kvray.rl.env  # noqa: F401  (registers the id)
from kvray.policy.experts import EXPERTS, SELECTOR_FEATURES, WINDOW
from kvray.rl.env import PlacementEnv
from kvray.scenario import DEFAULT_SCENARIO, load_scenario
from kvray.sim.simulator import Simulator
from kvray.traces import TraceRequest, read_trace

SCENARIO = load_scenario(DEFAULT_SCENARIO)
TRACE = read_trace("data/traces/synthetic_trace.jsonl", limit=5 * WINDOW)
CAPACITY = SCENARIO.scaled(fast_pages=60)


def test_env_passes_gymnasium_checks():
    env = gym.make("kvray/Placement-v0", trace=TRACE, scenario=SCENARIO, capacities=CAPACITY, episode_windows=2)
    check_env(env.unwrapped)
    assert env.observation_space.shape == (len(EXPERTS) * len(SELECTOR_FEATURES),)
    assert env.action_space.n == len(EXPERTS)


def run(env: PlacementEnv, actions, seed: int = 0) -> tuple[list[np.ndarray], list[float]]:
    obs, _ = env.reset(seed=seed)
    seen, rewards = [obs], []
    for action in actions:
        obs, reward, terminated, _, _ = env.step(action)
        rewards.append(reward)
        if terminated:
            return seen, rewards
        seen.append(obs)
    return seen, rewards


def test_always_following_one_expert_replays_exactly_that_heuristic():
    """An episode over the whole trace that always follows ARC realises ARC's TTFTs: the
    env's choices go through the policy into the manager's one eviction loop."""
    from kvray.policy import make_policy

    env = PlacementEnv(TRACE, SCENARIO, CAPACITY, episode_windows=len(TRACE))
    env.warmup_requests = 0
    _, rewards = run(env, [EXPERTS.index("arc")] * len(TRACE))
    sim = Simulator(SCENARIO, make_policy("arc"), CAPACITY)
    expected = [sim.serve(r)[1] for r in TRACE]
    assert len(rewards) == len(TRACE) // WINDOW and all(r < 0 for r in rewards)
    assert env.sim.policy.current == EXPERTS.index("arc")
    np.testing.assert_allclose(env.ttft_ms, expected[-WINDOW:])  # the last window, as realised


def test_observations_do_not_depend_on_the_future():
    """Two traces equal for 3 windows and different after (pages never seen before): the
    observations up to there are exactly the same, and they differ once the present does."""
    head, tail_a = TRACE[: 3 * WINDOW], TRACE[3 * WINDOW :]
    tail_b = [
        TraceRequest(r.timestamp_ms, r.input_length, r.output_length, tuple(10**9 + 1000 * i + j for j in range(len(r.hash_ids))))
        for i, r in enumerate(tail_a)
    ]
    envs = [PlacementEnv(head + tail, SCENARIO, CAPACITY, episode_windows=5) for tail in (tail_a, tail_b)]
    for env in envs:
        env.warmup_requests = 0
    first, second = (run(env, [1, 0, 1, 0, 1])[0] for env in envs)
    assert len(first) == len(second) == 5
    assert all(np.array_equal(a, b) for a, b in zip(first[:4], second[:4]))  # chosen before the tails were served
    assert not np.array_equal(first[4], second[4])
