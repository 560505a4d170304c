"""Cost model of one serving node: how long a page takes to reach the engine from each
tier and how long prefill takes, in modeled milliseconds from a
:class:`~kvray.scenario.Scenario`'s figures.

The simulator turns these into modeled time in place of the bytes the runtime would move
(docs/design.md, "One policy, two worlds").

Example::
    from kvray.core.tiers import Tier
    from kvray.scenario import load_scenario
    from kvray.sim.cost import CostModel

    model = CostModel(load_scenario("h100-llama8b"))     # a shipped scenario, or a YAML path
    assert model.load_ms(Tier.DISK, 1) > model.load_ms(Tier.HOST, 1)
    model.prefill_ms(tokens=2048)
"""

from __future__ import annotations

from collections.abc import Iterable

from kvray.core.tiers import TIER_BY_LABEL, Tier
from kvray.scenario import Scenario


class CostModel:
    """Modeled times (milliseconds) of page moves and prefill for one scenario.

    Example::

        model = CostModel(load_scenario("h100-llama8b"))
        model.load_ms(Tier.DISK, 1) > model.load_ms(Tier.HOST, 1)   # True
    """

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.page_nbytes = scenario.layout.page_nbytes
        self.page_tokens = scenario.layout.page_tokens
        self._read_ms = {}
        self._write_ms = {}
        for name, spec in scenario.tiers.items():
            tier = TIER_BY_LABEL[name]
            read_gbps, latency = spec.read_gbps, spec.latency_us
            if tier == Tier.REMOTE:
                read_gbps = min(read_gbps, scenario.network_gbps)
                latency += scenario.network_latency_us
            self._read_ms[tier] = latency / 1e3 + self.page_nbytes / (read_gbps * 1e6)
            self._write_ms[tier] = spec.latency_us / 1e3 + self.page_nbytes / (spec.write_gbps * 1e6)
        self._per_token_ms = scenario.compute.prefill_us_per_token / 1e3
        self._overhead_ms = scenario.compute.prefill_overhead_ms

    def load_ms(self, tier: Tier, pages: int = 1) -> float:
        """Time to bring ``pages`` pages from ``tier`` to the engine."""
        return self._read_ms[tier] * pages

    def move_ms(self, src: Tier, dst: Tier) -> float:
        """Time to move one page between tiers: read it out of ``src``, write it into ``dst``."""
        return self._read_ms[src] + self._write_ms[dst]

    def prefill_ms(self, tokens: int) -> float:
        """Time to compute the KV of ``tokens`` prompt tokens that were not cached."""
        return self._overhead_ms + tokens * self._per_token_ms if tokens > 0 else 0.0

    def page_prefill_ms(self) -> float:
        return self.page_tokens * self._per_token_ms

    def tier_cost(self, tiers: Iterable[Tier]) -> dict[Tier, float]:
        """Each tier's page load time relative to recomputing the page: what a placement
        policy weighs tiers by (in the simulator, in training and in the runtime's card)."""
        return {t: self.load_ms(t) / self.page_prefill_ms() for t in tiers}
