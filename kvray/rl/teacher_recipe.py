"""How the teacher's replays of ``kvray train-reuse`` act and weigh what they record: one frozen,
validated object, made once at the edge (the command's flags, or a caller of
:func:`kvray.rl.imitation.train_reuse`) and carried unchanged into every replay job, so that a
setting cannot be dropped or reordered on the way and the card records exactly what trained.

The defaults are today's command's; :data:`SHIPPED` is the recipe policies/reuse was trained
with (5288765; docs/sim-eval/README.md, "The per-page learned policy, `reuse`"). No numpy here:
the command line builds one before anything heavy is imported.

Example::

    from kvray.rl.teacher_recipe import SHIPPED, TeacherRecipe

    recipe = TeacherRecipe(promotions="rollouts")
    assert recipe.records_promotions(rollout=True) and not recipe.records_promotions(rollout=False)
    assert SHIPPED.card()["teacher_promote"] == "none"
"""

from __future__ import annotations

from dataclasses import dataclass

from kvray.core.errors import ConfigError

# which teacher replays record their promotion decisions: every round's, the DAgger rollouts'
# only (round 0's victim is the oracle's, rarely the one the model would pick), or none
PROMOTION_ROWS = ("all", "rollouts", "none")
# which disk reads the teacher replays promote: as ReusePolicy's model decides (round 0 the oracle,
# later rounds the model fitted so far), or none, as when policies/reuse was trained (5288765)
TEACHER_PROMOTE = ("model", "none")
# where the recorded promotion decisions are fitted: as pairs in the eviction model's softmax (its
# score difference prices a promotion), or pointwise into a promotion head of their own
# (kvray.policy.reuse_promotion: is the page read before host's next victim?)
PROMOTION_LABELS = ("pair", "pointwise")


@dataclass(frozen=True, kw_only=True)
class TeacherRecipe:
    """The teacher's settings. ``promotions``: which replays also record their promotion
    decisions (:data:`PROMOTION_ROWS`; the page read from disk beside host's next victim, as
    :meth:`~kvray.policy.reuse.ReusePolicy.promote_target` prices it); ``promote``: which disk reads
    the replays promote (:data:`TEACHER_PROMOTE`); ``queue_weighted``: whether a decision weighs the
    requests queued behind its miss (:func:`~kvray.policy.reuse_weights.queue_weight`);
    ``libm_counts``: the pool's decayed counts kept per page in libm's arithmetic, as 5288765 kept
    them (:meth:`~kvray.policy.reuse.ReusePolicy._touch`); ``promotion_label``: where the recorded
    promotion decisions are fitted (:data:`PROMOTION_LABELS`)."""

    promotions: str = "none"
    promote: str = "model"
    queue_weighted: bool = True
    libm_counts: bool = False
    promotion_label: str = "pair"

    def __post_init__(self) -> None:
        if self.promotions not in PROMOTION_ROWS:
            raise ConfigError(f"promotions={self.promotions!r}: expected one of {', '.join(PROMOTION_ROWS)}")
        if self.promote not in TEACHER_PROMOTE:
            raise ConfigError(f"promote={self.promote!r}: expected one of {', '.join(TEACHER_PROMOTE)}")
        if self.promote == "none" and self.promotions != "none":
            raise ConfigError(f"promotions={self.promotions!r} records promotion decisions, and promote='none' makes none")
        if self.promotion_label not in PROMOTION_LABELS:
            raise ConfigError(f"promotion_label={self.promotion_label!r}: expected one of {', '.join(PROMOTION_LABELS)}")
        if self.promotion_label == "pointwise" and self.promotions == "none":
            raise ConfigError(
                "promotion_label='pointwise' fits a head to promotion decisions, and promotions='none' records none"
            )

    def records_promotions(self, rollout: bool) -> bool:
        """Whether a replay records its promotion decisions: a DAgger rollout (``rollout``: it has
        a model) or round 0's, acting as the oracle."""
        return self.promotions == "all" or (self.promotions == "rollouts" and rollout)

    def card(self) -> dict:
        """The recipe as the model card's ``training`` records it."""
        return {
            "promotion_decisions": self.promotions,
            "teacher_promote": self.promote,
            "queue_weighted": self.queue_weighted,
            "pool_counts": "libm" if self.libm_counts else "numpy",
            "promotion_label": self.promotion_label,
        }


SHIPPED = TeacherRecipe(promote="none", queue_weighted=False, libm_counts=True)  # policies/reuse's (5288765)
