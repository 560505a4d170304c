"""The cluster environment and the PPO residual on the cost router: the env is registered and
valid for gymnasium; the zero action (and the zero residual network) is the cost router to the
bit; the action's verbs reach the simulator (route, load share, prefetch); tiny training is
deterministic for a seed, exports the actor PPO trained, and the shipped weights load."""

from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.utils.env_checker import check_env

import kvray.rl.cluster_env  # noqa: F401  (registers the id)
from kvray.core.errors import PolicyError
from kvray.policy.cluster import CostRouter, make_cluster_policy
from kvray.policy.residual import CARD_FILE, REQUEST_FEATURES, ROW_FEATURES, WEIGHTS_FILE, ResidualRouter, RLRouter
from kvray.rl.cluster_env import MAX_NODES, ClusterEnv, action_size, observation_size
from kvray.scenario import load_scenario
from kvray.sim.cluster import ClusterSimulator
from kvray.sim.node import node_capacities
from kvray.sim.workloads import WorkloadSpec, generate

SCENARIO = load_scenario("h100-4node-skewed")
TRACE = generate(WorkloadSpec(sessions=30, system_prompt_pages=1, document_probability=0.5), seed=3)
CAPACITY = node_capacities(SCENARIO, TRACE, 0.05)


def test_env_is_registered_and_passes_gymnasium_checks():
    env = gym.make("kvray/Cluster-v0", trace=TRACE, scenario=SCENARIO, capacities=CAPACITY, episode_requests=16)
    check_env(env.unwrapped)
    assert env.observation_space.shape == (observation_size(),) == (MAX_NODES * len(ROW_FEATURES) + len(REQUEST_FEATURES),)
    assert env.action_space.shape == (action_size(),) == (MAX_NODES + 2,)


def episode(env: ClusterEnv, action) -> tuple[list[np.ndarray], list[float]]:
    obs, _ = env.reset(seed=0)
    seen, ttft = [obs], []
    while True:
        obs, reward, terminated, _, info = env.step(action)
        ttft.append(info["ttft_ms"])
        assert reward == -min(info["ttft_ms"] / env.reward_unit_ms, env.max_cost)
        if terminated:
            return seen, ttft
        seen.append(obs)


def test_zero_action_is_the_cost_router_to_the_bit():
    """An episode over the whole trace with the zero action realises the cost router's TTFTs
    exactly, and so does the residual router with no deviation, in a whole replay."""
    env = ClusterEnv(TRACE, SCENARIO, capacities=CAPACITY, episode_requests=len(TRACE))
    _, ttft = episode(env, np.zeros(action_size(), np.float32))
    sim = ClusterSimulator(SCENARIO, "lru", CostRouter(), CAPACITY)
    assert ttft == [sim.serve(r)[1] for r in TRACE]
    router = ClusterSimulator(SCENARIO, "lru", CostRouter(), CAPACITY).replay(TRACE)
    residual = ClusterSimulator(SCENARIO, "lru", ResidualRouter(), CAPACITY).replay(TRACE)
    assert residual.mean_ttft_ms == router.mean_ttft_ms and residual.p99_ttft_ms == router.p99_ttft_ms
    assert residual.extra["link_bytes"] == router.extra["link_bytes"]


def test_the_actions_verbs_reach_the_simulator():
    """A large residual on node 0 sends every request elsewhere; load -1 recomputes every hit
    (no hit tokens); prefetch on books prefetch loads on the links."""
    zero = np.zeros(action_size(), np.float32)
    away = zero.copy()
    away[0] = 5.0
    env = ClusterEnv(TRACE, SCENARIO, capacities=CAPACITY, episode_requests=len(TRACE))
    seen, _ = episode(env, away)
    assert env.sim.nodes[0].queue.busy_ms == 0.0 and any(obs[2] == 1.0 for obs in seen)  # node 0 was the pick at times
    recompute = zero.copy()
    recompute[MAX_NODES] = -1.0
    episode(env, recompute)
    assert sum(sum(link.bytes_by_kind.get("load", 0) for link in n.links) for n in env.sim.nodes) == 0
    prefetch = zero.copy()
    prefetch[MAX_NODES + 1] = 1.0
    episode(env, prefetch)
    assert sum(sum(link.bytes_by_kind.get("prefetch", 0) for link in n.links) for n in env.sim.nodes) > 0


def test_observation_counts_matched_pages_per_node_and_tier():
    router = ResidualRouter()
    sim = ClusterSimulator(SCENARIO, "lru", router, CAPACITY)
    for r in TRACE[:-1]:
        sim.serve(r)
    request, cluster = sim.views(TRACE[-1], node="node-1")
    rows, features, costs = router.observe(request, cluster)
    pages = max(len(request.keys), 1)
    for i, name in enumerate(cluster.names):
        local = sum(h == name for h in request.hit_nodes)
        assert rows[i, ROW_FEATURES.index("local_hit_share")] == pytest.approx(local / pages)
        assert rows[i, 7:10].sum() == pytest.approx(local / pages)  # device + host + disk shares
    assert rows[:, ROW_FEATURES.index("cost_router_pick")].sum() == 1.0
    assert cluster.names[int(np.argmax(rows[:, 2]))] == CostRouter().route(request, cluster)
    assert features[REQUEST_FEATURES.index("hit_share")] == pytest.approx(len(request.hit_nodes) / pages)


