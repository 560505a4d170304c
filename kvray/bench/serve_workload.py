"""The served benchmark's workload: multi-turn sessions over shared system prompts and
documents, shaped like a real trace, with real token ids.

:func:`trace_shape` reads the structure of a Mooncake trace (prefix-chained block ids):
which leading blocks most requests share (system prompts), which prefixes different
conversations share beyond them (documents), and how conversations grow turn by turn
(a request whose prompt extends an earlier request's whole prompt is that request's next
turn). :func:`serve_workload` generates sessions of that shape with
:func:`kvray.sim.workloads.generate` and gives every block real token ids: a block id's
tokens are drawn from a generator seeded by the id, so requests that share a block id
share its tokens, exactly as the trace's requests shared the text behind it.

Two things are not the trace's: time and length. A 30-minute trace spreads a
conversation's turns over minutes, so a few-minute replay of it sees little reuse
(about 10% of block references in a window of 200 requests); the generator instead
keeps ``active_sessions`` conversations going at once, so turns come back within the
replay. And a trace block (512 tokens) becomes one engine page (``page_tokens``, 64 for
the benchmark), so prompts keep their block structure at a length a CPU prefills in
seconds; a session ends when its next prompt would exceed ``max_pages``.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass

import numpy as np

from kvray.sim.workloads import WorkloadSpec, generate
from kvray.traces import MOONCAKE_BLOCK_TOKENS, TraceRequest, full_blocks

SHARED_SHARE = 0.01  # a block id in at least this share of requests (and 3 of them) is a shared (system) prefix


@dataclass(frozen=True)
class TraceShape:
    """The structure :func:`trace_shape` measured, in trace blocks.

    Example::

        shape = trace_shape(read_trace("conversation_trace_first30min.jsonl"))
        shape.mean_turns, shape.document_probability      # about 1.43 and 0.13
    """

    system_prompts: int
    system_prompt_pages: int
    documents: int
    document_pages: int
    document_probability: float
    mean_turns: float
    mean_turn_pages: float
    sessions: int


def trace_shape(trace: list[TraceRequest]) -> TraceShape:
    """Measure the sharing structure of ``trace`` (see the module docstring)."""
    counts = Counter(h for r in trace for h in r.hash_ids)
    popular = {h for h, n in counts.items() if n >= max(3, SHARED_SHARE * len(trace))}

    def system_len(r: TraceRequest) -> int:
        n = 0
        while n < len(r.hash_ids) and r.hash_ids[n] in popular:
            n += 1
        return n

    ends: set[int] = set()  # last block id of every earlier request: a prefix a later turn extends
    first_turns: list[TraceRequest] = []
    turn_pages: list[int] = []
    for r in trace:
        system = system_len(r)
        parent = max((i for i in range(system, len(r.hash_ids) - 1) if r.hash_ids[i] in ends), default=None)
        if parent is None:
            first_turns.append(r)
        else:
            turn_pages.append(len(r.hash_ids) - parent - 1)
        full = full_blocks(r.hash_ids, r.input_length, MOONCAKE_BLOCK_TOKENS)
        if full:  # a partial last block has an id of its own: the next turn extends the full ones
            ends.add(full[-1])
    # documents: prefixes beyond the system prompt that first turns of different sessions share
    after_system = Counter(h for r in first_turns for h in r.hash_ids[system_len(r) :])
    shared_docs = [
        r for r in first_turns if r.hash_ids[system_len(r) : system_len(r) + 1] and after_system[r.hash_ids[system_len(r)]] > 1
    ]
    doc_lengths = []
    doc_ends = set()
    for r in shared_docs:
        start = system_len(r)
        n = start
        while n < len(r.hash_ids) and after_system[r.hash_ids[n]] > 1:
            n += 1
        doc_lengths.append(n - start)
        doc_ends.add(r.hash_ids[n - 1])
    systems = {r.hash_ids[0] for r in trace if r.hash_ids and r.hash_ids[0] in popular}
    return TraceShape(
        system_prompts=max(1, len(systems)),
        system_prompt_pages=int(statistics.median(system_len(r) for r in trace)),
        documents=len(doc_ends),
        document_pages=max(1, int(statistics.median(doc_lengths))) if doc_lengths else 1,
        document_probability=len(shared_docs) / max(1, len(first_turns)),
        mean_turns=len(trace) / max(1, len(first_turns)),
        mean_turn_pages=statistics.mean(turn_pages) if turn_pages else 1.0,
        sessions=len(first_turns),
    )


@dataclass(frozen=True)
class ServeRequest:
    """One request of the served workload: its prompt's token ids and where it sits in time.

    Example::

        first = serve_workload(shape, requests=10, page_tokens=64, max_pages=16, vocab=8192, mean_turns=6.0)[0]
        len(first.tokens), first.blocks
    """

    index: int
    session_start: float  # the generator's timestamp (s): arrival order and spacing before scaling
    tokens: list[int]
    blocks: tuple[int, ...]  # its pages' block ids (prefix-chained, as in the trace)


def block_tokens(block_id: int, page_tokens: int, vocab: int) -> np.ndarray:
    """The token ids behind ``block_id``: the same ids every time (ids 3.. skip special tokens)."""
    return np.random.default_rng([0x5EED, block_id]).integers(3, vocab, page_tokens)


def serve_workload(
    shape: TraceShape,
    requests: int,
    page_tokens: int,
    max_pages: int,
    vocab: int,
    mean_turns: float,
    active_sessions: int = 6,
    seed: int = 0,
) -> list[ServeRequest]:
    """The first ``requests`` requests of sessions shaped like ``shape`` (see the module docstring),
    ``mean_turns`` turns each on average (an agent's loop runs more turns than a chat).

    Page counts are the trace's, capped so that a system prompt plus a document leave room
    for turns in ``max_pages``; documents are as many per session as in the trace; sessions
    start one a second and think ``active_sessions`` seconds on average, so about that
    many are under way at once.
    """
    system = min(shape.system_prompt_pages, max_pages // 4)
    document = min(shape.document_pages, max_pages // 2)
    sessions = max(1, round(requests / mean_turns))
    spec = WorkloadSpec(
        sessions=requests,  # more than enough: each session has at least one turn
        system_prompts=shape.system_prompts,
        system_prompt_pages=system,
        documents=max(1, round(shape.documents * sessions / max(1, shape.sessions))),
        document_pages=max(1, document),
        document_probability=shape.document_probability,
        mean_turns=mean_turns,
        mean_turn_pages=max(1.0, min(shape.mean_turn_pages, max_pages / 4)),
        session_rate_per_s=1.0,
        mean_think_s=float(active_sessions),
        output_tokens=0,
        block_tokens=page_tokens,
    )
    out: list[ServeRequest] = []
    for r in generate(spec, seed=seed):
        if len(r.hash_ids) > max_pages:
            continue  # the session's context is full: it ends
        tokens = np.concatenate([block_tokens(h, page_tokens, vocab) for h in r.hash_ids])[: r.input_length]
        out.append(ServeRequest(len(out), r.timestamp_ms / 1000.0, tokens.tolist(), r.hash_ids))
        if len(out) == requests:
            break
    return out


def reuse_share(workload: list[ServeRequest], page_tokens: int) -> float:
    """Share of full pages that an unbounded shared cache would hit (the workload's reuse ceiling)."""
    seen: set[int] = set()
    hits = total = 0
    for r in workload:
        full = r.blocks[: len(r.tokens) // page_tokens]
        n = 0
        while n < len(full) and full[n] in seen:
            n += 1
        hits, total = hits + n, total + len(full)
        seen.update(full)
    return hits / total if total else 0.0
