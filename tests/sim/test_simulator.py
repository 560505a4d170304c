"""The simulator replays traces through the real cache manager; `kvray sim` prints the
agreed JSON keys, deterministically, and rejects bad input with clear errors."""

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from kvray.cli import app
from kvray.core.errors import ConfigError
from kvray.core.manager import CacheManager
from kvray.policy import make_policy
from kvray.report import ReplayTally
from kvray.resources import shipped_or_given
from kvray.scenario import DEFAULT_SCENARIO, load_scenario
from kvray.sim.simulator import Simulator, fast_capacity
from kvray.traces import TraceRequest, next_uses, read_trace
from tests.conftest import RESULT_KEYS, RUNTIME_KEYS

TRACE = "data/traces/conversation_trace_first30min.jsonl"
runner = CliRunner()


def sim_json(*args: str) -> dict:
    result = runner.invoke(app, ["sim", "--trace", TRACE, "--limit", "300", "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_sim_prints_the_agreed_keys_and_consistent_totals():
    out = sim_json("--policy", "lru", "--capacity-fraction", "0.05", "--warmup-requests", "50")
    assert set(out) >= RESULT_KEYS
    assert out["requests"] == 250 and out["policy"] == "lru" and out["scenario"] == "h100-llama8b"
    assert out["hit_tokens"] == sum(out["hit_tokens_by_tier"].values()) > 0
    assert out["token_hit_rate"] == pytest.approx(out["hit_tokens"] / out["tokens"])
    assert out["bytes_moved"] > 0 and out["p99_ttft_ms"] >= out["mean_ttft_ms"] > 0


def test_replays_are_deterministic():
    assert sim_json("--policy", "arc", "--capacity", "200") == sim_json("--policy", "arc", "--capacity", "200")


def test_simulator_runs_the_real_manager_and_counts_modeled_moves():
    scenario = load_scenario(DEFAULT_SCENARIO)
    requests = read_trace(TRACE, limit=200)
    sim = Simulator(scenario, make_policy("lru"), fast_capacity(scenario, requests, pages=60))
    result = sim.replay(requests)
    assert type(sim.manager) is CacheManager
    moves = sum(sim.manager.metrics.moved_pages.values())
    assert moves > 0 and result.bytes_moved == moves * scenario.layout.page_nbytes
    assert sim.background_ms > 0  # the mover charged modeled time for those moves


def test_ttft_is_load_plus_prefill_plus_queueing():
    scenario = load_scenario(DEFAULT_SCENARIO)
    first = TraceRequest(0.0, 1024, 1, (1, 2))
    again = TraceRequest(1e7, 1300, 1, (1, 2, 3))  # long after: no queueing
    sim = Simulator(scenario, make_policy("lru"))
    hit, ttft = sim.serve(first)
    assert hit == [] and ttft == pytest.approx(sim.cost.prefill_ms(1024))
    hit, ttft = sim.serve(again)
    assert hit == ["device", "device"]
    assert ttft == pytest.approx(2 * sim.cost.load_ms(min(sim.manager.tiers)) + sim.cost.prefill_ms(1300 - 1024))
    busy = Simulator(scenario, make_policy("lru"))
    busy.serve(first)
    _, queued = busy.serve(TraceRequest(0.0, 1024, 1, (7, 8)))
    assert queued == pytest.approx(2 * sim.cost.prefill_ms(1024)) if scenario.compute.servers == 1 else queued > 0


def test_partial_last_block_counts_only_its_tokens():
    tally = ReplayTally(block_tokens=512)
    tally.record(TraceRequest(0.0, 1100, 1, (1, 2, 3)), ["device", "host", "disk"], 1.0)
    assert tally.hit_by_tier == {"device": 512, "host": 512, "disk": 76}


def test_next_uses_sees_the_next_request_with_the_page():
    trace = [TraceRequest(0, 512, 1, (1, 2)), TraceRequest(1, 512, 1, (1, 3)), TraceRequest(2, 512, 1, (1, 2))]
    futures = next_uses(trace)
    assert futures[0].tolist() == [1, 2] and futures[1].tolist() == [2, float("inf")]


def test_capacity_options_are_checked():
    scenario = load_scenario(DEFAULT_SCENARIO)
    requests = read_trace(TRACE, limit=20)
    with pytest.raises(ConfigError, match="not both"):
        fast_capacity(scenario, requests, fraction=0.1, pages=10)
    with pytest.raises(ConfigError, match="positive"):
        fast_capacity(scenario, requests, pages=0)


def test_bad_input_fails_with_a_message_naming_it(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n{oops\n')
    result = runner.invoke(app, ["sim", "--trace", str(bad), "--json"])
    assert result.exit_code == 2 and f"{bad}:2" in result.output
    result = runner.invoke(app, ["sim", "--trace", TRACE, "--limit", "5", "--policy", "mru", "--json"])
    assert result.exit_code == 2 and "unknown policy 'mru'" in result.output
    scenario = tmp_path / "s.yaml"
    scenario.write_text(
        shipped_or_given(DEFAULT_SCENARIO, "simulations", ".yaml").read_text().replace("read_gbps: 7.0", "read_gbps: -7.0")
    )
    result = runner.invoke(app, ["sim", "--trace", TRACE, "--limit", "5", "--scenario", str(scenario), "--json"])
    assert result.exit_code == 2 and "tiers.disk.read_gbps" in result.output
    result = runner.invoke(app, ["sim", "--trace", TRACE, "--limit", "5", "--warmup-requests", "5", "--json"])
    assert result.exit_code == 2 and "--warmup-requests" in result.output


@pytest.mark.parametrize("policy, reference", [("lru", 0.155), ("belady", 0.396)])
def test_single_tier_block_hit_ratio_matches_the_trace_readme(policy, reference):
    """data/traces/README.md: synthetic trace, one cache of 5% of the unique blocks. The
    README counts every block, the partial last one too, so each becomes a full page here."""
    scenario = load_scenario("simulations/reference-single-tier.yaml")
    block = scenario.layout.page_tokens
    requests = [replace(r, input_length=len(r.hash_ids) * block) for r in read_trace("data/traces/synthetic_trace.jsonl")]
    sim = Simulator(scenario, make_policy(policy), fast_capacity(scenario, requests, fraction=0.05))
    sim.replay(requests)
    assert sim.manager.metrics.snapshot()["page_hit_rate"] == pytest.approx(reference, abs=0.01)


def test_runtime_result_adds_only_its_checks_to_the_sim_keys():
    """`kvray run` and `kvray sim` share one result type; only the runtime checks bytes and
    times a real prefill."""
    tally = ReplayTally(block_tokens=512)
    tally.add(1000, {"host": 512}, 2.0)
    modeled = tally.result("lru", "s", bytes_moved=0).as_dict()
    measured = tally.result(
        "lru", "s", bytes_moved=0, wrong_pages=0, lost_nodes=["n1"], prefill_us_per_token_measured=5.5
    ).as_dict()
    assert set(measured) == set(modeled) | RUNTIME_KEYS and measured["wrong_pages"] == 0
    assert measured["prefill_us_per_token_measured"] == 5.5
    assert modeled["hit_tokens"] == 512 and modeled["token_hit_rate"] == 0.512
