"""The placement environment: registered, valid for gymnasium, its decisions are the
cache's real decisions, and its observations never see the trace's future."""

import gymnasium as gym
import numpy as np
from gymnasium.utils.env_checker import check_env

import kvray.rl.env  # noqa: F401  (registers the id)
from kvray.policy.features import CANDIDATES, FEATURES
from kvray.rl.env import PlacementEnv
from kvray.sim.cost import DEFAULT_SCENARIO, load_scenario
from kvray.traces import TraceRequest, read_trace

SCENARIO = load_scenario(DEFAULT_SCENARIO)
TRACE = read_trace("data/traces/conversation_trace_first30min.jsonl", limit=160)
CAPACITY = SCENARIO.scaled(fast_pages=40)


def test_env_passes_gymnasium_checks():
    env = gym.make("kvray/Placement-v0", trace=TRACE, scenario=SCENARIO, capacities=CAPACITY, episode_requests=30)
    check_env(env.unwrapped)
    assert env.observation_space.shape == (CANDIDATES * len(FEATURES),)


def run(env: PlacementEnv, actions, seed: int = 0) -> tuple[list[np.ndarray], list[float], dict]:
    obs, _ = env.reset(seed=seed)
    seen, rewards = [obs], []
    for action in actions:
        obs, reward, terminated, truncated, info = env.step(action)
        rewards.append(reward)
        if terminated:
            return seen, rewards, info
        seen.append(obs)
    return seen, rewards, {}


def test_episode_drives_the_real_manager_and_ends_with_modeled_ttft():
    env = PlacementEnv(TRACE, SCENARIO, CAPACITY, episode_requests=30)
    obs, rewards, info = run(env, [0] * 100_000)
    assert info["mean_ttft_ms"] > 0 and len(env.ttft_ms) == 30
    assert all(r <= 0 for r in rewards)  # regret: never better than the best choice
    assert env.sim.manager.index.__len__() <= sum(CAPACITY.values())
    assert sum(env.sim.manager.metrics.moved_pages.values()) > 0  # evictions demoted pages


def test_dropping_every_new_page_keeps_the_cache_empty():
    env = PlacementEnv(TRACE, SCENARIO, CAPACITY, episode_requests=10)
    env.warmup_requests = 0
    run(env, [len(CAPACITY)] * 1000)  # the options are the tiers, then "not kept"
    assert len(env.sim.manager.index) == 0


def test_observations_do_not_depend_on_the_future():
    """Two traces equal up to request 40 and different after: the first episode steps
    (cache warm-up and decisions over requests < 40) observe exactly the same thing."""
    head = TRACE[:40]
    tail_a = TRACE[40:80]
    tail_b = [TraceRequest(r.timestamp_ms, r.input_length, r.output_length, tuple(h + 10**9 for h in r.hash_ids)) for r in tail_a]
    envs = [PlacementEnv(head + tail, SCENARIO, CAPACITY, episode_requests=80) for tail in (tail_a, tail_b)]
    first, second = (run(env, [1] * 300)[0] for env in envs)
    assert len(first) == len(second) > 100
    assert all(np.array_equal(a, b) for a, b in zip(first, second))
