"""Counterfactual labels for the selector: at every window, each expert's cost over the
next windows is known from its shadow cache; fitting to them lowers the regret."""

import numpy as np
import torch

from kvray.policy.cluster import make_cluster_policy
from kvray.policy.experts import ExpertsPolicy, leader_scores
from kvray.rl.counterfactual import CLUSTER_POLICY, collect, expected_regret, fit
from kvray.rl.train import RowScorer
from kvray.scenario import DEFAULT_SCENARIO, load_scenario
from kvray.sim.cluster import ClusterSimulator
from kvray.sim.node import node_capacities
from kvray.sim.simulator import Simulator, fast_capacity
from kvray.sim.workloads import generate, named_workload

SCENARIO = load_scenario(DEFAULT_SCENARIO)
TRACE = generate(named_workload("document"), 5)[:600]


def test_regrets_are_each_experts_excess_over_the_best_of_the_next_windows():
    horizon = 3
    rows, regret = collect([TRACE], [0.05], [SCENARIO], horizon=horizon)
    assert rows.shape[0] == regret.shape[0] == -(-len(TRACE) // 32) and rows.shape[1] == regret.shape[1] == 3
    assert (regret >= 0).all()
    assert np.allclose(regret.min(axis=1), 0.0)  # the best expert of each horizon has none

    # the same replay, recorded by hand: window costs after each choice, summed over the horizon
    costs = []
    policy = ExpertsPolicy()
    choose = policy._choose

    def record() -> None:
        costs.append(policy.window_costs())
        choose()

    policy._choose = record
    Simulator(SCENARIO, policy, fast_capacity(SCENARIO, TRACE, 0.05)).replay(TRACE)
    costs = np.array([*costs[1:], policy.window_costs()])
    ahead = np.array([costs[w : w + horizon].sum(axis=0) for w in range(len(costs))])
    best = ahead.min(axis=1, keepdims=True)
    unit = best.mean()  # the replay's mean best horizon cost: a window's excess counts as much as it moves the mean
    assert np.allclose(regret, (ahead - best) / unit, rtol=1e-5, atol=1e-7)


def test_a_cluster_gives_every_node_its_own_choices_and_labels():
    """On a cluster each node's selector chooses from its own requests' shadows: one choice
    per window of each node's share of the trace, labelled like a one-node replay's."""
    cluster = load_scenario("h100-2node-train")
    rows, regret = collect([TRACE], [0.05], [cluster], horizon=3)
    policies = [ExpertsPolicy(), ExpertsPolicy()]  # the same replay: how many requests each node's policy is told of
    ClusterSimulator(cluster, policies, make_cluster_policy(CLUSTER_POLICY), node_capacities(cluster, TRACE, 0.05)).replay(TRACE)
    assert all(p.requests for p in policies)
    assert rows.shape[0] == sum(-(-p.requests // 32) for p in policies) and regret.shape == rows.shape[:2]
    assert (regret >= 0).all() and np.allclose(regret.min(axis=1), 0.0)
    both = collect([TRACE], [0.05], [SCENARIO, cluster], horizon=3, jobs=2)  # worker processes: the same arrays
    alone = collect([TRACE], [0.05], [SCENARIO], horizon=3)
    assert np.array_equal(both[0], np.concatenate([alone[0], rows])) and np.array_equal(
        both[1], np.concatenate([alone[1], regret])
    )


def test_fitting_lowers_the_expected_regret_below_the_leader_rankings():
    rows, regret = collect([TRACE], [0.02, 0.05], [SCENARIO], horizon=4)
    scorer = RowScorer()  # starts as follow-the-leader: its last layer is zero
    before = expected_regret(scorer, torch.from_numpy(rows), torch.from_numpy(regret)).item()
    leader = float(regret[np.arange(len(rows)), np.argmax(leader_scores(rows), axis=1)].mean())
    curve = fit(scorer, rows, regret, epochs=150, seed=0)
    assert curve[-1] < before and curve[-1] < leader
