"""One table for replay results, so ``kvray run``, ``kvray sim`` and ``kvray demo`` print
the same columns in the same units (MiB, ms) whether the times were measured or modeled.

Example::

    print_results({"lru": result}, Console(), title="kvray sim: modeled replay")
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from kvray.core.tiers import TIER_LABELS
from kvray.report import ReplayResult

TIER_ORDER = TIER_LABELS  # fastest first
COLUMNS = ("policy", "requests", "token hit rate", "hit tokens by tier", "mean TTFT", "p99 TTFT", "bytes moved")


def print_results(results: dict[str, ReplayResult], console: Console, title: str) -> None:
    """One row per labelled result."""
    table = Table(title=title)
    for col in COLUMNS:
        table.add_column(col, justify="left" if col in ("policy", "hit tokens by tier") else "right")
    for label, result in results.items():
        r = result.as_dict()
        tiers = ", ".join(f"{t} {r['hit_tokens_by_tier'][t]}" for t in TIER_ORDER if t in r["hit_tokens_by_tier"])
        table.add_row(
            label,
            str(r["requests"]),
            f"{r['token_hit_rate']:.3f}",
            tiers or "-",
            f"{r['mean_ttft_ms']:.1f} ms",
            f"{r['p99_ttft_ms']:.1f} ms",
            f"{r['bytes_moved'] / 2**20:.1f} MiB",
        )
    console.print(table)
