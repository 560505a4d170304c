"""One table for replay results, so ``kvray run``, ``kvray sim`` and ``kvray demo`` print
the same columns in the same units whether the times were measured or modeled.

Example::

    print_results({"lru": result}, Console(), title="kvray sim: modeled replay")
"""

from __future__ import annotations

from rich.console import Console

from kvray.core.tiers import TIER_LABELS
from kvray.report import ReplayResult, format_bytes, format_duration, print_table

TIER_ORDER = TIER_LABELS  # fastest first
COLUMNS = ("policy", "requests", "token hit rate", "hit tokens by tier", "mean TTFT", "p99 TTFT", "bytes moved")


def print_results(results: dict[str, ReplayResult], console: Console, title: str) -> None:
    """One row per labelled result; each tier's hit tokens on a line of their own."""
    rows = []
    for label, result in results.items():
        by_tier = result.hit_tokens_by_tier
        rows.append(
            (
                label,
                str(result.requests),
                f"{result.token_hit_rate:.3f}",
                "\n".join(f"{t} {by_tier[t]}" for t in TIER_ORDER if t in by_tier) or "-",
                format_duration(result.mean_ttft_ms / 1e3),
                format_duration(result.p99_ttft_ms / 1e3),
                format_bytes(result.bytes_moved),
            )
        )
    print_table(console, title, COLUMNS, rows, text=("policy", "hit tokens by tier"))
