"""The reuse model trained on cluster replays (kvray.rl.cluster_imitation) and what it needs of
the cluster simulator: the trace's clock, the oracle's next use across nodes, link-charged weights."""

import math

import numpy as np
import pytest

from kvray.core.errors import PolicyError
from kvray.core.placement import LRUPolicy, RequestInfo
from kvray.core.tiers import Tier
from kvray.policy.cluster import make_cluster_policy
from kvray.policy.reuse import ReusePolicy
from kvray.policy.reuse_model import ReuseModel
from kvray.policy.reuse_weights import MIN_MISS, QUEUE_WEIGHT_CAP, link_charged_miss
from kvray.rl.cluster_imitation import TraceNextUse, collect_cluster, train_cluster_reuse
from kvray.scenario import load_scenario
from kvray.sim.cluster import ClusterSimulator
from kvray.sim.load import find_load
from kvray.sim.node import node_capacities
from kvray.sim.workloads import WorkloadSpec, generate
from kvray.traces import TraceRequest


def test_a_miss_costs_its_tier_s_load_stretched_by_the_queue_on_its_link_at_most_a_recompute():
    assert link_charged_miss(0.2) == 0.2  # an idle link: the tier's own cost (the single-node teacher's weight)
    assert link_charged_miss(0.2, 0.5) == pytest.approx(0.4)  # busy half the time: a load waits about as long again
    assert link_charged_miss(0.2, 0.9) == 1.0  # slower than recomputing: a recompute is what it costs
    assert link_charged_miss(0.01, 0.99) == pytest.approx(0.01 * QUEUE_WEIGHT_CAP)  # the stretch is capped
    assert link_charged_miss(0.001) == MIN_MISS


def test_the_trace_s_next_use_is_the_first_use_after_the_request_whichever_node_serves_it():
    page = 512
    trace = [
        TraceRequest(timestamp_ms=i, input_length=page * len(ids), output_length=1, hash_ids=ids)
        for i, ids in enumerate([[1, 2], [3], [1], [1, 2]])
    ]
    nxt = TraceNextUse(trace, page)
    from kvray.traces import full_blocks

    one, two = full_blocks([1, 2], 2 * page, page)
    assert nxt([one, two], 0).tolist() == [2.0, 3.0]
    assert nxt([one, two], 2).tolist() == [3.0, 3.0]
    assert nxt([one, two], 3).tolist() == [math.inf, math.inf]


class Told(LRUPolicy):
    """LRU that keeps what it is told of each request."""

    needs_future = True
    needs_link_util = True

    def __init__(self) -> None:
        self.told: list[RequestInfo] = []

    def on_request(self, info: RequestInfo) -> None:
        self.told.append(info)


def test_a_cluster_node_is_told_the_trace_s_index_and_its_load_paths_utilisation():
    scenario = load_scenario("h100-2node-train")
    trace = generate(WorkloadSpec(sessions=8), seed=1)[:40]
    caps = node_capacities(scenario, trace, 0.05)
    policies = [Told(), Told()]
    ClusterSimulator(scenario, policies, make_cluster_policy("cost-router"), caps).replay(trace)
    told = sorted((info for p in policies for info in p.told), key=lambda info: info.index)
    served = sorted({info.index for info in told})
    assert served == list(range(len(trace)))  # every request, by its place in the trace, on some node
    assert all(set(info.load_util) == {Tier.DEVICE, Tier.HOST, Tier.DISK} for info in told)
    assert all(0.0 <= u <= 1.0 for info in told for u in info.load_util.values())
    assert any(info.load_util[Tier.HOST] > 0 for info in told)  # the loads were measured, not defaulted


def tiny_cells(load: float = 0.85):
    scenario = load_scenario("h100-2node-train")  # its NVMe loads cost half a recompute: the charge shows below 1
    trace = generate(WorkloadSpec(sessions=16), seed=2)[:120]
    caps = node_capacities(scenario, trace, 0.05)
    return scenario, find_load(trace, scenario, load, caps).trace, caps


def test_cluster_labels_are_the_trace_s_next_use_and_weights_charge_the_busy_links():
    scenario, trace, caps = tiny_cells()
    rows, labels, weights, _, promotions, head_rows = collect_cluster((scenario, trace, caps, None, 1.0, 0, (16, 8, 8), None))
    assert promotions == 0 and head_rows == ([], [], [])  # its nodes promote every disk read or none: none is decided
    assert len(rows) > 20 and len(rows) == len(labels) == len(weights)
    every = np.concatenate(labels)
    assert np.isfinite(every).all() and every.min() >= math.log1p(1.0) - 1e-6  # never a use that already passed
    # the same decisions weighed without the link charge (the weights do not change what is done)
    future = TraceNextUse(trace, scenario.layout.page_tokens)
    policies = [
        ReusePolicy(None, teacher=True, record=1.0, seed=n, pool=(16, 8, 8), promote="none", next_use=future)
        for n in range(len(caps))
    ]
    ClusterSimulator(scenario, policies, make_cluster_policy("cost-router"), caps).replay(trace)
    plain = np.array([w for p in policies for w in p.weights])
    charged = np.array(weights)
    assert len(plain) == len(charged) and (charged >= plain - 1e-9).all() and (charged > plain * 1.01).any()


