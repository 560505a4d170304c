"""The served benchmark's probe of what a page from the other node costs
(:func:`kvray.bench.serve.remote_page_ms`), which prices remote pages for the route verb:
over engines that load a prompt's pages from the other node at a known cost per page."""

from __future__ import annotations

from collections import Counter

from kvray.bench.serve_engines import PAGE
from kvray.bench.serve_probes import remote_page_ms
from tests.bench.test_serve_loop import FifoServers


class TwoNodeEngines(FifoServers):
    """Engine 0 stores what it computes on its node; engine 1 loads a prompt engine 0 has
    seen from there at ``page_ms`` a page (or, with ``local``, finds it on its own node)."""

    def __init__(self, page_ms: float, local: bool = False) -> None:
        super().__init__(engines=2, service_s=0.001)
        self.page_ms, self.local = page_ms, local
        self.stored: set[tuple[int, ...]] = set()
        self.counters = [Counter(), Counter()]
        self.tiers = [Counter(), Counter()]

    def submit(self, engine: int, request: dict) -> None:
        tokens = tuple(request["tokens"])
        if engine == 0:
            self.stored.add(tokens)
        elif tokens in self.stored:
            pages = (len(tokens) - 1) // PAGE
            self.counters[1].update(load_us=int(pages * self.page_ms * 1e3), loaded_pages=pages)
            self.tiers[1]["host" if self.local else "remote"] += pages
        super().submit(engine, request)

    def stats(self) -> list[dict]:
        return [{"counters": dict(c), "pages_by_tier": dict(t)} for c, t in zip(self.counters, self.tiers)]


def test_the_probe_prices_a_page_at_what_engine_1_spent_loading_it_from_engine_0s_node():
    engines = TwoNodeEngines(page_ms=0.8)
    assert remote_page_ms(engines, length=10 * PAGE, vocab=8192, seed=0) == 0.8
    assert engines.tiers[1]["remote"] == 3 * 9  # three probes of 9 loadable pages each


def test_a_probe_that_loaded_no_page_from_another_node_leaves_the_price_unknown():
    assert remote_page_ms(TwoNodeEngines(page_ms=0.8, local=True), length=10 * PAGE, vocab=8192, seed=0) == 0.0
