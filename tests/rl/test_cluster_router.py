"""The cluster environment and the PPO residual on the cost router: the env is registered and
valid for gymnasium; the zero action (and the untrained network) is the cost router to the
bit; every head's choices reach the simulator (route, load share, prefetch, replicate, write
budget); tiny
training is deterministic for a seed, exports the actor PPO trained, and the shipped weights load."""

import json
import os
import shutil
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.utils.env_checker import check_env

import kvray.rl.cluster_env  # noqa: F401  (registers the id)
from kvray.apps.train_cluster import PORTABLE_NUMERICS
from kvray.core.errors import PolicyError
from kvray.policy.cluster import FIXED_WRITE_SHARE, CostRouter, make_cluster_policy
from kvray.policy.residual import (
    ACTION_HEADS,
    CANDIDATE_FEATURES,
    CANDIDATES,
    CARD_FILE,
    REQUEST_FEATURES,
    WEIGHTS_FILE,
    WRITE_BUDGET_CHOICES,
    ResidualRouter,
    RLRouter,
    observation_size,
    observation_spec,
)
from kvray.rl.cluster_env import ClusterEnv
from kvray.scenario import load_scenario
from kvray.sim.cluster import ClusterSimulator
from kvray.sim.node import node_capacities
from kvray.sim.workloads import WorkloadSpec, generate
from tests.conftest import kvray_command

SCENARIO = load_scenario("h100-4node-skewed")
TRACE = generate(WorkloadSpec(sessions=30, system_prompt_pages=1, document_probability=0.5), seed=3)
CAPACITY = node_capacities(SCENARIO, TRACE, 0.05)


def test_env_is_registered_and_passes_gymnasium_checks():
    env = gym.make("kvray/Cluster-v0", trace=TRACE, scenario=SCENARIO, capacities=CAPACITY, episode_requests=16)
    check_env(env.unwrapped)
    assert env.observation_space.shape == (observation_size(),) == (len(REQUEST_FEATURES) + CANDIDATES * len(CANDIDATE_FEATURES),)
    assert list(env.action_space.nvec) == [size for _, size in ACTION_HEADS] == [CANDIDATES, 4, 2, 2, 5]


def episode(env: ClusterEnv, action) -> tuple[list[np.ndarray], list[float]]:
    obs, _ = env.reset(seed=0)
    seen, ttft = [obs], []
    while True:
        obs, reward, terminated, _, info = env.step(action)
        ttft.append(info["ttft_ms"])
        assert info["engine_ms"] > 0.0
        assert reward == -min((info["ttft_ms"] + info["engine_ms"]) / env.reward_unit_ms, env.max_cost)
        if terminated:
            return seen, ttft
        seen.append(obs)


def test_zero_action_is_the_cost_router_to_the_bit():
    """An episode over the whole trace with the zero action realises the cost router's TTFTs
    exactly, and so does the residual router with no deviation, in a whole replay."""
    env = ClusterEnv(TRACE, SCENARIO, capacities=CAPACITY, episode_requests=len(TRACE))
    _, ttft = episode(env, np.zeros(len(ACTION_HEADS), np.int64))
    sim = ClusterSimulator(SCENARIO, "lru", CostRouter(), CAPACITY)
    assert ttft == [sim.serve(r)[1] for r in TRACE]
    router = ClusterSimulator(SCENARIO, "lru", CostRouter(), CAPACITY).replay(TRACE)
    residual = ClusterSimulator(SCENARIO, "lru", ResidualRouter(), CAPACITY).replay(TRACE)
    assert residual.mean_ttft_ms == router.mean_ttft_ms and residual.p99_ttft_ms == router.p99_ttft_ms
    assert residual.extra["link_bytes"] == router.extra["link_bytes"]


