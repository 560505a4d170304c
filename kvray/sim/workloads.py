"""Seeded workload generators: multi-turn chat sessions over shared system prompts and
shared documents, written as Mooncake-style traces (prefix-chained block ids).

Ids chain like kvray's own keys: a block's id is determined by its parent's id and its
own content, so two requests share block ``i`` only if they share everything up to it.
Session starts are Poisson; turns of a session follow each other after an exponential
think time and each extends the previous turn's prompt (plus the answer it got).

Example::
    from kvray.sim.workloads import WorkloadSpec, generate
    from kvray.traces import write_parquet

    trace = generate(WorkloadSpec(sessions=200), seed=7)
    write_parquet(trace, "chat.parquet")     # or replay it: Simulator(...).replay(trace)
"""

from __future__ import annotations

from pydantic import Field

from kvray.core.config import FrozenModel
from kvray.traces import MOONCAKE_BLOCK_TOKENS, TraceRequest


class WorkloadSpec(FrozenModel):
    """Shape of a generated workload (validated like every config: see kvray.core.config)."""

    sessions: int = Field(default=500, gt=0)
    system_prompts: int = Field(default=4, gt=0)
    system_prompt_pages: int = Field(default=4, ge=0)
    documents: int = Field(default=50, ge=0)
    document_pages: int = Field(default=16, gt=0)
    document_probability: float = Field(default=0.3, ge=0, le=1)
    mean_turns: float = Field(default=4.0, ge=1)
    mean_turn_pages: float = Field(default=2.0, gt=0)
    session_rate_per_s: float = Field(default=2.0, gt=0)
    mean_think_s: float = Field(default=30.0, ge=0)
    output_tokens: int = Field(default=300, ge=0)
    block_tokens: int = Field(default=MOONCAKE_BLOCK_TOKENS, gt=0)


def generate(spec: WorkloadSpec, seed: int) -> list[TraceRequest]:
    """Requests of ``spec``'s sessions in arrival order; the same seed gives the same trace."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ids: dict[tuple, int] = {}

    def chain(parent: int, contents: list[tuple]) -> list[int]:
        out = []
        for content in contents:
            parent = ids.setdefault((parent, content), len(ids))
            out.append(parent)
        return out

    requests = []
    start = 0.0
    for session in range(spec.sessions):
        start += rng.exponential(1.0 / spec.session_rate_per_s)
        prompt = int(rng.integers(spec.system_prompts))
        contents = [("system", prompt, j) for j in range(spec.system_prompt_pages)]
        if spec.documents and rng.random() < spec.document_probability:
            doc = int(rng.integers(spec.documents))
            contents += [("document", doc, j) for j in range(spec.document_pages)]
        now = start
        for turn in range(int(rng.geometric(1.0 / spec.mean_turns))):
            new_pages = 1 + int(rng.poisson(spec.mean_turn_pages - 1)) if spec.mean_turn_pages > 1 else 1
            contents = contents + [("turn", session, turn, j) for j in range(new_pages)]
            hash_ids = tuple(chain(-1, contents))
            tokens = len(hash_ids) * spec.block_tokens - int(rng.integers(spec.block_tokens))
            requests.append(TraceRequest(round(now * 1000.0, 3), tokens, spec.output_tokens, hash_ids))
            contents = contents + [("answer", session, turn)]  # the next turn's prompt holds the answer
            now += rng.exponential(spec.mean_think_s) if spec.mean_think_s else 0.0
    return sorted(requests, key=lambda r: r.timestamp_ms)
