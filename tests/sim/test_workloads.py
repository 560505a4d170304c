"""Generated workloads: seeded, prefix-chained like real traces, and shaped as asked."""

import pytest

from kvray.core.config import validate
from kvray.core.errors import ConfigError
from kvray.sim.workloads import WorkloadSpec, generate
from kvray.traces import read_trace, write_parquet


def test_same_seed_same_trace_and_parquet_round_trip(tmp_path):
    spec = WorkloadSpec(sessions=40)
    trace = generate(spec, seed=3)
    assert trace == generate(spec, seed=3) and trace != generate(spec, seed=4)
    write_parquet(trace, tmp_path / "w.parquet")
    assert read_trace(tmp_path / "w.parquet") == trace


def test_ids_are_prefix_chained_and_turns_extend_their_session():
    trace = generate(WorkloadSpec(sessions=60, mean_turns=3), seed=1)
    parent_of: dict[int, int] = {}
    for request in trace:
        assert all(t.timestamp_ms <= u.timestamp_ms for t, u in zip(trace, trace[1:]))
        assert (len(request.hash_ids) - 1) * 512 < request.input_length <= len(request.hash_ids) * 512
        for parent, child in zip((-1,) + request.hash_ids, request.hash_ids):
            assert parent_of.setdefault(child, parent) == parent  # one parent per id: a chain
    shared_roots = {r.hash_ids[0] for r in trace}
    assert len(shared_roots) <= 4  # every session starts with one of the shared system prompts


def test_bad_spec_names_the_field():
    with pytest.raises(ConfigError, match="document_probability"):
        validate(WorkloadSpec, {"document_probability": 2})
