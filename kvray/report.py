"""The result of replaying a trace, shared by ``kvray sim`` (modeled times) and
``kvray run`` (measured times, :mod:`kvray.apps.replay`) so that both print the same
keys and compare field by field. Only the runtime checks page bytes and times a real
prefill, so only its result has ``wrong_pages`` and ``prefill_us_per_token_measured`` (and
the nodes it lost on the way).

Token accounting follows the trace: request ``r`` has ``r.input_length`` prompt tokens in
``len(r.hash_ids)`` blocks of ``block_tokens`` (the last one may be partial); a hit on the
first ``n`` blocks saves ``min(n * block_tokens, r.input_length)`` tokens.

Example::
    from kvray.report import ReplayTally
    from kvray.traces import TraceRequest

    request = TraceRequest(timestamp_ms=0, input_length=1500, output_length=10, hash_ids=(1, 2, 3))
    tally = ReplayTally(block_tokens=512)
    tally.record(request, hit_tiers=["device", "host"], ttft_ms=42.0)
    result = tally.result(policy="lru", scenario="h100-llama8b", bytes_moved=0)
    assert result.hit_tokens == 1024
    print(result.as_json())        # requests, tokens, hit_tokens, token_hit_rate, ...
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from kvray.traces import TraceRequest


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