def test_cost_prefetch_is_the_residual_router_prefetching_every_request():
    """The fixed rule the learned prefetch is measured against: the cost router's route, every
    hit loaded while the request waits (prefetch bytes booked; none under the cost router)."""
    fixed = ClusterSimulator(SCENARIO, "lru", make_cluster_policy("cost-prefetch"), CAPACITY)
    residual = ClusterSimulator(SCENARIO, "lru", ResidualRouter(lambda obs: (0, 0, 1, 0, 0)), CAPACITY)
    plain = ClusterSimulator(SCENARIO, "lru", CostRouter(), CAPACITY)
    results = [sim.replay(TRACE) for sim in (fixed, residual, plain)]
    assert results[0].mean_ttft_ms == results[1].mean_ttft_ms and results[0].extra["link_bytes"] == results[1].extra["link_bytes"]
    prefetched = [sum(link.bytes_by_kind.get("prefetch", 0) for n in sim.nodes for link in n.links) for sim in (fixed, plain)]
    assert prefetched[0] > 0 == prefetched[1]


def test_the_fixed_write_budget_is_the_residual_router_choosing_its_share_every_request():
    """cost-prefetch-budget, the fixed rule the learned budget is measured against: the
    residual router prefetching and setting the rule's share of the drive's rate at every
    request, to the byte (the default share, 0.2, and ``cost-prefetch-budget:0.05``); a
    tighter budget writes less to the drives, and any writes less than cost-prefetch."""
    free = ClusterSimulator(SCENARIO, "lru", make_cluster_policy("cost-prefetch"), CAPACITY)
    free.replay(TRACE)
    written = [sum(n.nvme_write.bytes for n in free.nodes)]
    assert WRITE_BUDGET_CHOICES[3] == FIXED_WRITE_SHARE
    for name, choice in (("cost-prefetch-budget", 3), ("cost-prefetch-budget:0.05", 4)):
        fixed = ClusterSimulator(SCENARIO, "lru", make_cluster_policy(name), CAPACITY)
        residual = ClusterSimulator(SCENARIO, "lru", ResidualRouter(lambda obs, c=choice: (0, 0, 1, 0, c)), CAPACITY)
        results = [sim.replay(TRACE) for sim in (fixed, residual)]
        assert results[0].mean_ttft_ms == results[1].mean_ttft_ms
        assert results[0].extra["link_bytes"] == results[1].extra["link_bytes"]
        written.append(sum(n.nvme_write.bytes for n in fixed.nodes))
    assert written[0] > written[1] > written[2] > 0


def test_a_fixed_budgets_share_is_checked_by_name():
    """A share that is no number, or outside (0, 1] of the drive's write rate, is refused, naming the policy."""
    for share, says in (
        ("a fifth", "must be a number"),
        ("", "must be a number"),
        ("1.5", "must be in"),
        ("-0.2", "must be in"),
        ("nan", "must be in"),
    ):
        with pytest.raises(PolicyError, match=f"cost-prefetch-budget:{share}'.*{says}"):
            make_cluster_policy(f"cost-prefetch-budget:{share}")


def test_a_fixed_budget_is_reported_by_the_name_that_builds_it():
    """Replays of two shares are told apart in their results, and each name builds its policy again."""
    for name, share in (("cost-prefetch-budget", FIXED_WRITE_SHARE), ("cost-prefetch-budget:0.05", 0.05)):
        policy = make_cluster_policy(name)
        result = ClusterSimulator(SCENARIO, "lru", policy, CAPACITY).replay(TRACE[:20])
        assert result.extra["cluster_policy"] == name == policy.name
        assert make_cluster_policy(policy.name).share == share


def test_a_learned_router_is_reported_by_the_folder_that_builds_it(tmp_path):
    """A router trained into a folder reports ``rl-router:FOLDER``, so its replays are told apart
    from the shipped one's (which keeps the plain name), and that name loads the same weights."""
    from kvray.resources import shipped_or_given

    folder = tmp_path / "mine"
    shutil.copytree(shipped_or_given("cluster-default", "policies"), folder)
    ttfts = []
    for name in ("rl-router", f"rl-router:{folder}"):
        policy = make_cluster_policy(name)
        result = ClusterSimulator(SCENARIO, "lru", policy, CAPACITY).replay(TRACE[:40])
        assert result.extra["cluster_policy"] == name == policy.name
        again = ClusterSimulator(SCENARIO, "lru", make_cluster_policy(policy.name), CAPACITY).replay(TRACE[:40])
        ttfts += [result.mean_ttft_ms, again.mean_ttft_ms]
    assert len(set(ttfts)) == 1  # the same weights, whichever name loaded them


