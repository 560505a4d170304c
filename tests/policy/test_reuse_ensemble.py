"""An ensemble of reuse models (`kvray train-reuse --ensemble K`): one model whose score is the
members' mean, trained member by member and served by the same scoring code."""

from __future__ import annotations

import numpy as np
import pytest

from kvray.core.errors import ConfigError, PolicyError
from kvray.policy.page_features import FEATURES, SOURCES
from kvray.policy.reuse_model import ReuseModel
from kvray.policy.reuse_promotion import PromotionHead

UNION = (64, 32, 32)


def member(seed: int, pool: tuple[int, int, int] = UNION, hidden: int = 16) -> ReuseModel:
    """A model with its own standardisation and weights (as seeds fitted on other rollouts have)."""
    rng = np.random.default_rng(seed)
    width = len(FEATURES) + (len(SOURCES) if pool[1:] != (0, 0) else 0)
    rows = rng.normal(rng.normal(0, 3, width), rng.uniform(0.2, 4, width), (64, width)).astype(np.float32)
    model = ReuseModel.initial(rows, hidden, rng)
    model.b1 = rng.normal(0, 0.5, hidden).astype(np.float32)
    model.b2 = rng.normal(0, 1, 1).astype(np.float32)
    model.pool = pool
    return model


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_the_merged_model_scores_the_members_mean_in_numpy_and_in_c(k):
    members = [member(seed) for seed in range(k)]
    merged = ReuseModel.mean_of(members)
    rows = np.random.default_rng(99).normal(0, 3, (500, members[0].w1.shape[0])).astype(np.float32)
    expected = np.mean([m.predict(rows).astype(np.float64) for m in members], axis=0)
    tolerance = 1e-5 * max(1.0, float(np.abs(expected).max()))
    assert merged.w1.shape[1] == 16 * k and merged.pool == UNION
    assert np.abs(merged.predict(rows) - expected).max() < tolerance
    assert np.abs(merged.score(rows) - expected).max() < tolerance
    groups = rows.reshape(50, 10, -1)  # what a decision uses: the order within a group
    for group in groups:
        mean = np.mean([m.predict(group) for m in members], axis=0)
        assert np.argmax(merged.score(group)) == np.argmax(mean)


def test_the_merged_model_saves_and_loads_as_any_reuse_model(tmp_path):
    merged = ReuseModel.mean_of([member(1), member(2)])
    merged.save(tmp_path)
    back = ReuseModel.load(tmp_path)
    rows = np.random.default_rng(3).normal(size=(20, merged.w1.shape[0])).astype(np.float32)
    assert back.pool == UNION and back.w1.shape == (merged.w1.shape[0], 32)
    assert np.array_equal(back.predict(rows), merged.predict(rows))


def test_members_that_rank_other_pools_or_carry_promotion_heads_are_refused():
    with pytest.raises(PolicyError, match="at least one"):
        ReuseModel.mean_of([])
    with pytest.raises(PolicyError, match="other pools"):
        ReuseModel.mean_of([member(1), member(2, pool=(64, 0, 0))])
    headed = member(3)
    width = 2 * headed.w1.shape[0]
    headed.promotion = PromotionHead(np.zeros(width), np.ones(width), np.zeros((width, 4)), np.zeros(4), np.zeros(4), np.zeros(1))
    with pytest.raises(PolicyError, match="promotion heads"):
        ReuseModel.mean_of([member(1), headed])


def test_an_ensemble_trains_each_member_as_its_own_seed_and_serves_their_mean(tmp_path):
    from kvray.rl.imitation import train_reuse
    from kvray.rl.reuse_ensemble import member_seeds, train_reuse_ensemble
    from kvray.scenario import DEFAULT_SCENARIO, load_scenario
    from kvray.sim.simulator import simulate
    from kvray.sim.workloads import WorkloadSpec, generate

    sources = {"tiny": generate(WorkloadSpec(sessions=10), seed=1)}
    settings = dict(rounds=0, record=1.0, capacities=(0.05,), epochs=1)
    card = train_reuse_ensemble(tmp_path / "ens", sources, members=2, seed=1, **settings)
    assert member_seeds(2, 1) == card["ensemble"]["seeds"] == [2, 3]
    assert [m["seed"] for m in card["training"]["members"]] == [2, 3]
    alone = train_reuse(tmp_path / "alone", sources, seed=3, **settings)  # a member rebuilds alone, bit for bit
    assert (tmp_path / "alone" / "reuse.safetensors").read_bytes() == (
        tmp_path / "ens" / "members" / "seed-3" / "reuse.safetensors"
    ).read_bytes()
    assert alone["training"]["decisions"] == card["training"]["members"][1]["decisions"]
    members = [ReuseModel.load(tmp_path / "ens" / m) for m in card["ensemble"]["members"]]
    merged = ReuseModel.load(tmp_path / "ens")
    rows = np.random.default_rng(0).normal(size=(64, merged.w1.shape[0])).astype(np.float32)
    expected = np.mean([m.predict(rows) for m in members], axis=0)
    assert np.allclose(merged.predict(rows), expected, atol=1e-5 * max(1.0, float(np.abs(expected).max())))
    trace = generate(WorkloadSpec(sessions=8), seed=4)
    result = simulate(trace, f"reuse:{tmp_path / 'ens'}", load_scenario(DEFAULT_SCENARIO), capacity_fraction=0.05)
    assert result.requests == len(trace)
    with pytest.raises(ConfigError, match="at least 2 members"):
        train_reuse_ensemble(tmp_path / "one", sources, members=1, **settings)


def test_the_command_refuses_an_ensemble_of_cluster_models_or_of_none(tmp_path):
    from typer.testing import CliRunner

    from kvray.cli import app

    cluster = CliRunner().invoke(app, ["train-reuse", "--cluster", "--ensemble", "2", "--out", str(tmp_path / "c")])
    assert cluster.exit_code == 2 and "--ensemble trains one-node models" in " ".join(cluster.output.split())
    none = CliRunner().invoke(app, ["train-reuse", "--ensemble", "0", "--out", str(tmp_path / "n")])
    assert none.exit_code == 2 and "--ensemble" in none.output
    assert not (tmp_path / "c").exists() and not (tmp_path / "n").exists()
