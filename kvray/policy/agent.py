"""A placement policy whose decisions are asked of an agent: a trained scorer, or the
learner of the training environment.

The cache manager asks ``admit`` and ``victim`` deep inside its one store and eviction
loop; this policy turns each question into a :class:`Decision` (the feature rows of
:mod:`kvray.policy.features`, one per choice) and takes the row the agent names. The
runtime, the simulator and training therefore run the same loop, and differ only in who
answers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvray.core.tiers import Tier
from kvray.policy.base import PageContext
from kvray.policy.features import FeaturePolicy


@dataclass(frozen=True)
class Decision:
    """One question: ``rows[i]`` describes ``choices[i]``.

    Admission (``ctx`` set): the choices are the present tiers, then None (not kept).
    Eviction (``tier`` set): the choices are the handles of the full tier's candidates.
    """

    rows: np.ndarray
    choices: Sequence[Tier | None] | Sequence[int]
    ctx: PageContext | None = None
    tier: Tier | None = None


Agent = Callable[[Decision], int]  # the index of the chosen row (taken modulo the choices)


class AgentPolicy(FeaturePolicy):
    """Admission and eviction chosen by ``agent``; FeaturePolicy's own (LRU) while it is None.

    Example::

        policy = AgentPolicy(lambda decision: 0)      # fastest tier, least recently used page
        manager = CacheManager({Tier.HOST: 8, Tier.DISK: 64}, policy)
    """

    name = "agent"

    def __init__(self, agent: Agent | None = None) -> None:
        self.agent = agent

    def admit(self, ctx: PageContext) -> Tier | None:
        if self.agent is None:
            return super().admit(ctx)
        options, rows = self.admission_rows(ctx)
        return options[self.agent(Decision(rows, options, ctx=ctx)) % len(options)]

    def victim(self, tier: Tier) -> int | None:
        if self.agent is None:
            return super().victim(tier)
        candidates = self.candidates(tier)
        if not candidates:
            return None
        decision = Decision(self.eviction_rows(tier, candidates), candidates, tier=tier)
        return candidates[self.agent(decision) % len(candidates)]
