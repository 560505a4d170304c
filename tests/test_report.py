"""What kvray's tables print: every figure whole at any terminal width, bytes and times in
the unit that suits them (kvray.report's helpers, which every table goes through)."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from kvray.apps.results import print_results
from kvray.apps.status import print_status
from kvray.report import ReplayResult, format_bytes, format_duration, policy_stats_since, print_table


@pytest.mark.parametrize(
    ("nbytes", "shown"),
    [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (524288 * 599, "299.5 MiB"), (10332672 * 2**20, "9.9 TiB")],
)
def test_bytes_read_in_the_largest_unit_that_keeps_them_above_one(nbytes, shown):
    assert format_bytes(nbytes) == shown


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [(5e-6, "5.0 us"), (0.0123, "12.3 ms"), (1.5, "1.50 s"), (1527.3167, "25.5 min")],
)
def test_times_read_in_us_ms_s_or_min(seconds, shown):
    assert format_duration(seconds) == shown


def printed(width: int, draw) -> str:
    out = io.StringIO()
    draw(Console(file=out, width=width))
    return out.getvalue()


def cells_of(text: str) -> list[str]:
    """Every cell's text on a printed table's lines (borders and padding stripped)."""
    return [cell.strip() for line in text.splitlines() for cell in line.split("│")[1:-1] if cell.strip()]


def shows_whole(text: str, *figures: str) -> bool:
    """Every figure printed whole inside one cell line of the table ``text``, nothing cut."""
    cells = cells_of(text)
    return "…" not in text and all(any(figure in cell for cell in cells) for figure in figures)


@pytest.mark.parametrize("width", [20, 40, 80, 200])
def test_a_table_never_cuts_a_figure_whatever_the_width(width):
    rows = [
        ("lru / local-first", "10332672", "9.9 TiB", "device 1234567\nhost 2345678"),
        ("a-much-longer-label", "7", "0 B", "-"),
    ]
    text = printed(
        width, lambda console: print_table(console, "t", ("policy", "requests", "moved", "by tier"), rows, ("policy", "by tier"))
    )
    assert shows_whole(text, "10332672", "9.9 TiB", "1234567", "2345678", "a-much-longer-label", "7", "0 B"), text
    if width >= 80:  # room enough: every text cell on one line
        assert shows_whole(text, "lru / local-first", "device 1234567"), text


def replay_result(**figures) -> ReplayResult:
    base = dict(
        requests=10332672,
        tokens=5 * 10**9,
        hit_tokens=10**9,
        hit_tokens_by_tier={"host": 10**9},
        mean_ttft_ms=1527316.7,
        p99_ttft_ms=0.05,
        bytes_moved=10332672 * 2**20,
        policy="lru",
        scenario="s",
    )
    return ReplayResult(**(base | figures))


def test_replay_results_print_whole_and_scaled_at_80_columns():
    text = printed(80, lambda console: print_results({"lru / local-first": replay_result()}, console, title="kvray sim"))
    assert shows_whole(text, "10332672", "9.9 TiB", "25.5 min", "50.0 us", "1000000000"), text
    assert "MiB" not in text


def test_status_scales_bytes_and_latency_and_shows_every_store_figure():
    node = "f2b393d49185b80ecc2144c23cb463b440d2bf89eb7e0406c65c7a49"
    store = {
        "hit_pages": 599,
        "swap_latency": {"load": {"count": 599, "mean_s": 2e-4, "p50_s": 1.28e-4, "p99_s": 0.002048, "max_s": 0.003}},
        "bytes_loaded": 599 * 524288,
        "bytes_stored": 15781 * 524288,
        "bytes_moved": 0,
        "sent_bytes": 0,
        "received_bytes": 3 * 2**30,
        "tiers": {"host": {"used": 439, "capacity": 512, "occupancy": 0.857, "fragmentation": 0.466}},
    }
    cluster = {
        "nodes": [node],
        "shards": [{"shard": 0}],
        "indexed_pages": 439,
        "page_hit_rate": 0.037,
        "hit_pages_by_tier": {"host": 599},
        "bytes_between_nodes": 5 * 2**40,
        "lost_pages": 0,
    }
    text = printed(60, lambda console: print_status({"cluster": cluster, "stores": {node: store}}, console))
    assert shows_whole(text, "f2b393d49185", "599", "2.0 ms", "299.5 MiB", "7.7 GiB", "0 B / 3.0 GiB", "439 / 512"), text
    assert "bytes between nodes 5.0 TiB" in " ".join(text.split())


def test_policy_counts_are_the_replays_own_summed_over_nodes():
    before = {"a": {"refits": 3, "tripwire_trips": 1}, "b": {"refits": 5, "tripwire_trips": 0}, "gone": {"refits": 9}}
    after = {
        "a": {"refits": 7, "tripwire_trips": 1},  # 4 more
        "b": {"refits": 2, "tripwire_trips": 1},  # fewer than before: restarted, all 2 (and 1) new
        "new": {"refits": 1, "tripwire_trips": 0},  # joined: all new
    }  # "gone" left: nothing
    assert policy_stats_since(before, after) == {"refits": 7, "tripwire_trips": 1}
    assert policy_stats_since({}, {"a": {}}) == {}  # a rule counts nothing
