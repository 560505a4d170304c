"""Seeded workload generators in five families, written as Mooncake-style traces
(prefix-chained block ids): chat, document-heavy, agent tool loops, bursty arrivals and
phase-switching between two of them.

Ids chain like kvray's own keys: a block's id is determined by its parent's id and its
own content, so two requests share block ``i`` only if they share everything up to it.
Session starts are Poisson (at ``burst_factor`` times the rate during bursts); turns of a
session follow each other after an exponential think time and each extends the previous
turn's prompt (plus the answer it got). Documents are drawn with Zipf popularity
(``document_skew``; 0 is uniform), which decides whether frequency or recency pays.

The families differ in what a cache should keep, so the best fixed eviction rule differs
between them (docs/sim-eval): :data:`FAMILIES` are the training configurations,
:data:`HELD_OUT` are configurations never trained on, for evaluation only.

Example::
    from kvray.sim.workloads import FAMILIES, WorkloadSpec, generate
    from kvray.traces import write_parquet

    trace = generate(WorkloadSpec(sessions=200), seed=7)
    write_parquet(trace, "chat.parquet")     # or replay it: Simulator(...).replay(trace)
    agent = generate(FAMILIES["agent"], seed=1)
"""

from __future__ import annotations

import numpy as np
from pydantic import Field

from kvray.core.config import FrozenModel
from kvray.core.errors import ConfigError
from kvray.traces import MOONCAKE_BLOCK_TOKENS, TraceRequest


class WorkloadSpec(FrozenModel):
    """Shape of a generated workload (validated like every config: see kvray.core.config)."""

    sessions: int = Field(default=500, gt=0)
    system_prompts: int = Field(default=4, gt=0)
    system_prompt_pages: int = Field(default=4, ge=0)
    documents: int = Field(default=50, ge=0)
    document_pages: int = Field(default=16, gt=0)
    document_probability: float = Field(default=0.3, ge=0, le=1)
    document_skew: float = Field(default=0.0, ge=0, le=4)
    mean_turns: float = Field(default=4.0, ge=1)
    mean_turn_pages: float = Field(default=2.0, gt=0)
    session_rate_per_s: float = Field(default=2.0, gt=0)
    burst_factor: float = Field(default=1.0, ge=1)
    burst_every_s: float = Field(default=120.0, gt=0)
    burst_share: float = Field(default=0.2, gt=0, le=1)
    mean_think_s: float = Field(default=30.0, ge=0)
    output_tokens: int = Field(default=300, ge=0)
    block_tokens: int = Field(default=MOONCAKE_BLOCK_TOKENS, gt=0)


class PhasedWorkload(FrozenModel):
    """Phases of different shape one after the other, ``rounds`` times over: a workload
    whose best cache rule changes while it runs. Phases share system prompts by content."""

    phases: tuple[WorkloadSpec, ...] = Field(min_length=2)
    rounds: int = Field(default=2, ge=1)


Workload = WorkloadSpec | PhasedWorkload


class _Chains:
    """Prefix-chained ids shared by every phase of one generated trace."""

    def __init__(self) -> None:
        self.ids: dict[tuple, int] = {}
        self.sessions = 0

    def chain(self, contents: list[tuple]) -> tuple[int, ...]:
        parent, out = -1, []
        for content in contents:
            parent = self.ids.setdefault((parent, content), len(self.ids))
            out.append(parent)
        return tuple(out)


def _session_rate(spec: WorkloadSpec, t: float) -> float:
    in_burst = (t % spec.burst_every_s) < spec.burst_share * spec.burst_every_s
    return spec.session_rate_per_s * (spec.burst_factor if in_burst else 1.0)


