"""--load U: a trace's arrival gaps scaled until LRU keeps the prefill engines busy U of the
time, the engines' busy share measured by the replay itself, and U refused at the edge
unless it is a share strictly between 0 and 1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvray.cli import app
from kvray.core.errors import ConfigError
from kvray.scenario import DEFAULT_SCENARIO, PrefillQueue, load_scenario
from kvray.sim.cluster import ClusterSimulator
from kvray.sim.load import TOLERANCE, find_load, lru_utilisation, scaled
from kvray.sim.node import node_capacities
from kvray.sim.workloads import WorkloadSpec, generate
from kvray.traces import TraceRequest, write_trace

SCENARIO = load_scenario(DEFAULT_SCENARIO)
TRACE = generate(WorkloadSpec(sessions=40), seed=3)
ROOT = Path(__file__).resolve().parents[2]


def test_the_queue_counts_each_engines_busy_time():
    queue = PrefillQueue(servers=2)
    queue.serve(0, 10)
    queue.serve(0, 10)  # the second engine
    assert queue.serve(5, 10) == 5 and queue.busy_ms == 30  # waiting is not busy time
    engine, start = queue.start(100)
    queue.finish(engine, start, 130)  # loads and prefill: the engine is held throughout
    assert queue.busy_ms == 60


def test_a_replay_reports_the_engines_busy_share():
    engines = SCENARIO.compute.servers
    one = [TraceRequest(0.0, 4096, 1, (1, 2, 3, 4, 5, 6, 7, 8))]
    result = ClusterSimulator(SCENARIO, "lru").replay(one)
    (share,) = result.extra["prefill_utilisation"].values()
    assert share == pytest.approx(1 / engines)  # one engine, busy from arrival to first token
    apart = one + [TraceRequest(10 * result.mean_ttft_ms, 4096, 1, (11, 12, 13, 14, 15, 16, 17, 18))]
    (share,) = ClusterSimulator(SCENARIO, "lru").replay(apart).extra["prefill_utilisation"].values()
    assert share * engines == pytest.approx(2 / 11, rel=0.05)  # two prefills of about the same time over eleven of them


def test_a_cluster_reports_each_nodes_busy_share():
    four = load_scenario("h100-4node-skewed")
    result = ClusterSimulator(four, "lru", None, node_capacities(four, TRACE, 0.05)).replay(TRACE)
    shares = result.extra["prefill_utilisation"]
    assert len(shares) == 4 and all(0 <= s <= 1 for s in shares.values())
    assert len(set(shares.values())) > 1  # the skewed front end loads its nodes unevenly


def test_scaling_multiplies_the_gaps_and_keeps_the_requests():
    twice = scaled(TRACE, 2.0)
    first = TRACE[0].timestamp_ms
    assert [r.timestamp_ms - first for r in twice] == pytest.approx([2 * (r.timestamp_ms - first) for r in TRACE])
    assert [(r.input_length, r.hash_ids) for r in twice] == [(r.input_length, r.hash_ids) for r in TRACE]


@pytest.mark.parametrize("target", [0.3, 0.6, 0.85])
def test_bisection_reaches_the_target_busy_share(target):
    capacities = node_capacities(SCENARIO, TRACE, 0.05)
    load = find_load(TRACE, SCENARIO, target, capacities)
    assert abs(load.utilisation - target) <= TOLERANCE
    assert lru_utilisation(load.trace, SCENARIO, capacities) == load.utilisation  # what an LRU replay of it measures
    assert load.trace == scaled(TRACE, load.factor) and load.replays <= 8
    assert load.as_dict() == {
        "target": target,
        "arrival_scale": load.factor,
        "lru_prefill_utilisation": load.utilisation,
        "lru_replays": load.replays,
    }


def test_a_busier_target_packs_the_arrivals_closer():
    capacities = node_capacities(SCENARIO, TRACE, 0.05)
    assert find_load(TRACE, SCENARIO, 0.85, capacities).factor < find_load(TRACE, SCENARIO, 0.3, capacities).factor


def test_find_load_refuses_what_it_cannot_scale():
    capacities = node_capacities(SCENARIO, TRACE, 0.05)
    for bad in (0.0, 1.0, -0.2, 1.5):
        with pytest.raises(ConfigError, match="busy share in \\(0, 1\\)"):
            find_load(TRACE, SCENARIO, bad, capacities)
    with pytest.raises(ConfigError, match="two different times"):
        find_load(TRACE[:1], SCENARIO, 0.5, capacities)
    with pytest.raises(ConfigError, match="not reached in 24 LRU replays: the closest was 0.200"):
        find_load(TRACE, SCENARIO, 0.5, capacities, utilisation=lambda trace: 0.2)  # a share no scaling moves


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("load") / "small.jsonl"
    write_trace(TRACE[:150], path)
    return path


@pytest.mark.parametrize(
    "command",
    [
        ["sim", "--trace", "{trace}"],
        ["eval", "--trace", "{trace}", "--policy", "lru", "--out", "{out}"],
        [
            "cluster-eval",
            "--scenario",
            str(ROOT / "simulations" / "h100-4node-skewed.yaml"),
            "--trace",
            "{trace}",
            "--out",
            "{out}",
        ],
    ],
    ids=["sim", "eval", "cluster-eval"],
)
@pytest.mark.parametrize("bad", ["0", "1", "-0.5", "1.2"])
def test_a_load_outside_0_1_is_refused_naming_the_flag(command, bad, small_trace, tmp_path):
    args = [a.format(trace=small_trace, out=tmp_path / "out") for a in command]
    result = invoke(*args, "--load", bad)
    assert result.exit_code == 2
    assert "--load" in result.output and "must be in (0, 1)" in " ".join(result.output.split())
    assert not (tmp_path / "out").exists()


def test_cluster_eval_scales_each_trace_to_the_busiest_nodes_load(small_trace, tmp_path):
    scenario = ROOT / "simulations" / "h100-4node-skewed.yaml"
    result = invoke(
        "cluster-eval", "--scenario", str(scenario), "--trace", str(small_trace), "--load", "0.7", "--out", str(tmp_path)
    )
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "cluster.json").read_text())["rows"]
    load = rows[0]["load"]
    assert all(r["load"] == load for r in rows) and abs(load["lru_prefill_utilisation"] - 0.7) <= TOLERANCE
    assert f"capacity 0.05, load 0.7: arrival gaps x{load['arrival_scale']:.4g})" in (tmp_path / "cluster.md").read_text()
    assert f"h100-4node-skewed / small: load 0.7: arrival gaps x{load['arrival_scale']:.4g}" in result.stderr


def test_sim_prints_the_factor_and_records_it_in_its_json(small_trace):
    result = invoke("sim", "--trace", str(small_trace), "--capacity-fraction", "0.05", "--load", "0.7", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    load = out["load"]
    assert load["target"] == 0.7 and abs(load["lru_prefill_utilisation"] - 0.7) <= TOLERANCE
    assert f"arrival gaps x{load['arrival_scale']:.4g}" in result.stderr
    assert f"busy {load['lru_prefill_utilisation']:.3f} of the time" in result.stderr
    lru = invoke("sim", "--trace", str(small_trace), "--capacity-fraction", "0.05", "--load", "0.7", "--json", "--policy", "lru")
    (share,) = json.loads(lru.stdout)["prefill_utilisation"].values()
    assert share == load["lru_prefill_utilisation"]  # the LRU replay it found


def test_eval_scales_each_cell_and_every_policy_replays_the_same_trace(small_trace, tmp_path):
    out = tmp_path / "out"
    result = invoke(
        "eval", "--trace", str(small_trace), "--policy", "lru", "--policy", "sieve", "--capacity-fraction", "0.05",
        "--capacity-fraction", "0.25", "--load", "0.6", "--out", str(out),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads((out / "eval.json").read_text())
    loads = report["goals"]["load"]
    assert set(loads) == {"small@0.05", "small@0.25"}
    for row in report["rows"]:
        assert row["load"] == loads[f"small@{row['capacity_fraction']:g}"]
        if row["policy"] == "lru":
            assert abs(row["prefill_utilisation"]["h100-llama8b"] - 0.6) <= TOLERANCE
    assert all(f"{cell}: load 0.6: arrival gaps x" in result.stderr for cell in loads)
