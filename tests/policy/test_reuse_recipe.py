"""The teacher's replays as policies/reuse was trained (5288765): no promotion, no queue weight, and the
pool's decayed counts in libm's arithmetic (docs/sim-eval/README.md, "The per-page learned policy")."""

import dataclasses
import json
import math
import os

import numpy as np
import pytest

from kvray.core.errors import ConfigError
from kvray.core.manager import CacheManager
from kvray.core.placement import RequestInfo
from kvray.core.tiers import Tier
from kvray.policy.reuse import ReusePolicy
from kvray.resources import shipped_or_given
from kvray.rl.teacher_recipe import SHIPPED, TeacherRecipe
from tests.conftest import kvray_command
from tests.policy.cache_ops import NO_MOVE
from tests.policy.test_reuse import NEAR, teacher_reads_from_disk


def test_a_teacher_told_not_to_promote_leaves_a_disk_read_the_oracle_would_promote_on_disk():
    manager, page = teacher_reads_from_disk(NEAR, ReusePolicy(teacher=True, record=1.0, promote="none"))
    assert manager.index.tier[page] == Tier.DISK
    manager, page = teacher_reads_from_disk(NEAR, ReusePolicy(teacher=True, record=1.0))
    assert manager.index.tier[page] == Tier.HOST  # the default teacher promotes it (its next use is nearer)


@pytest.mark.parametrize("queued", [True, False])
def test_a_teacher_without_queue_weights_weighs_a_decision_by_its_miss_alone(queued):
    policy = ReusePolicy(teacher=True, record=1.0, queue_weighted=queued)
    manager = CacheManager({Tier.HOST: 2}, policy)
    for i, key in enumerate([11, 22, 33]):  # 33's store ranks 11 and 22 (dropped: a miss costs a recompute, 1)
        info = RequestInfo(keys=(key,), future=np.array([math.inf]), index=i, backlog_ms=30.0, page_prefill_ms=10.0)
        policy.on_request(info)
        manager.store_chain([key], NO_MOVE)
    assert policy.weights == [4.0 if queued else 1.0]  # three requests' work ahead: the miss delays four


@pytest.mark.parametrize("libm", [True, False])
def test_a_teacher_with_libm_counts_decays_them_per_page_and_a_move_brings_a_count_to_now(libm):
    """With ``libm_counts`` each read adds one to a count decayed by libm's exp (numpy's vector
    exp differs in the last bit, which reorders near ties of the least-frequent ordering) and a
    move adds none but decays the count to now, as the shipped model's replays did; without,
    a move keeps the count as it was."""
    policy = ReusePolicy(teacher=True, libm_counts=libm)
    manager = CacheManager({Tier.HOST: 1, Tier.DISK: 4}, policy)
    decay = policy._pool_decay
    manager.store_chain([11], NO_MOVE)
    hot = manager.index.handle_of(11)
    count, at = 1.0, policy.features.now
    for _ in range(3):
        policy.features.tick()
        manager.touch(manager.lookup([11]).handles)
        count = count * math.exp(-decay * (policy.features.now - at)) + 1.0
        at = policy.features.now
    if libm:
        assert policy._count[hot] == count and policy._frequency[hot] == math.log(count) + decay * at
    else:
        assert policy._count[hot] == pytest.approx(count, rel=1e-12)
    kept = policy._count[hot]
    policy.features.tick()
    manager.store_chain([22], NO_MOVE)  # 11 moves down to disk
    now = policy.features.now
    assert manager.index.tier[hot] == Tier.DISK
    if not libm:
        assert policy._counted[hot] == at and policy._count[hot] == kept
        return
    assert policy._counted[hot] == now
    moved = count * math.exp(-decay * (now - at))
    assert policy._count[hot] == moved and policy._frequency[hot] == math.log(moved) + decay * now


