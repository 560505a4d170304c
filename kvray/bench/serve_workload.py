"""The served benchmark's workloads: closed-loop sessions of real token ids.

A :class:`Session` is one user (or agent, or reader): its prompts in order, each the whole
prompt the engine sees, and the think gap between an answer and the next prompt. The
driver (:mod:`kvray.bench.serve_loop`) sends a session's next prompt only after its
previous answer, so a follow-up never races the turn it follows, as LMCache's multi-round
QA, SGLang's HiCache bench and a real chat client behave. Prompts are precomputed: an
answer appended to the history is ``answer_tokens`` drawn ids (the engine itself decodes a
few tokens; the benchmark is about prefill), so every contender sees the same prompts.

Families (the anchors' workloads, sized in pages of ``page`` tokens):

- :func:`conversations`: multi-round QA (a shared system prompt, a per-user context, each
  question and answer appended to the history, a think gap);
- :func:`agent_trajectories`: the agentic loop (a shared tool prefix, a task, then steps
  that each append the agent's action and the tool's output to the whole trajectory, short
  gaps), measured from the middle of each trajectory on;
- :func:`long_documents`: ``documents`` documents, each asked ``asks`` times in random
  order by one-request readers (LMCache's long-document QA);
- :func:`trace_sessions`: a Mooncake JSONL trace (prefix-chained ``hash_ids``): a request
  whose blocks extend an earlier request's full blocks is that request's next turn; one
  trace block becomes one page (its id's tokens, :func:`block_tokens`).

Every token id is drawn from a generator seeded by the workload's ``seed`` and the
segment's role, so two runs with the same seed see the same tokens and two sweep points
with different seeds share nothing in any cache.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from kvray.core.errors import ConfigError
from kvray.traces import MOONCAKE_BLOCK_TOKENS, TraceRequest, full_blocks

FIRST_ID = 3  # token ids below this are special tokens in the model configs
SHARED_SHARE = 0.01  # a trace block in this share of requests (and 3 of them) is a shared system prompt
TRACE_ENV = "KVRAY_SERVE_TRACE"  # `kvray bench --only serve --trace PATH` names the trace here
WORKLOADS_ENV = "KVRAY_SERVE_WORKLOADS"  # `kvray bench --only serve --workload NAME`: the parts to run, comma-separated


@dataclass(frozen=True)
class Session:
    """One closed-loop client: ``prompts`` in order, ``gap_s`` after each answer; its first
    ``warmup`` prompts fill caches and are not measured; ``arrivals``, where given, each
    prompt's place in the workload's own arrival order (a trace's timestamps), which the
    driver then paces the workload by instead of pacing each session on its own.

    Example::

        users = conversations(users=4, rounds=3, page=64, vocab=8192, seed=0, shared_pages=2, own_pages=4)
        users[0].prompts[1][: len(users[0].prompts[0])] == users[0].prompts[0]   # the history grows
    """

    name: str
    prompts: tuple[tuple[int, ...], ...]
    gap_s: float
    warmup: int = 0
    arrivals: tuple[float, ...] = ()


def draw(vocab: int, n: int, *seed: int) -> tuple[int, ...]:
    """``n`` token ids, the same for the same ``seed``."""
    return tuple(np.random.default_rng([0x5EED, *seed]).integers(FIRST_ID, vocab, n).tolist())


def conversations(
    users: int,
    rounds: int,
    page: int,
    vocab: int,
    seed: int,
    shared_pages: int,
    own_pages: int,
    question_tokens: int = 32,
    answer_tokens: int = 32,
    gap_s: float = 0.0,
    warmup: int = 1,
) -> list[Session]:
    """``users`` sessions of ``warmup + rounds`` prompts: a prefix every user shares
    (``shared_pages``: a system prompt, or an agent's tool descriptions), the user's own
    context (``own_pages``), then question after question, each answer appended before the
    next question. The first ``warmup`` prompts (the context with its first question) are
    the warm-up phase."""
    shared = draw(vocab, shared_pages * page, seed, 0)
    sessions = []
    for user in range(users):
        history = shared + draw(vocab, own_pages * page, seed, 1, user)
        prompts = []
        for turn in range(warmup + rounds):
            history += draw(vocab, question_tokens, seed, 2, user, turn)
            prompts.append(history)
            history += draw(vocab, answer_tokens, seed, 3, user, turn)
        sessions.append(Session(f"user{user}", tuple(prompts), gap_s, warmup))
    return sessions


def agent_trajectories(
    agents: int,
    steps: int,
    page: int,
    vocab: int,
    seed: int,
    tool_pages: int,
    task_pages: int,
    steps_before: int,
    action_tokens: int,
    output_tokens: int,
    gap_s: float,
) -> list[Session]:
    """``agents`` sessions of an agent loop: every call sees the tool descriptions all agents
    share (``tool_pages``), the agent's task (``task_pages``) and its whole trajectory so far,
    each step's action (``action_tokens``, the model's tool call) and the tool's output
    (``output_tokens``) appended, as a ReAct-style agent keeps them. The warm-up prompt is
    the trajectory after ``steps_before`` steps, sent as one call (the agents were mid-task
    when the measurement began); the ``steps`` calls after it are measured. So each
    measured call's new tokens are one step's, against a context of the whole trajectory,
    as in the later steps of a long agent run, which are most of its steps.

    Example::

        agents = agent_trajectories(3, 2, 64, 8192, 0, 2, 2, 4, action_tokens=16, output_tokens=48, gap_s=0.05)
        [len(p) // 64 for p in agents[0].prompts]   # [8, 9, 10]: whole pages when a step is a page
    """
    tools = draw(vocab, tool_pages * page, seed, 10)
    sessions = []
    for agent in range(agents):
        history = tools + draw(vocab, task_pages * page, seed, 11, agent)
        prompts = []
        for step in range(steps_before + steps + 1):
            if step:
                history += draw(vocab, action_tokens, seed, 12, agent, step) + draw(vocab, output_tokens, seed, 13, agent, step)
            if step >= steps_before:
                prompts.append(history)
        sessions.append(Session(f"agent{agent}", tuple(prompts), gap_s, warmup=1))
    return sessions


def long_documents(
    documents: int, asks: int, page: int, vocab: int, seed: int, document_pages: int, question_tokens: int = 32
) -> list[Session]:
    """``documents x asks`` one-prompt readers (a document and a question of its own), in a
    random order in which every document's first ask comes before its others are drawn."""
    texts = [draw(vocab, document_pages * page, seed, 4, d) for d in range(documents)]
    order = np.random.default_rng([seed, 5]).permutation(np.repeat(np.arange(documents), asks)).tolist()
    readers = []
    for i, d in enumerate(order):
        readers.append(Session(f"doc{d}-ask{i}", (texts[d] + draw(vocab, question_tokens, seed, 6, i),), 0.0))
    return readers


def block_tokens(block_id: int, page: int, vocab: int, seed: int) -> tuple[int, ...]:
    """The token ids behind a trace's ``block_id``: equal ids, equal tokens (within a seed)."""
    return draw(vocab, page, seed, 7, block_id)


def trace_sessions(trace: list[TraceRequest], page: int, vocab: int, seed: int, max_pages: int) -> list[Session]:
    """Closed-loop sessions of a Mooncake trace (see the module docstring). A request's
    length scales with its blocks (``input_length x page / 512``); one longer than
    ``max_pages`` pages is cut there (the engines' context). Sessions keep the trace's order
    of first turns; a request that extends no earlier request's full blocks beyond the
    blocks most requests share (a system prompt: in ``SHARED_SHARE`` of the requests and
    at least 3) starts one. Each prompt's arrival is its request's timestamp."""
    if not trace:
        raise ConfigError("the trace has no requests")
    counts = Counter(h for r in trace for h in r.hash_ids)
    shared = {h for h, n in counts.items() if n >= max(3, SHARED_SHARE * len(trace))}  # system prompts
    session_of_end: dict[int, int] = {}  # last full block of a request -> its session
    turns: list[list[TraceRequest]] = []
    for r in trace:
        own = next((i for i, h in enumerate(r.hash_ids) if h not in shared), len(r.hash_ids))
        parent = next((session_of_end[h] for h in reversed(r.hash_ids[own:-1]) if h in session_of_end), None)
        if parent is None:
            parent = len(turns)
            turns.append([])
        turns[parent].append(r)
        full = full_blocks(r.hash_ids, r.input_length, MOONCAKE_BLOCK_TOKENS)
        if full:
            session_of_end[full[-1]] = parent
    sessions = []
    for s, requests in enumerate(turns):
        prompts = []
        for r in requests:
            length = min(max_pages * page, max(1, round(r.input_length * page / MOONCAKE_BLOCK_TOKENS)))
            tokens = [t for h in r.hash_ids[: -(-length // page)] for t in block_tokens(h, page, vocab, seed)]
            prompts.append(tuple(tokens[:length]))
        sessions.append(Session(f"trace-session{s}", tuple(prompts), 0.0, arrivals=tuple(r.timestamp_ms for r in requests)))
    return sessions


def page_chains(prompt: tuple[int, ...], page: int) -> list[int]:
    """A hash per full page of ``prompt`` that names the page and everything before it."""
    chain, prev = [], 0
    for start in range(0, len(prompt) - len(prompt) % page, page):
        prev = hash((prev, prompt[start : start + page]))
        chain.append(prev)
    return chain


def reuse_ceiling(sessions: list[Session], page: int) -> tuple[int, int]:
    """(prompt tokens an unbounded shared cache would not compute, measured prompt tokens),
    counting measured prompts only, each session's in order, sessions interleaved round by
    round (the order a closed loop sends them in, near enough): the ceiling a contender's
    hit tokens are shares of."""
    seen: set[int] = set()
    hit = total = 0
    for turn in range(max(len(s.prompts) for s in sessions)):
        for s in sessions:
            if turn >= len(s.prompts):
                continue
            chain = page_chains(s.prompts[turn], page)
            n = 0
            while n < len(chain) and chain[n] in seen:
                n += 1
            if turn >= s.warmup:
                hit, total = hit + n * page, total + len(s.prompts[turn])
            seen.update(chain)
    return hit, total


def kv_pages(sessions: list[Session], page: int) -> int:
    """Distinct full pages over all prompts: the KV the sessions hold in all (what must
    exceed vLLM's own cache and kvray's host tier for the workload to test them)."""
    return len({h for s in sessions for p in s.prompts for h in page_chains(p, page)})