def link_bytes(env: ClusterEnv, kind: str) -> int:
    return sum(sum(link.bytes_by_kind.get(kind, 0) for link in n.links) for n in env.sim.nodes)


def test_every_heads_choices_reach_the_simulator():
    """The runner-up candidate serves other requests than the cost router's pick; load share
    0 recomputes every hit (no loads); prefetch yes books prefetch loads; replicate yes
    copies hit chains to the serving node; a write budget refuses NVMe writes beyond it."""
    env = ClusterEnv(TRACE, SCENARIO, capacities=CAPACITY, episode_requests=len(TRACE))
    episode(env, [0, 0, 0, 0, 0])
    assert link_bytes(env, "load") > 0 and link_bytes(env, "prefetch") == link_bytes(env, "replicate") == 0
    picked = [n.queue.busy_ms for n in env.sim.nodes]
    unbudgeted = sum(n.nvme_write.bytes for n in env.sim.nodes)
    assert unbudgeted > 0 and all(n.manager.disk_budget is None for n in env.sim.nodes)
    episode(env, [1, 0, 0, 0, 0])
    assert [n.queue.busy_ms for n in env.sim.nodes] != picked
    episode(env, [0, 3, 0, 0, 0])
    assert link_bytes(env, "load") == 0
    episode(env, [0, 0, 1, 0, 0])
    assert link_bytes(env, "prefetch") > 0
    episode(env, [0, 0, 0, 1, 0])
    assert link_bytes(env, "replicate") > 0
    episode(env, [0, 0, 0, 0, 4])
    assert 0 < sum(n.nvme_write.bytes for n in env.sim.nodes) < unbudgeted
    assert sum(n.manager.disk_budget.refused_pages for n in env.sim.nodes if n.manager.disk_budget) > 0


def test_the_write_budget_lands_on_the_node_that_serves_and_holds_until_changed():
    """A decision's budget choice is a share of the drive's write rate for the node asked
    first after ``route`` (the serving one; an engine's own node when it was routed to
    already), kept by choice 0, lifted by "none"; a node without a drive keeps none; the
    observation shows each candidate the budget it holds."""
    from kvray.policy.cluster import ClusterView, NodeView, RequestView

    view = ClusterView((NodeView("a", disk_write_gbps=4.0), NodeView("b", backlog_ms=50.0, disk_write_gbps=4.0), NodeView("c")))
    choice = [0, 0, 0, 0, 0]
    router = ResidualRouter(lambda obs: choice)

    def serve(keys: tuple, node: str | None = None) -> float | None:  # as the simulator and the controller ask
        served = router.route(RequestView(keys=keys), view)
        return router.disk_write_budget(view.node(node or served), view)

    def held() -> list:
        return [router.write_budgets.get(n) for n in "abc"]

    assert serve((1, 2)) is None and held() == [None, None, None]
    choice[4] = 3
    assert serve((1, 2)) == 0.2 * 4e9 and held() == [0.2, None, None]
    choice[4] = 0
    assert serve((1, 2)) == 0.2 * 4e9  # kept
    choice[4] = 4
    assert serve((1, 2), node="b") == 0.05 * 4e9 and held() == [0.2, 0.05, None]  # b's engine was routed to already
    choice[0], choice[4] = 1, 2  # the runner-up, c, has no drive
    assert serve((5,)) is None and held() == [0.2, 0.05, None]
    obs, names = router.observe(RequestView(keys=(9,)), view)
    column = len(REQUEST_FEATURES) + CANDIDATE_FEATURES.index("write_budget")
    assert names == ["a", "c"] and obs[column] == np.float32(0.2) and obs[column + len(CANDIDATE_FEATURES)] == 1.0
    choice[0], choice[4] = 0, 1
    assert serve((1, 2)) is None and held() == [None, 0.05, None]  # lifted
    assert router.disk_write_budget(view.node("b"), view) == 0.05 * 4e9  # asked again, no decision between: b keeps its own


