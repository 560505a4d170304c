"""`kvray train-reuse --ensemble K`: members trained one seed each, as they would be alone, and
served as their mean (kvray/rl/reuse_ensemble.py)."""

from __future__ import annotations

import numpy as np
import pytest

from kvray.core.errors import ConfigError
from kvray.policy.reuse_model import ReuseModel


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
    assert [(m["seed"], m["folder"]) for m in card["training"]["members"]] == [(2, "members/seed-2"), (3, "members/seed-3")]
    assert card["training"]["decisions"] == sum(m["decisions"] for m in card["training"]["members"])
    alone = train_reuse(tmp_path / "alone", sources, seed=3, **settings)  # a member rebuilds alone, bit for bit
    assert (tmp_path / "alone" / "reuse.safetensors").read_bytes() == (
        tmp_path / "ens" / "members" / "seed-3" / "reuse.safetensors"
    ).read_bytes()
    assert alone["training"]["decisions"] == card["training"]["members"][1]["decisions"]
    members = [ReuseModel.load(tmp_path / "ens" / m["folder"]) for m in card["training"]["members"]]
    merged = ReuseModel.load(tmp_path / "ens")
    rows = np.random.default_rng(0).normal(size=(64, merged.w1.shape[0])).astype(np.float32)
    expected = np.mean([m.predict(rows) for m in members], axis=0)
    assert np.allclose(merged.predict(rows), expected, atol=1e-5 * max(1.0, float(np.abs(expected).max())))
    trace = generate(WorkloadSpec(sessions=8), seed=4)
    result = simulate(trace, f"reuse:{tmp_path / 'ens'}", load_scenario(DEFAULT_SCENARIO), capacity_fraction=0.05)
    assert result.requests == len(trace)
    with pytest.raises(ConfigError, match="2 to 16 members, got 1"):
        train_reuse_ensemble(tmp_path / "one", sources, members=1, **settings)


def test_what_the_mean_cannot_hold_is_refused_before_any_member_trains(tmp_path):
    from kvray.cli.training import MAX_ENSEMBLE
    from kvray.rl.reuse_ensemble import MAX_MEMBERS, train_reuse_ensemble
    from kvray.rl.teacher_recipe import TeacherRecipe

    assert MAX_ENSEMBLE == MAX_MEMBERS  # the command's range is the scoring's
    headed = TeacherRecipe(promotions="all", promotion_label="pointwise")
    with pytest.raises(ConfigError, match="promotion heads"):
        train_reuse_ensemble(tmp_path / "headed", {}, members=2, recipe=headed)
    with pytest.raises(ConfigError, match="2 to 16 members, got 17"):
        train_reuse_ensemble(tmp_path / "wide", {}, members=17)
    assert not (tmp_path / "headed").exists() and not (tmp_path / "wide").exists()
