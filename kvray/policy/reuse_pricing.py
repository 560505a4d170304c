"""How the per-page policy prices a promotion: is a page read from disk worth host's next victim?

:class:`PromotionPricing` is the part of :class:`~kvray.policy.reuse.ReusePolicy` that
answers :meth:`~kvray.policy.reuse.ReusePolicy.promote_target` when the model decides
(``promote="model"``): it scores the page read as if it were the newest of host's recency
order and compares it with the victim the next eviction from host would take (the ranking
made here is left pending for that eviction), and, for a teacher, keeps the decision's
training rows. It reads the policy's columns, pending rankings and model and keeps no state
of its own: a mixin, kept apart so that the eviction (``reuse.py``) and the promotion's
pricing each read as one idea (docs/sim-eval, "Promotion decided per page").
"""

from __future__ import annotations

import math

import numpy as np

from kvray.core.tiers import Tier
from kvray.policy.page_features import SOURCES
from kvray.policy.reuse_model import log_next_use
from kvray.policy.reuse_weights import link_charged_miss


class PromotionPricing:
    """The promotion's price, read off a :class:`~kvray.policy.reuse.ReusePolicy`'s state
    (``self`` is one: the attributes used here are its)."""

    def _promotion_pays(self, handle: int, tier: Tier, up: Tier) -> bool:
        """Promote when the page's predicted reuse times the load each reuse saves (``tier``'s
        cost less ``up``'s) beats the predicted reuse of ``up``'s next victim times what each of
        its reuses costs more once it is demoted; free where ``up`` has a free slot. Both
        scores come from the eviction model in ``up`` (the page scored as the newest of the
        tier's recency order, offered by no ordering): fitted to the oracle's softmax over
        ``log1p(requests to next use)``, its scores are log next use up to one shared offset,
        so ``exp(-score)`` is a reuse rate up to one shared factor and the rule reads
        ``victim_score - page_score > log(victim's extra cost / page's saving)``. The victim is
        the one the next eviction takes: the ranking made here serves that eviction. A model with
        a promotion head (:mod:`~kvray.policy.reuse_promotion`) asks it instead: is the page read first?"""
        if self._held[up] < self.capacities.get(up, 0):
            return True
        victim_score = self._next_victim_score(up)
        if victim_score is None:  # every page of up is pinned: no room to make
            return False
        if self.record_promotions and self.record > 0 and self._rng.random() < self.record:
            self._keep_promotion(handle, tier, up)
        cost = self._tier_cost
        here = cost.get(up, 0.0)
        saved = cost.get(tier, 1.0) - here
        below = self._below[up]
        lost = (cost.get(below, 1.0) if below is not None else 1.0) - here
        if saved <= 0.0:
            return False
        if self._head is not None:  # the pointwise head: is the page read before the victim?
            return self._head.pays(self._page_row(handle, up), self._pending_rows[up][self._next_victim(up)], saved, lost)
        return victim_score - self._page_score(handle, up) > math.log(max(lost, 1e-9) / saved)

    def _next_victim(self, tier: Tier) -> int:
        """Which of the last ranking's first TAKE the next eviction from ``tier`` takes (its
        place in ``_pending_score``); :meth:`_next_victim_score` has just left it pending."""
        return len(self._pending_score[tier]) - len(self._pending[tier])

    def _next_victim_score(self, tier: Tier) -> float | None:
        """The score of the page the next eviction from ``tier`` takes (a ranking made now,
        if none is pending, is left pending for it); None if every page is pinned."""
        pending = self._pending.get(tier)
        pins = self.index.pins
        while pending:
            handle = pending[-1]
            if self._where.item(handle) == tier and pins.item(handle) == 0:
                return float(self._pending_score[tier][self._next_victim(tier)])
            pending.pop()
        ranked = self._pool_ranked(tier, 0)
        if not ranked:
            return None
        self._pending[tier] = ranked[: self.take][::-1]  # popped from the end: the first next
        return float(self._pending_score[tier][0])

    def _page_score(self, handle: int, tier: Tier) -> float:
        """``handle``'s eviction score were it in ``tier`` now (a teacher without a model: the oracle's)."""
        if self.model is None:
            return float(log_next_use(self._next_uses(np.array([handle])) - self._label_now)[0])
        return float((self.model.predict if self.teacher else self.model.score)(self._page_row(handle, tier))[0])

    def _page_row(self, handle: int, tier: Tier) -> np.ndarray:
        """``handle``'s feature row were it in ``tier`` now: the newest of the tier's recency
        order (just read), offered by no ordering."""
        row = self.features.matrix(np.array([handle]), ~self.index.has_children([handle]), int(tier))
        row[:, -1] = 1.0  # just read: the newest of the tier's recency order
        if self.pool[1:] != (0, 0):
            row = np.hstack([row, np.zeros((1, len(SOURCES)), dtype=np.float32)])
        return row

    def _keep_promotion(self, handle: int, tier: Tier, up: Tier) -> None:
        """Training rows of one promotion decision: the page read (scored in ``up``, as
        :meth:`_page_score` scores it) and ``up``'s next victim (its row as ranked), each with its
        true requests to next use, in the eviction decisions' label form: fitted together, the
        two scores' difference is the log ratio of their next uses that :meth:`_promotion_pays`
        compares. Weighted by what the wrong choice costs per reuse (a read from ``tier`` instead
        of ``up``, the refused page's or the displaced victim's) times the queue behind it. With
        ``pointwise_promotions`` they go to ``head_rows``, the promotion head's (:mod:`~kvray.policy.reuse_promotion`)."""
        victim = self._pending[up][-1]
        rows = np.vstack([self._page_row(handle, up), self._pending_rows[up][self._next_victim(up)][None, :]])
        into = self.head_rows or (self.rows, self.labels, self.weights)
        into[0].append(rows)
        into[1].append(log_next_use(self._next_uses(np.array([handle, victim])) - self._label_now))
        saved = self._tier_cost.get(tier, 1.0) - self._tier_cost.get(up, 0.0)
        into[2].append(link_charged_miss(saved) * self._queue_weight)
        self.promotions_recorded += 1