def test_a_training_that_promotes_nothing_cannot_record_promotion_decisions():
    with pytest.raises(ConfigError, match="promote='none' makes none"):
        TeacherRecipe(promote="none", promotions="all")
    with pytest.raises(ConfigError, match="promote='every'"):
        TeacherRecipe(promote="every")


def test_the_recipe_is_one_frozen_object_and_the_shipped_one_is_policies_reuse_s():
    """Made once at the edge and carried unchanged into every replay job; ``SHIPPED`` is the
    recipe the documented rebuild command's flags make (the slow test below rebuilds with them)."""
    with pytest.raises(dataclasses.FrozenInstanceError):
        TeacherRecipe().promote = "none"  # type: ignore[misc]
    card = json.loads((shipped_or_given("reuse", "policies") / "card.json").read_text())["training"]
    for setting in ("teacher_promote", "queue_weighted", "pool_counts"):  # its card predates promotion_decisions
        assert SHIPPED.card()[setting] == card[setting]
    assert SHIPPED.card()["promotion_decisions"] == "none"


def test_the_card_records_the_teacher_s_promotion_and_queue_weights(tmp_path, monkeypatch):
    from kvray.rl.imitation import train_reuse
    from kvray.sim.workloads import WorkloadSpec, generate

    sources = {"tiny": generate(WorkloadSpec(sessions=12), seed=5)}
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")  # read by OpenBLAS at load: here only what the card says
    cards = {
        (promote, queued): train_reuse(
            tmp_path / f"{promote}{queued}",
            sources,
            seed=3,
            rounds=0,
            record=1.0,
            capacities=(0.05,),
            epochs=1,
            recipe=TeacherRecipe(promote=promote, queue_weighted=queued, libm_counts=not queued),
        )["training"]
        for promote, queued in [("model", True), ("none", False)]
    }
    assert cards["model", True]["teacher_promote"] == "model" and cards["model", True]["queue_weighted"] is True
    assert cards["none", False]["teacher_promote"] == "none" and cards["none", False]["queue_weighted"] is False
    assert cards["none", False]["openblas_coretype"] == "Haswell" and cards["none", False]["pool_counts"] == "libm"
    assert cards["model", True]["pool_counts"] == "numpy"
    weights = {k: (tmp_path / f"{k[0]}{k[1]}" / "reuse.safetensors").read_bytes() for k in cards}
    assert weights["model", True] != weights["none", False]


@pytest.mark.slow
@pytest.mark.train
@pytest.mark.timeout(1800)  # ~130 s on a quiet machine
def test_the_shipped_reuse_model_rebuilds_byte_for_byte(tmp_path):
    """The command docs/sim-eval/README.md gives for policies/reuse writes its weights again,
    byte for byte, and each round's decisions and replay figures as its card records them. In a
    process of its own, as a user runs it: OpenBLAS picks its kernels when numpy loads, and the
    recipe asks for Haswell's (the shipped model's fit; other kernels differ in the last bits)."""
    shipped = shipped_or_given("reuse", "policies")
    out = tmp_path / "reuse"
    args = ["train-reuse", "--seed", "0", "--rounds", "2", "--lru-candidates", "64", "--frequency-candidates", "32"]
    args += ["--never-read-candidates", "32", "--teacher-promote", "none", "--no-queue-weight", "--pool-counts", "libm"]
    args += ["--jobs", "1", "--out", str(out)]
    result = kvray_command(*args, timeout=1500, env={**os.environ, "OPENBLAS_CORETYPE": "Haswell"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert (out / "reuse.safetensors").read_bytes() == (shipped / "reuse.safetensors").read_bytes(), (
        "the weights differ: the teacher's replays or the fit changed; retrain policies/reuse"
    )
    made, kept = (json.loads((folder / "card.json").read_text())["training"] for folder in (out, shipped))
    assert made["decisions"] == kept["decisions"]
    for field in ("decisions", "mean_ttft_ms"):  # each round's replays as recorded
        assert [r[field] for r in made["rounds"]] == [r[field] for r in kept["rounds"]]
