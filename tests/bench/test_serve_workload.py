"""The served benchmark's closed-loop workloads: histories that grow turn by turn, documents
asked again, a Mooncake trace's sessions, and the ceilings the figures are shares of."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvray.bench.serve_workload import (
    agent_trajectories,
    conversations,
    kv_pages,
    long_documents,
    page_chains,
    reuse_ceiling,
    trace_sessions,
)
from kvray.core.errors import ConfigError
from kvray.traces import read_trace
from tests.properties import examples

PAGE = 16


@settings(max_examples=examples(25), deadline=None)
@given(
    users=st.integers(1, 6), rounds=st.integers(1, 4), shared=st.integers(0, 3), own=st.integers(0, 3), seed=st.integers(0, 99)
)
def test_each_prompt_is_the_last_one_plus_its_answer_and_a_new_question(users, rounds, shared, own, seed):
    sessions = conversations(users, rounds, PAGE, 512, seed, shared, own, question_tokens=5, answer_tokens=7)
    assert len(sessions) == users
    for s in sessions:
        assert len(s.prompts) == 1 + rounds and s.warmup == 1
        assert len(s.prompts[0]) == (shared + own) * PAGE + 5
        for before, after in zip(s.prompts, s.prompts[1:]):
            assert after[: len(before)] == before and len(after) == len(before) + 7 + 5
    first = [s.prompts[0][: shared * PAGE] for s in sessions]
    assert all(f == first[0] for f in first)  # the shared prefix
    if own and users > 1:  # each user's own context differs
        assert (
            sessions[0].prompts[0][shared * PAGE : (shared + own) * PAGE]
            != sessions[1].prompts[0][shared * PAGE : (shared + own) * PAGE]
        )
    assert conversations(users, rounds, PAGE, 512, seed, shared, own, 5, 7) == sessions  # seeded
    assert all(3 <= t < 512 for s in sessions for p in s.prompts for t in p)


@settings(max_examples=examples(25), deadline=None)
@given(agents=st.integers(1, 5), steps=st.integers(1, 4), before=st.integers(0, 4), seed=st.integers(0, 99))
def test_an_agents_calls_keep_its_whole_trajectory_and_grow_by_one_step(agents, steps, before, seed):
    sessions = agent_trajectories(agents, steps, PAGE, 512, seed, 2, 1, before, action_tokens=4, output_tokens=12, gap_s=0.05)
    assert len(sessions) == agents
    for s in sessions:
        assert len(s.prompts) == 1 + steps and s.warmup == 1 and s.gap_s == 0.05
        assert len(s.prompts[0]) == (2 + 1) * PAGE + before * PAGE  # the trajectory after `before` steps, one call
        for before_, after in zip(s.prompts, s.prompts[1:]):
            assert after[: len(before_)] == before_ and len(after) == len(before_) + PAGE  # an action and its output
    tools = {s.prompts[0][: 2 * PAGE] for s in sessions}
    assert len(tools) == 1  # every agent shares the tool prefix
    if agents > 1:  # and not its task
        assert len({s.prompts[0][2 * PAGE : 3 * PAGE] for s in sessions}) == agents
    # measured calls each compute one step's page at most: the rest is the call before
    hit, total = reuse_ceiling(sessions, PAGE)
    assert total - hit == agents * steps * PAGE


def test_another_seed_shares_no_page():
    a, b = (conversations(3, 2, PAGE, 8192, seed, shared_pages=2, own_pages=2) for seed in (1, 2))
    chains = lambda sessions: {h for s in sessions for p in s.prompts for h in page_chains(p, PAGE)}  # noqa: E731
    assert not chains(a) & chains(b)


def test_long_documents_are_asked_again_and_only_the_documents_are_shared():
    readers = long_documents(documents=3, asks=4, page=PAGE, vocab=8192, seed=0, document_pages=5)
    assert len(readers) == 12 and all(len(r.prompts) == 1 for r in readers)
    by_doc: dict[str, list[tuple[int, ...]]] = {}
    for r in readers:
        by_doc.setdefault(r.name.split("-")[0], []).append(r.prompts[0])
    assert sorted(len(v) for v in by_doc.values()) == [4, 4, 4]
    for prompts in by_doc.values():
        assert len({p[: 5 * PAGE] for p in prompts}) == 1 and len({p[5 * PAGE :] for p in prompts}) == 4
    hit, total = reuse_ceiling(readers, PAGE)
    assert hit == 9 * 5 * PAGE and total == sum(len(r.prompts[0]) for r in readers)  # 3 cold asks, 9 hits


def test_reuse_ceiling_counts_measured_turns_and_kv_pages_counts_distinct_pages():
    sessions = conversations(2, 1, PAGE, 8192, 0, shared_pages=1, own_pages=1, question_tokens=PAGE, answer_tokens=PAGE)
    hit, total = reuse_ceiling(sessions, PAGE)
    # measured turn of each user: shared + own + question + answer pages cached of 5 pages
    assert hit == 2 * 3 * PAGE and total == 2 * 5 * PAGE
    assert kv_pages(sessions, PAGE) == 1 + 2 * (1 + 1 + 2)


def write_trace(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return read_trace(path)


def test_trace_sessions_follow_turns_and_scale_blocks_to_pages(tmp_path):
    """A Mooncake trace: A's second turn extends A's full blocks; B shares only the system block."""
    trace = write_trace(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 0, "input_length": 3 * 512 + 100, "output_length": 5, "hash_ids": [0, 1, 2, 3]},  # A
            {"timestamp": 5, "input_length": 4 * 512, "output_length": 5, "hash_ids": [0, 7, 8, 9]},  # B
            {"timestamp": 9, "input_length": 5 * 512, "output_length": 5, "hash_ids": [0, 1, 2, 4, 5]},  # A, turn 2
        ],
    )
    sessions = trace_sessions(trace, PAGE, 8192, seed=0, max_pages=16)
    assert [len(s.prompts) for s in sessions] == [2, 1]
    a, b = sessions
    assert len(a.prompts[0]) == 3 * PAGE + round(100 * PAGE / 512) and len(a.prompts[1]) == 5 * PAGE
    assert a.prompts[1][: 3 * PAGE] == a.prompts[0][: 3 * PAGE]  # the same blocks, the same tokens
    assert b.prompts[0][:PAGE] == a.prompts[0][:PAGE] and b.prompts[0][PAGE : 2 * PAGE] != a.prompts[0][PAGE : 2 * PAGE]
    assert a.arrivals == (0, 9) and b.arrivals == (5,)  # the trace's timestamps, the driver's pacing order
    capped = trace_sessions(trace, PAGE, 8192, seed=0, max_pages=2)
    assert max(len(p) for s in capped for p in s.prompts) == 2 * PAGE


def test_a_shared_system_prompt_does_not_join_sessions(tmp_path):
    """Block 0 opens every request and is a whole request itself: the requests after it are
    sessions of their own, not turns of that one."""
    rows = [{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [0]}]
    rows += [{"timestamp": i, "input_length": 2 * 512, "output_length": 1, "hash_ids": [0, 10 + i]} for i in range(1, 5)]
    sessions = trace_sessions(write_trace(tmp_path / "t.jsonl", rows), PAGE, 8192, seed=0, max_pages=4)
    assert [len(s.prompts) for s in sessions] == [1, 1, 1, 1, 1]


def test_trace_sessions_of_the_bundled_trace_and_an_empty_one():
    sessions = trace_sessions(read_trace("conversation_trace_first30min.jsonl", limit=300), 64, 8192, 0, 12)
    assert sum(len(s.prompts) for s in sessions) == 300 and any(len(s.prompts) > 1 for s in sessions)
    assert max(len(s.prompts) for s in sessions) < 30  # the system prompt joins no sessions
    with pytest.raises(ConfigError, match="no requests"):
        trace_sessions([], PAGE, 8192, 0, 4)
