"""The pointwise promotion head (kvray/policy/reuse_promotion.py): fitted to which of the page
read and host's next victim is read first, deciding promotion where a model carries one."""

import numpy as np
import pytest

from kvray.core.errors import ConfigError
from kvray.core.tiers import Tier
from kvray.policy.page_features import FEATURES
from kvray.policy.reuse import ReusePolicy
from kvray.policy.reuse_model import WEIGHTS_FILE, ReuseModel, log_next_use
from kvray.policy.reuse_promotion import HEAD_FILE, PromotionHead, pointwise
from tests.policy.test_reuse import NEAR, most_read_nearest_model, read_from_disk, teacher_reads_from_disk


def constant_head(promote: bool, features: int = len(FEATURES)) -> PromotionHead:
    """A head that answers the same whatever the pair (p ~ 1 or ~ 0)."""
    width = 2 * features
    return PromotionHead(
        np.zeros(width), np.ones(width), np.zeros((width, 1)), np.zeros(1), np.zeros(1), np.array([10.0 if promote else -10.0])
    )


@pytest.mark.parametrize(
    ("host_reads", "disk_reads", "host", "head", "promoted"),
    [
        (2, 1, 1, None, False),  # the eviction model's rule refuses (host's victim read more) ...
        (2, 1, 1, True, True),  # ... a head that says the page is read first promotes it
        (0, 1, 1, None, True),  # the eviction model's rule promotes ...
        (0, 1, 1, False, False),  # ... a head that says the victim is read first keeps it on disk
        (2, 1, 2, False, True),  # a free host slot: nothing displaced, it moves up whatever the head says
    ],
)
def test_a_model_with_a_head_promotes_as_the_head_says(host_reads, disk_reads, host, head, promoted):
    model = most_read_nearest_model()
    model.promotion = None if head is None else constant_head(head)
    manager, policy, page = read_from_disk(host_reads, disk_reads, host, policy=ReusePolicy(model))
    assert manager.index.tier[page] == (Tier.HOST if promoted else Tier.DISK)
    if host == 1:  # promoted: 22 left host for disk; refused: it stays
        assert manager.index.tier[manager.index.handle_of(22)] == (Tier.DISK if promoted else Tier.HOST)


def test_the_head_reads_the_page_s_row_and_the_victim_s_and_weighs_the_costs():
    """The head's input is the page's row then the victim's; it promotes where p * saved beats (1 - p) * lost."""
    width = len(FEATURES)
    hits = FEATURES.index("log_hits")
    w1 = np.zeros((2 * width, 1))
    w1[hits, 0], w1[width + hits, 0] = 1.0, -1.0  # the page's hits less the victim's, when positive
    head = PromotionHead(np.zeros(2 * width), np.ones(2 * width), w1, np.zeros(1), np.array([10.0]), np.array([-5.0]))
    page, victim = np.zeros(width, dtype=np.float32), np.zeros(width, dtype=np.float32)
    page[hits] = 1.0
    assert head.probability(page, victim) == pytest.approx(1 / (1 + np.exp(-5.0)))
    assert head.pays(page, victim, saved=1.0, lost=1.0) and not head.pays(victim, page, saved=1.0, lost=1.0)
    assert not head.pays(page, victim, saved=1.0, lost=1000.0)  # displacing the victim would cost far more


def test_the_label_is_which_is_read_first_and_a_fit_learns_it():
    never = float(log_next_use(np.array([np.inf]))[0])
    assert pointwise([np.array([1.0, 2.0]), np.array([2.0, 1.0]), np.array([1.0, 1.0]), np.array([never, never])]).tolist() == [
        1.0,
        0.0,
        0.0,
        0.0,
    ]
    rng = np.random.default_rng(0)

    def pairs(n):  # the label follows the first feature's order: the page's below the victim's
        x = rng.normal(size=(n, 2, 4)).astype(np.float32)
        return list(x), [p[:, 0] for p in x]

    x, y = pairs(2000)
    head = PromotionHead.fit(x, y, np.ones(len(x)), seed=0, epochs=8)
    test_x, test_y = pairs(500)
    right = [head.pays(p[0], p[1], 1.0, 1.0) == bool(t) for p, t in zip(test_x, pointwise(test_y))]
    assert np.mean(right) > 0.9