def test_training_on_a_tiny_cluster_source_writes_a_model_the_policy_loads(tmp_path):
    scenario = load_scenario("h100-2node-train")
    card = train_cluster_reuse(
        tmp_path / "m", [scenario], families=("chat",), loads=(0.6,), requests=80, rounds=1, record=1.0, epochs=1, pool=(16, 8, 8)
    )
    assert card["policy"] == "reuse-cluster" and card["node_policy"] == {"promote_gate": None}
    assert card["training"]["decisions"] > 0 and [r["acted_by"] for r in card["training"]["rounds"]] == [
        "oracle among candidates",
        "model",
    ]
    assert card["training"]["sources"][0]["seed"] == 100 and card["training"]["sources"][0]["scenario"] == "h100-2node-train"
    model = ReuseModel.load(tmp_path / "m")
    assert model.pool == (16, 8, 8)
    again = train_cluster_reuse(
        tmp_path / "n", [scenario], families=("chat",), loads=(0.6,), requests=80, rounds=1, record=1.0, epochs=1, pool=(16, 8, 8)
    )
    assert again["training"]["decisions"] == card["training"]["decisions"]
    assert (tmp_path / "m" / "reuse.safetensors").read_bytes() == (tmp_path / "n" / "reuse.safetensors").read_bytes()


def test_a_gated_policy_promotes_a_disk_read_only_while_the_disk_s_load_path_is_not_busy():
    from kvray.core.manager import CacheManager

    policy = ReusePolicy(None, promote_gate=0.5, tripwire=None, load_cost_admission=False)
    CacheManager({Tier.HOST: 4, Tier.DISK: 8}, policy)
    assert policy.needs_link_util
    policy.on_request(RequestInfo(keys=(), load_util={Tier.DISK: 0.7, Tier.HOST: 0.0}))
    assert policy.promote_target(0, Tier.DISK) is None  # the NVMe path is queued: the page stays
    policy.on_request(RequestInfo(keys=(), load_util={Tier.DISK: 0.3, Tier.HOST: 0.0}))
    assert policy.promote_target(0, Tier.DISK) == Tier.HOST
    assert ReusePolicy(None, promote="none").promote_target(0, Tier.DISK) is None


def test_train_reuse_cluster_then_cluster_eval_runs_it_under_a_cluster_policy(tmp_path):
    """The commands of docs/sim-eval, tiny: `kvray train-reuse --cluster` writes a policy
    folder that `--policy reuse-cluster:OUT+cost-router` replays on a held-out cluster."""
    import json

    from typer.testing import CliRunner

    from kvray.cli import app
    from kvray.policy import make_policy

    out = tmp_path / "policy"
    train = ["train-reuse", "--cluster", "--family", "chat", "--requests", "60", "--load", "0.6", "--rounds", "0"]
    train += ["--record", "1", "--capacity-fraction", "0.05", "--lru-candidates", "16", "--frequency-candidates", "8"]
    train += ["--never-read-candidates", "8", "--promote-gate", "0.5", "--out", str(out)]
    result = CliRunner().invoke(app, train)
    assert result.exit_code == 0, result.output
    card = json.loads((out / "card.json").read_text())
    assert card["node_policy"] == {"promote_gate": 0.5} and card["training"]["sources"][0]["load"] == 0.6
    policy = make_policy(f"reuse-cluster:{out}")
    assert policy.promote_gate == 0.5 and policy.model.pool == (16, 8, 8)
    with pytest.raises(PolicyError, match="not one trained on cluster replays"):
        make_policy("reuse-cluster:policies/reuse")  # the single-node model: its promotion was never gated
    refused = CliRunner().invoke(app, [*train[:-2], "--capacity-fraction", "0.1", "--out", str(out)])
    assert refused.exit_code != 0 and "one cache size" in " ".join(refused.output.split())
    args = ["cluster-eval", "--compare", "--scenario", "simulations/h100-4node-skewed.yaml", "--generated", "40"]
    result = CliRunner().invoke(app, [*args, "--policy", f"reuse-cluster:{out}+cost-router", "--out", str(tmp_path / "e")])
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "e" / "compare.json").read_text())["rows"]
    assert [r["policy"] for r in rows if r["candidate"]] == [f"reuse-cluster:{out}"]