def test_observation_shows_the_cost_routers_cheapest_nodes_first():
    router = ResidualRouter()
    sim = ClusterSimulator(SCENARIO, "lru", router, CAPACITY)
    for r in TRACE[:-1]:
        sim.serve(r)
    request, cluster = sim.views(TRACE[-1], node="node-1")
    obs, names = router.observe(request, cluster)
    assert len(names) == CANDIDATES and names[0] == CostRouter().route(request, cluster)
    pages = max(len(request.keys), 1)
    rows = obs[len(REQUEST_FEATURES) :].reshape(CANDIDATES, -1)
    column = {name: i for i, name in enumerate(CANDIDATE_FEATURES)}
    for row, name in zip(rows, names):
        local = sum(h == name for h in request.hit_nodes)
        assert row[column["local_hit_share"]] == pytest.approx(local / pages)
        assert row[column["local_device_share"] : column["local_disk_share"] + 1].sum() == pytest.approx(local / pages)
        assert row[column["front"]] == (name == request.requester)
    assert rows[0, column["cost_above_best"]] == 0.0 <= rows[1, column["cost_above_best"]]
    assert obs[REQUEST_FEATURES.index("hit_share")] == pytest.approx(len(request.hit_nodes) / pages)


def test_candidates_break_cost_ties_as_the_cost_router():
    """Equal costs: the requester first, then the scenario's order (CostRouter.route's rule)."""
    from kvray.policy.cluster import ClusterView, NodeView, RequestView

    view = ClusterView(tuple(NodeView(n, backlog_ms=5.0) for n in "abcd"), page_prefill_ms=10.0)
    for requester, expected in (("c", ["c", "a"]), ("a", ["a", "b"]), (None, ["a", "b"])):
        request = RequestView(keys=(1, 2), requester=requester)
        assert ResidualRouter().observe(request, view)[1] == expected
        assert CostRouter().route(request, view) == expected[0]
    busy = ClusterView((NodeView("a", backlog_ms=1.0), NodeView("b"), NodeView("c")), page_prefill_ms=10.0)
    request = RequestView(keys=(1, 2, 3), requester="c", hit_nodes=("a",))
    assert ResidualRouter().observe(request, busy)[1] == ["a", "c"] and CostRouter().route(request, busy) == "a"


def test_the_numpy_router_decides_as_sb3_predict_deterministic(tmp_path):
    """RouterNetwork, from weights exported out of an SB3 PPO model, picks per head what the
    model's own ``predict(deterministic=True)`` picks, on random observations."""
    from stable_baselines3 import PPO

    from kvray.policy.residual import RouterNetwork
    from kvray.rl.cluster_train import export_actor, router_policy, write_card

    env = ClusterEnv(TRACE, SCENARIO, capacities=CAPACITY, episode_requests=8)
    model = PPO(router_policy(), env, n_steps=16, batch_size=16, seed=0, device="cpu", policy_kwargs={"ortho_init": False})
    actor = model.policy.mlp_extractor.actor
    torch.manual_seed(6)  # a draw under which every choice of every head is some observation's argmax
    with torch.no_grad():
        for p in actor.parameters():
            p.normal_(0.0, 0.5)  # away from the cost router's prior, so every head's choices vary
    export_actor(actor, tmp_path)
    write_card(tmp_path, {"observation": observation_spec()})
    network, _ = RouterNetwork.load(tmp_path)
    rng = np.random.default_rng(0)
    obs = rng.uniform(-2.0, 3.0, (500, observation_size())).astype(np.float32)
    expected, _ = model.predict(obs, deterministic=True)
    ours = np.array([network(o) for o in obs])
    assert (ours == expected).all()
    assert all(len(np.unique(ours[:, h])) == size for h, (_, size) in enumerate(ACTION_HEADS))


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
    for i, layer in enumerate(actor.layers):
        layer.weight.data, layer.bias.data = tensors[f"layer{i}.weight"], tensors[f"layer{i}.bias"]
    env = ClusterEnv(TRACE, SCENARIO, capacities=CAPACITY, episode_requests=8)
    obs, _ = env.reset(seed=0)
    expected = actor(torch.from_numpy(obs[None, :]))[0].detach().numpy()
    np.testing.assert_allclose(policy.decide.logits(obs), expected, atol=1e-5)
    at, choices = 0, []
    for _, size in ACTION_HEADS:
        choices.append(int(np.argmax(expected[at : at + size])))
        at += size
    assert policy.decide(obs) == choices