def test_a_model_folder_keeps_its_head_and_one_without_has_none(tmp_path):
    """The head is a file of its own: the eviction weights are written byte for byte as without
    it, and a folder without the file loads a model without a head (promoting as before)."""
    bare, headed = most_read_nearest_model(), most_read_nearest_model()
    head = constant_head(True)
    head.w1 = np.random.default_rng(1).normal(size=head.w1.shape).astype(np.float32)
    headed.promotion = head
    bare.save(tmp_path / "bare")
    headed.save(tmp_path / "headed")
    assert (tmp_path / "bare" / WEIGHTS_FILE).read_bytes() == (tmp_path / "headed" / WEIGHTS_FILE).read_bytes()
    assert not (tmp_path / "bare" / HEAD_FILE).exists() and ReuseModel.load(tmp_path / "bare").promotion is None
    loaded = ReusePolicy.load(tmp_path / "headed")._head
    row = np.random.default_rng(2).normal(size=len(FEATURES)).astype(np.float32)
    assert loaded is not None and loaded.probability(row, -row) == head.probability(row, -row)


def test_a_pointwise_teacher_records_its_promotions_for_the_head_not_the_eviction_model():
    policy = ReusePolicy(teacher=True, record=1.0, record_promotions=True, pointwise_promotions=True)
    teacher_reads_from_disk(NEAR, policy)
    pairs, labels, weights = policy.head_rows
    assert policy.promotions_recorded == 1 and len(pairs) == 1 and pairs[0].shape[0] == 2
    assert pointwise(labels).tolist() == [1.0] and len(weights) == 1  # 11 is read next, before 22
    assert all(len(rows) == 1 for rows in policy.rows)  # the eviction rows: host's rankings only


def test_pointwise_training_fits_a_head_on_the_rollouts_and_rolls_it_out(tmp_path):
    from kvray.rl.imitation import train_reuse
    from kvray.rl.teacher_recipe import TeacherRecipe
    from kvray.sim.workloads import WorkloadSpec, generate

    with pytest.raises(ConfigError, match="promotions='none' records none"):
        TeacherRecipe(promotion_label="pointwise")
    sources = {"tiny": generate(WorkloadSpec(sessions=12), seed=5)}
    cards = {}
    for label in ("pair", "pointwise"):
        recipe = TeacherRecipe(promotions="rollouts", promotion_label=label)
        cards[label] = train_reuse(
            tmp_path / label, sources, seed=3, rounds=2, record=1.0, capacities=(0.05,), epochs=1, recipe=recipe
        )
    head_rows = [r["promotion_head_decisions"] for r in cards["pointwise"]["training"]["rounds"]]
    assert head_rows[0] == 0 and head_rows[1] > 0 and head_rows[2] > 0  # round 0 (the oracle's victims) records none
    assert head_rows == [r["promotion_decisions"] for r in cards["pointwise"]["training"]["rounds"]]
    assert cards["pointwise"]["training"]["promotion_label"] == "pointwise" and "promotion_head" in cards["pointwise"]
    assert (tmp_path / "pointwise" / HEAD_FILE).exists() and not (tmp_path / "pair" / HEAD_FILE).exists()
    assert all(r["promotion_head_decisions"] == 0 for r in cards["pair"]["training"]["rounds"])
    # round 1 rolls out the same eviction model either way (no promotion rows in round 0), so its
    # replays match; round 2's pair model was fitted on promotion pairs, the pointwise one was not
    pair_rounds, point_rounds = cards["pair"]["training"]["rounds"], cards["pointwise"]["training"]["rounds"]
    assert pair_rounds[1]["mean_ttft_ms"] == point_rounds[1]["mean_ttft_ms"]
    assert ReusePolicy.load(tmp_path / "pointwise")._head is not None