@pytest.fixture(scope="module")
def tiny_router(tmp_path_factory):
    from kvray.rl.cluster_train import train_router

    def run(seed: int) -> Path:
        out = tmp_path_factory.mktemp(f"router{seed}") / "tiny"
        train_router(
            [load_scenario("h100-2node-train")],
            timesteps=64,
            out=out,
            seed=seed,
            families=("chat",),
            loads=(0.6,),
            requests=120,
            episode_requests=16,
            n_steps=32,
            progress=False,
        )
        return out

    return run


@pytest.mark.train
def test_tiny_training_is_deterministic_and_the_numpy_router_runs_its_actor(tiny_router):
    first, again, other = tiny_router(0), tiny_router(0), tiny_router(1)
    assert (first / WEIGHTS_FILE).read_bytes() == (again / WEIGHTS_FILE).read_bytes()
    assert (first / WEIGHTS_FILE).read_bytes() != (other / WEIGHTS_FILE).read_bytes()
    policy = make_cluster_policy(f"rl-router:{first}")
    assert isinstance(policy, RLRouter) and policy.card["training"]["timesteps"] == 64
    from safetensors.torch import load_file

    from kvray.rl.cluster_train import RouterActor

    actor = RouterActor()
    tensors = load_file(str(first / WEIGHTS_FILE))
    for head in ("route", "verbs"):
        for i, layer in enumerate(getattr(actor, head)):
            layer.weight.data, layer.bias.data = tensors[f"{head}.layer{i}.weight"], tensors[f"{head}.layer{i}.bias"]
    env = ClusterEnv(TRACE, SCENARIO, capacities=CAPACITY, episode_requests=8)
    obs, _ = env.reset(seed=0)
    rows = obs[: MAX_NODES * len(ROW_FEATURES)].reshape(MAX_NODES, -1)
    nodes = int(rows[:, 0].sum())
    residual, load, prefetch = policy.decide(rows[:nodes], obs[MAX_NODES * len(ROW_FEATURES) :])
    expected = actor(torch.from_numpy(obs[None, :]))[0].detach().numpy()
    np.testing.assert_allclose(
        np.concatenate([residual, [load, prefetch]]), np.r_[expected[:nodes], expected[MAX_NODES:]], atol=1e-5
    )


def test_shipped_router_loads_and_replays():
    result = ClusterSimulator(SCENARIO, "lru", make_cluster_policy("rl-router"), CAPACITY).replay(TRACE[:60])
    assert result.extra["cluster_policy"] == "rl-router" and result.mean_ttft_ms > 0


def test_a_folder_for_another_observation_is_refused(tmp_path):
    (tmp_path / WEIGHTS_FILE).write_bytes(b"")
    (tmp_path / CARD_FILE).write_text('{"observation": {"row_features": ["x"]}}')
    with pytest.raises(PolicyError, match="trained on observation"):
        make_cluster_policy(f"rl-router:{tmp_path}")
    with pytest.raises(PolicyError, match="not a cluster policy"):
        make_cluster_policy(f"rl-router:{tmp_path / 'missing'}")


def test_the_command_line_names_what_cluster_training_and_evaluation_take(tmp_path):
    """`kvray train` needs --trace unless --cluster, which refuses one; `kvray cluster-eval
    --bandwidth-scale` replays each scenario at each scale and reports the candidate's share
    of the oracle's headroom."""
    import json

    from typer.testing import CliRunner

    from kvray.cli import app

    root = Path(__file__).resolve().parents[2]
    trace = str(root / "data" / "traces" / "synthetic_trace.jsonl")
    no_trace = CliRunner().invoke(app, ["train", "--out", str(tmp_path / "a"), "--no-evaluate"])
    assert no_trace.exit_code == 2 and "give at least one --trace" in " ".join(no_trace.stderr.split())
    both = CliRunner().invoke(app, ["train", "--cluster", "--trace", trace, "--out", str(tmp_path / "b")])
    assert both.exit_code == 2 and "leave out --trace" in " ".join(both.stderr.split())
    out = tmp_path / "eval"
    scenario = str(root / "simulations" / "h100-4node-skewed.yaml")
    args = ["cluster-eval", "--scenario", scenario, "--generated", "20", "--bandwidth-scale", "0.5", "--bandwidth-scale", "2"]
    result = CliRunner().invoke(app, [*args, "--policy", "lru+rl-router", "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads((out / "cluster.json").read_text())["rows"]
    assert {r["scenario"] for r in rows} == {"h100-4node-skewed@bandwidth-x0.5", "h100-4node-skewed@bandwidth-x2"}
    assert "lru + rl-router: mean TTFT" in (out / "cluster.md").read_text()