def test_the_untrained_network_is_the_cost_router(tmp_path):
    """RouterActor's initial weights (zero last layer, each head's bias on choice 0), run by the
    numpy router, replay exactly as the cost router: training starts at the heuristic."""
    from kvray.rl.cluster_train import RouterActor, export_actor, write_card

    export_actor(RouterActor(), tmp_path)
    write_card(tmp_path, {"observation": observation_spec()})
    untrained = ClusterSimulator(SCENARIO, "lru", make_cluster_policy(f"rl-router:{tmp_path}"), CAPACITY).replay(TRACE)
    router = ClusterSimulator(SCENARIO, "lru", CostRouter(), CAPACITY).replay(TRACE)
    assert untrained.mean_ttft_ms == router.mean_ttft_ms and untrained.p99_ttft_ms == router.p99_ttft_ms
    assert untrained.extra["link_bytes"] == router.extra["link_bytes"]


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
    """`kvray train` needs --trace unless --cluster, which refuses one and checks --node-policy
    (--shared-disk is --cluster's); `kvray cluster-eval --bandwidth-scale` replays each scenario
    at each scale and reports the candidate's share of the oracle's headroom, and
    --shared-disk each scenario with its drives on one channel."""
    import json

    from typer.testing import CliRunner

    from kvray.cli import app

    root = Path(__file__).resolve().parents[2]
    trace = str(root / "data" / "traces" / "synthetic_trace.jsonl")
    no_trace = CliRunner().invoke(app, ["train", "--out", str(tmp_path / "a"), "--no-evaluate"])
    assert no_trace.exit_code == 2 and "give at least one --trace" in " ".join(no_trace.stderr.split())
    both = CliRunner().invoke(app, ["train", "--cluster", "--trace", trace, "--out", str(tmp_path / "b")])
    assert both.exit_code == 2 and "leave out --trace" in " ".join(both.stderr.split())
    unknown = ["train", "--cluster", "--node-policy", "nope", "--capacity-fraction", "0.05", "--out", str(tmp_path / "c")]
    refused = CliRunner().invoke(app, unknown)
    assert refused.exit_code == 2 and "unknown policy 'nope'" in " ".join(refused.stderr.split())
    one_node = CliRunner().invoke(app, ["train", "--shared-disk", "--trace", trace, "--out", str(tmp_path / "d")])
    assert one_node.exit_code == 2 and "give --cluster too" in " ".join(one_node.stderr.split())
    out = tmp_path / "eval"
    scenario = str(root / "simulations" / "h100-4node-skewed.yaml")
    args = ["cluster-eval", "--scenario", scenario, "--generated", "20", "--bandwidth-scale", "0.5", "--bandwidth-scale", "2"]
    result = CliRunner().invoke(app, [*args, "--policy", "lru+rl-router", "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads((out / "cluster.json").read_text())["rows"]
    assert {r["scenario"] for r in rows} == {"h100-4node-skewed@bandwidth-x0.5", "h100-4node-skewed@bandwidth-x2"}
    assert "lru + rl-router: mean TTFT" in (out / "cluster.md").read_text()
    shared = CliRunner().invoke(
        app, [*args[:5], "--shared-disk", "--compare", "--policy", "lru+cost-prefetch", "--out", str(out)]
    )
    assert shared.exit_code == 0, shared.output
    rows = json.loads((out / "compare.json").read_text())["rows"]
    assert {r["scenario"] for r in rows} == {"h100-4node-skewed@shared-disk"}
    driveless = str(root / "simulations" / "this-machine-runtime-3node.yaml")
    refused = CliRunner().invoke(
        app, ["cluster-eval", "--scenario", driveless, "--generated", "20", "--shared-disk", "--out", str(out)]
    )
    assert refused.exit_code == 2 and "has no disk tier" in " ".join(refused.stderr.split())


REPLAYED_ROLLOUTS = 2  # of the shipped training's rollouts, the first 3 replayed to the bit on an AMD EPYC Zen 4


@pytest.mark.train
@pytest.mark.timeout(1200)  # ~1 min alone; several times that on a loaded machine
def test_the_shipped_routers_training_replays_its_first_rollouts(tmp_path):
    """The command docs/sim-eval/README.md gives for policies/cluster-default, stopped after its
    first rollouts, writes the shipped card's recipe and the shipped curve's first mean rewards
    exactly: the sixty environments, the simulator under them, the untrained actor's sampling
    and PPO's first update are the ones the shipped weights were trained on. A change to any of
    them moves these rewards. Not the whole run byte for byte: PPO's later updates round by CPU
    model even on MKL's compatible path and ATen's scalar kernels (on an AMD EPYC Zen 4 the
    fourth rollout's reward parts from the card's; docs/sim-eval/README.md, "What the rebuild
    test checks"). In a process of its own, as a user runs it: the command asks for the portable
    kernels (kvray.apps.train_cluster.PORTABLE_NUMERICS) only where it loads torch itself."""
    from kvray.resources import shipped_or_given

    shipped = json.loads((shipped_or_given("cluster-default", "policies") / CARD_FILE).read_text())
    per_rollout = shipped["training"]["environments"] * shipped["training"]["n_steps"]
    out = tmp_path / "cluster-default"
    args = ["train", "--cluster", "--shared-disk"]
    args += ["--bandwidth-scale", "0.7", "--bandwidth-scale", "1", "--bandwidth-scale", "1.4"]
    args += ["--capacity-fraction", "0.05", "--timesteps", str(REPLAYED_ROLLOUTS * per_rollout), "--seed", "0"]
    env = {k: v for k, v in os.environ.items() if k not in PORTABLE_NUMERICS}  # the command's own choice
    result = kvray_command(*args, "--out", str(out), timeout=1100, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    card = json.loads((out / CARD_FILE).read_text())
    assert card["training"]["numerics"] == {"mkl_cbwr": "COMPATIBLE", "aten_cpu_capability": "DEFAULT"}
    recipe = {k: v for k, v in card["training"].items() if k not in ("timesteps", "curve")}
    assert recipe == {k: v for k, v in shipped["training"].items() if k not in ("timesteps", "curve")}
    assert {k: v for k, v in card.items() if k != "training"} == {k: v for k, v in shipped.items() if k != "training"}
    assert card["training"]["curve"] == shipped["training"]["curve"][:REPLAYED_ROLLOUTS], (
        "the shipped training's first rollouts moved: the simulator, the environment or PPO changed; retrain"
    )


def test_a_measured_fetch_price_moves_the_candidates_as_the_cost_router():
    """The view's measured ``page_fetch_ms`` prices a page from another node in both routers alike."""
    from dataclasses import replace

    from kvray.policy.cluster import ClusterView, NodeView, RequestView

    view = ClusterView((NodeView("a", backlog_ms=30.0), NodeView("b", backlog_ms=15.0)), 20.0, page_fetch_ms=2.0)
    request = RequestView(keys=(1, 2, 3), requester="b", hit_nodes=("a", "a"))
    assert ResidualRouter().observe(request, view)[1][0] == CostRouter().route(request, view) == "b"
    guessed = replace(view, page_fetch_ms=0.0)  # 0.5 a page: a's 50 beats b's 55
    assert ResidualRouter().observe(request, guessed)[1][0] == CostRouter().route(request, guessed) == "a"
