"""An ensemble of reuse models as one model whose score is the members' mean, served by the
same scoring code (`ReuseModel.mean_of`; the training is tests/rl/test_reuse_ensemble.py)."""

from __future__ import annotations

import numpy as np
import pytest

from kvray.core.errors import PolicyError
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


def test_members_of_other_widths_average_and_more_than_the_scoring_takes_are_refused():
    narrow = member(4, hidden=8)
    merged = ReuseModel.mean_of([member(1), narrow])
    rows = np.random.default_rng(5).normal(0, 2, (100, narrow.w1.shape[0])).astype(np.float32)
    expected = (member(1).predict(rows) + narrow.predict(rows)) / 2
    assert merged.w1.shape[1] == 24 and np.abs(merged.score(rows) - expected).max() < 1e-5 * max(
        1.0, float(np.abs(expected).max())
    )
    with pytest.raises(PolicyError, match="272 hidden units; the scoring takes at most 256"):
        ReuseModel.mean_of([member(seed) for seed in range(17)])


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
