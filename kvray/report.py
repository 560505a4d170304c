"""The result of replaying a trace, shared by ``kvray sim`` (modeled times) and
``kvray run`` (measured times, :mod:`kvray.apps.replay`) so that both print the same
keys and compare field by field. Only the runtime checks page bytes and times a real
prefill, so only its result has ``wrong_pages`` and ``prefill_us_per_token_measured`` (and
the nodes it lost on the way).

Token accounting follows the trace: request ``r`` has ``r.input_length`` prompt tokens in
``len(r.hash_ids)`` blocks of ``block_tokens`` (the last one may be partial); a hit on the
first ``n`` blocks saves ``min(n * block_tokens, r.input_length)`` tokens.

Every table kvray prints goes through :func:`print_table`, and every byte count and time in
one through :func:`format_bytes` and :func:`format_duration`: a figure is never cut to fit a
terminal, and reads in the unit that suits it (``9.9 TiB``, not ``10332672.0 MiB``).

Example::
    from kvray.report import ReplayTally, format_bytes, format_duration
    from kvray.traces import TraceRequest

    request = TraceRequest(timestamp_ms=0, input_length=1500, output_length=10, hash_ids=(1, 2, 3))
    tally = ReplayTally(block_tokens=512)
    tally.record(request, hit_tiers=["device", "host"], ttft_ms=42.0)
    result = tally.result(policy="lru", scenario="h100-llama8b", bytes_moved=0)
    assert result.hit_tokens == 1024
    print(result.as_json())        # requests, tokens, hit_tokens, token_hit_rate, ...
    assert format_bytes(10332672 * 2**20) == "9.9 TiB" and format_duration(1527.3167) == "25.5 min"
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvray.traces import TraceRequest

if TYPE_CHECKING:
    from rich.console import Console

BYTE_UNITS = ("KiB", "MiB", "GiB", "TiB")


def format_bytes(nbytes: float) -> str:
    """``nbytes`` in the largest binary unit (B up to TiB) that keeps the figure at least 1."""
    unit = "B"
    for larger in BYTE_UNITS:
        if abs(nbytes) < 1024:
            break
        nbytes, unit = nbytes / 1024, larger
    return f"{nbytes:.0f} B" if unit == "B" else f"{nbytes:.1f} {unit}"


def format_duration(seconds: float) -> str:
    """A duration in the unit that reads best: us below 1 ms, ms below 1 s, s below 1 min, min above."""
    size = abs(seconds)
    if size < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    if size < 1:
        return f"{seconds * 1e3:.1f} ms"
    if size < 60:
        return f"{seconds:.2f} s"
    return f"{seconds / 60:.1f} min"


def print_table(
    console: Console, title: str, columns: Sequence[str], rows: Sequence[Sequence[str]], text: Sequence[str] = ()
) -> None:
    """Print a table whose cells (rich markup) are never cut, whatever the terminal's width.

    Columns named in ``text`` hold words: left-aligned, they may wrap between words. The
    others hold figures: right-aligned, each kept on one line. Headers wrap between words.
    Rich would squeeze a table wider than the terminal by cutting cells (``1033267…``), so
    the widths are chosen here: as wide as every line when that fits the terminal; else the
    headers wrap first, then the text cells, down to their longest word; and past the
    terminal's width when even that does not fit (the terminal then folds the lines).
    """
    from rich.cells import cell_len
    from rich.table import Table
    from rich.text import Text

    def widest(lines: Sequence[str]) -> int:
        return max([cell_len(line) for line in lines] + [1])

    words, cells, headers = [], [], []  # per column: the narrowest it may be, its cells' width, its header's
    for i, name in enumerate(columns):
        lines = [line for row in rows for line in Text.from_markup(row[i]).plain.splitlines()]
        figures = [] if name in text else lines
        words.append(widest([word for line in [name, *lines] for word in line.split()] + figures))
        cells.append(max(words[-1], widest(lines)))
        headers.append(max(cells[-1], cell_len(name)))
    borders = 3 * len(columns) + 1  # a space each side of a cell, a rule between and around columns
    room = console.width - borders
    widths = words
    for narrow, wide in ((cells, headers), (words, cells)):
        if sum(narrow) <= room:
            share = (room - sum(narrow)) / max(sum(wide) - sum(narrow), 1)
            widths = [n + min(w - n, int((w - n) * share)) for n, w in zip(narrow, wide)]
            break
    table = Table(title=title, width=sum(widths) + borders)
    for name, width in zip(columns, widths):
        table.add_column(name, width=width, justify="left" if name in text else "right", overflow="fold")
    for row in rows:
        table.add_row(*row)
    console.print(table, crop=False)


def hit_tokens(request: TraceRequest, hit_pages: int, block_tokens: int) -> int:
    """Prompt tokens covered by the first ``hit_pages`` blocks of ``request``."""
    return min(hit_pages * block_tokens, request.input_length)


@dataclass
class ReplayResult:
    """Totals of one replay; ``as_json()`` is what ``kvray sim/run --json`` print."""

    requests: int
    tokens: int
    hit_tokens: int
    hit_tokens_by_tier: dict[str, int]
    mean_ttft_ms: float
    p99_ttft_ms: float
    bytes_moved: int
    policy: str
    scenario: str
    extra: dict = field(default_factory=dict)
    wrong_pages: int | None = None  # pages whose bytes were checked and wrong (runtime only)
    # What computing a missed token cost while serving (runtime only): above the calibrated
    # ``prefill_us_per_token`` by as much as the machine was slower than at calibration.
    prefill_us_per_token_measured: float | None = None
    lost_nodes: list[str] = field(default_factory=list)  # not printed: nodes differ run to run

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.tokens if self.tokens else 0.0

    def as_dict(self) -> dict:
        out = asdict(self)
        extra = out.pop("extra")
        del out["lost_nodes"]
        for runtime_only in ("wrong_pages", "prefill_us_per_token_measured"):
            if out[runtime_only] is None:
                del out[runtime_only]
        return {**out, "token_hit_rate": self.token_hit_rate, **extra}

    def as_json(self) -> str:
        return json.dumps(self.as_dict(), sort_keys=True)


def link_totals(result: ReplayResult) -> tuple[dict[str, float], dict[str, float]]:
    """GiB per kind of link summed over nodes, and each kind's busiest node's utilisation."""
    gib: dict[str, float] = {}
    busiest: dict[str, float] = {}
    for name, nbytes in result.extra["link_bytes"].items():
        kind = name.rsplit("/", 1)[-1]
        gib[kind] = gib.get(kind, 0.0) + nbytes / 2**30
    for name, share in result.extra["link_utilisation"].items():
        kind = name.rsplit("/", 1)[-1]
        busiest[kind] = max(busiest.get(kind, 0.0), share)
    return gib, busiest


def policy_stats_since(before: Mapping[str, Mapping[str, int]], after: Mapping[str, Mapping[str, int]]) -> dict[str, int]:
    """What the nodes' policies counted between two readings (:meth:`PlacementPolicy.stats`
    by node), summed over the nodes, so a replay reports its own part only. A node whose
    counts went down was restarted in between (a store actor that died): its counts are all
    new; a node that left has no second reading and adds nothing."""
    total: dict[str, int] = {}
    for node, now in after.items():
        then = before.get(node, {})
        restarted = any(n < then.get(name, 0) for name, n in now.items())
        for name, n in now.items():
            total[name] = total.get(name, 0) + n - (0 if restarted else then.get(name, 0))
    return dict(sorted(total.items()))


class ReplayTally:
    """Accumulates per-request outcomes into a :class:`ReplayResult`."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.tokens = 0
        self.hit_by_tier: dict[str, int] = {}
        self.ttft_ms: list[float] = []

    def record(self, request: TraceRequest, hit_tiers: Sequence[str], ttft_ms: float) -> None:
        """One request: the tier label of each hit page (root first) and its TTFT."""
        by_tier: dict[str, int] = {}
        for tier in hit_tiers:
            by_tier[tier] = by_tier.get(tier, 0) + self.block_tokens
        if hit_tiers:  # a partial last block saves only the tokens it has
            short = len(hit_tiers) * self.block_tokens - hit_tokens(request, len(hit_tiers), self.block_tokens)
            by_tier[hit_tiers[-1]] -= short
        self.add(request.input_length, by_tier, ttft_ms)

    def add(self, tokens: int, hit_tokens_by_tier: Mapping[str, int], ttft_ms: float) -> None:
        """One request counted already (the runtime's engines report tokens per tier)."""
        self.tokens += tokens
        for tier, n in hit_tokens_by_tier.items():
            self.hit_by_tier[tier] = self.hit_by_tier.get(tier, 0) + n
        self.ttft_ms.append(ttft_ms)

    def result(
        self,
        policy: str,
        scenario: str,
        bytes_moved: int,
        wrong_pages: int | None = None,
        lost_nodes: Sequence[str] = (),
        prefill_us_per_token_measured: float | None = None,
        **extra,
    ) -> ReplayResult:
        ttft = np.asarray(self.ttft_ms)
        return ReplayResult(
            requests=len(ttft),
            tokens=self.tokens,
            hit_tokens=sum(self.hit_by_tier.values()),
            hit_tokens_by_tier=dict(sorted(self.hit_by_tier.items())),
            mean_ttft_ms=float(ttft.mean()) if len(ttft) else 0.0,
            p99_ttft_ms=float(np.percentile(ttft, 99)) if len(ttft) else 0.0,
            bytes_moved=bytes_moved,
            policy=policy,
            scenario=scenario,
            extra=extra,
            wrong_pages=wrong_pages,
            prefill_us_per_token_measured=prefill_us_per_token_measured,
            lost_nodes=list(lost_nodes),
        )