def _sessions(spec: WorkloadSpec, chains: _Chains, start: float, rng: np.random.Generator) -> tuple[list[TraceRequest], float]:
    """The requests of ``spec.sessions`` sessions starting after ``start`` (seconds);
    returns them and the last session's start."""
    popularity = None
    if spec.documents:
        weights = 1.0 / np.arange(1, spec.documents + 1) ** spec.document_skew
        popularity = weights / weights.sum()
    requests = []
    for _ in range(spec.sessions):
        start += rng.exponential(1.0 / _session_rate(spec, start))
        session = chains.sessions
        chains.sessions += 1
        prompt = int(rng.integers(spec.system_prompts))
        contents = [("system", prompt, j) for j in range(spec.system_prompt_pages)]
        if popularity is not None and rng.random() < spec.document_probability:
            doc = int(rng.choice(spec.documents, p=popularity))
            contents += [("document", doc, j) for j in range(spec.document_pages)]
        now = start
        for turn in range(int(rng.geometric(1.0 / spec.mean_turns))):
            new_pages = 1 + int(rng.poisson(spec.mean_turn_pages - 1)) if spec.mean_turn_pages > 1 else 1
            contents = contents + [("turn", session, turn, j) for j in range(new_pages)]
            hash_ids = chains.chain(contents)
            tokens = len(hash_ids) * spec.block_tokens - int(rng.integers(spec.block_tokens))
            requests.append(TraceRequest(round(now * 1000.0, 3), tokens, spec.output_tokens, hash_ids))
            contents = contents + [("answer", session, turn)]  # the next turn's prompt holds the answer
            now += rng.exponential(spec.mean_think_s) if spec.mean_think_s else 0.0
    return requests, start


def generate(spec: Workload, seed: int) -> list[TraceRequest]:
    """Requests of ``spec`` in arrival order; the same seed gives the same trace."""
    rng = np.random.default_rng(seed)
    chains = _Chains()
    phases = spec.phases * spec.rounds if isinstance(spec, PhasedWorkload) else (spec,)
    requests: list[TraceRequest] = []
    start = 0.0
    for phase in phases:
        if phase.block_tokens != phases[0].block_tokens:
            raise ConfigError("every phase of a workload needs the same block_tokens")
        more, start = _sessions(phase, chains, start, rng)
        requests += more
    return sorted(requests, key=lambda r: r.timestamp_ms)


_CHAT = WorkloadSpec(sessions=400)
_DOCUMENT = WorkloadSpec(
    sessions=1200,
    documents=300,
    document_pages=24,
    document_probability=0.95,
    document_skew=1.0,
    mean_turns=1.3,
    mean_turn_pages=1.0,
    session_rate_per_s=6.0,
    mean_think_s=20.0,
)
_AGENT = WorkloadSpec(
    sessions=150,
    system_prompts=6,
    system_prompt_pages=12,
    documents=30,
    document_pages=8,
    document_probability=0.5,
    mean_turns=12.0,
    mean_turn_pages=1.5,
    session_rate_per_s=0.5,
    mean_think_s=2.0,
)

FAMILIES: dict[str, Workload] = {
    "chat": _CHAT,
    "document": _DOCUMENT,
    "agent": _AGENT,
    "bursty": _CHAT.model_copy(update={"session_rate_per_s": 1.0, "burst_factor": 8.0, "burst_every_s": 90.0}),
    "phase": PhasedWorkload(
        phases=(_DOCUMENT.model_copy(update={"sessions": 300}), _CHAT.model_copy(update={"sessions": 100})), rounds=2
    ),
}
"""Training configurations, one per family (about 1,500 to 2,000 requests each)."""

HELD_OUT: dict[str, Workload] = {
    "agent-long": _AGENT.model_copy(
        update={"system_prompt_pages": 24, "mean_turns": 20.0, "document_probability": 0.8, "sessions": 90}
    ),
    "document-flat": _DOCUMENT.model_copy(update={"document_skew": 0.4, "document_pages": 40, "documents": 150, "sessions": 900}),
    "bursty-document": _DOCUMENT.model_copy(
        update={"burst_factor": 6.0, "session_rate_per_s": 2.0, "burst_every_s": 60.0, "document_skew": 1.3}
    ),
    "phase-agent-chat": PhasedWorkload(
        phases=(_AGENT.model_copy(update={"sessions": 50}), _CHAT.model_copy(update={"sessions": 150, "documents": 10})),
        rounds=2,
    ),
}
"""Generator configurations never trained on (evaluation only)."""


def named_workload(name: str) -> Workload:
    """A family or held-out configuration by name; unknown names list the known ones."""
    known = {**FAMILIES, **HELD_OUT}
    if name not in known:
        raise ConfigError(f"unknown workload family {name!r}; known: {', '.join(known)}")
    return known[name]
