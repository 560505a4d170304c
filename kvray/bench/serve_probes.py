"""The served benchmark's probes (:mod:`kvray.bench.serve`): what a request costs an engine
alone, measured before each sweep. A cold prompt's TTFT sets the SLO and, per page, the
route verb's price of a page to prefill; the time from its first token to its end prices an
outstanding request beyond its pages; a page loaded from the other node prices the pages a
route would fetch (the cost router's own figure is a guess of half a page of prefill, where
a loaded page cost under 1 ms against ~49 ms to prefill one on this machine).
"""

from __future__ import annotations

import statistics

from kvray.bench.serve_engines import EngineGroup
from kvray.bench.serve_loop import Sticky, run_closed_loop
from kvray.bench.serve_workload import Session, draw

COLD_PROBES = 3


def cold_probe_s(group: EngineGroup, length: int, vocab: int, seed: int) -> tuple[float, float]:
    """Cold ``length``-token prompts, one at a time on one engine: the median unloaded TTFT,
    and the median time from the first token to the answer's end (its decode steps)."""
    probes = Session("cold", tuple(draw(vocab, length, 99, seed, k) for k in range(COLD_PROBES)), 0.0)
    answers = run_closed_loop([probes], group, Sticky(1), float("inf"))
    return statistics.median(a.ttft_s for a in answers), statistics.median(a.done_at - a.sent_at - a.ttft_s for a in answers)


def remote_page_ms(group: EngineGroup, length: int, vocab: int, seed: int) -> float:
    """What loading one page from the other node costs, unloaded: a cold ``length``-token
    prompt on engine 0, which stores its pages on its node, then the same prompt on engine 1,
    whose connector loads them from there; the median over the probes of engine 1's load
    time per page it loaded from another node (0 when none did: unknown)."""
    per_page = []
    for k in range(COLD_PROBES):
        prompt, router = draw(vocab, length, 97, seed, k), Sticky(2)  # the first session on engine 0, the next on 1
        run_closed_loop([Session("store", (prompt,), 0.0)], group, router, float("inf"))
        before = group.stats()[1]  # after engine 0's stores in flight ended (stats waits for them)
        run_closed_loop([Session("load", (prompt,), 0.0)], group, router, float("inf"))
        after = group.stats()[1]
        spent = {c: after["counters"].get(c, 0) - before["counters"].get(c, 0) for c in ("load_us", "loaded_pages")}
        remote = after["pages_by_tier"].get("remote", 0) - before["pages_by_tier"].get("remote", 0)
        if remote and remote == spent["loaded_pages"]:
            per_page.append(spent["load_us"] / 1e3 / remote)
    return statistics.median(per_page) if per_page else 0.0
