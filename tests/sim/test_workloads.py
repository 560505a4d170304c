"""Generated workloads: seeded, prefix-chained like real traces, and shaped as asked."""

import numpy as np
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


def test_every_family_and_held_out_configuration_is_seeded_and_distinct():
    from kvray.sim.workloads import FAMILIES, HELD_OUT, named_workload

    assert not set(FAMILIES) & set(HELD_OUT)
    heads = set()
    for name in [*FAMILIES, *HELD_OUT]:
        spec = named_workload(name)
        if isinstance(spec, WorkloadSpec):
            spec = spec.model_copy(update={"sessions": min(spec.sessions, 60)})
        trace = generate(spec, seed=5)
        assert trace == generate(spec, seed=5) and len(trace) > 50
        assert all(a.timestamp_ms <= b.timestamp_ms for a, b in zip(trace, trace[1:]))
        heads.add(tuple(trace))
    assert len(heads) == len(FAMILIES) + len(HELD_OUT)  # every configuration shapes its own workload
    with pytest.raises(ConfigError, match="unknown workload family 'nope'; known: chat"):
        named_workload("nope")


def test_bursts_concentrate_session_starts():
    spec = WorkloadSpec(sessions=400, mean_turns=1, burst_factor=10, burst_every_s=50, burst_share=0.2)
    starts = [r.timestamp_ms / 1000 for r in generate(spec, seed=2)]
    in_burst = sum((t % 50) < 10 for t in starts) / len(starts)
    assert in_burst > 0.55  # 10x the rate for 20% of the time: ~70% of starts, 20% without bursts
    flat = [r.timestamp_ms / 1000 for r in generate(spec.model_copy(update={"burst_factor": 1.0}), seed=2)]
    assert sum((t % 50) < 10 for t in flat) / len(flat) < 0.3


def test_document_skew_makes_a_few_documents_popular():
    def top_share(skew: float) -> float:
        spec = WorkloadSpec(
            sessions=600, mean_turns=1, system_prompt_pages=1, documents=100, document_probability=1.0, document_skew=skew
        )
        firsts = [r.hash_ids[1] for r in generate(spec, seed=4)]  # the document's first page follows the prompt
        counts = sorted((firsts.count(f) for f in set(firsts)), reverse=True)
        return sum(counts[:5]) / len(firsts)

    assert top_share(1.2) > 3 * top_share(0.0)


def test_phases_alternate_in_time():
    from kvray.sim.workloads import PhasedWorkload

    docs = WorkloadSpec(sessions=50, documents=5, document_probability=1.0, mean_turns=1, system_prompts=1)
    chat = WorkloadSpec(sessions=50, documents=0, mean_turns=1, system_prompts=1)
    trace = generate(PhasedWorkload(phases=(docs, chat), rounds=2), seed=1)
    long = [len(r.hash_ids) > 16 for r in trace]  # document requests carry 16 document pages
    quarters = [np.mean(long[i * len(long) // 4 : (i + 1) * len(long) // 4]) for i in range(4)]
    assert quarters[0] > 0.8 and quarters[1] < 0.2 and quarters[2] > 0.8 and quarters[3] < 0.2
    assert trace[0].hash_ids[0] == trace[-1].hash_ids[0]  # phases share the system prompt's pages


def test_kvray_generate_writes_a_family_as_a_trace(tmp_path):
    from typer.testing import CliRunner

    from kvray.cli import app

    out = tmp_path / "agent.jsonl"
    result = CliRunner().invoke(app, ["generate", "--family", "agent", "--sessions", "20", "--seed", "3", "--out", str(out)])
    assert result.exit_code == 0, result.output
    from kvray.sim.workloads import FAMILIES

    assert read_trace(out) == generate(FAMILIES["agent"].model_copy(update={"sessions": 20}), seed=3)
    bad = CliRunner().invoke(app, ["generate", "--family", "phase", "--sessions", "5", "--out", str(out)])
    assert bad.exit_code != 0 and "--sessions does not apply" in bad.output
