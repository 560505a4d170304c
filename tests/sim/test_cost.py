"""Scenarios are validated at the edge with errors naming the field; the cost model and
the prefill queue compute what they say."""

import pytest
import yaml

from kvray.core.errors import ConfigError
from kvray.core.tiers import Tier
from kvray.resources import shipped_or_given
from kvray.scenario import DEFAULT_SCENARIO, PrefillQueue, Scenario, load_scenario
from kvray.sim.cost import CostModel


def write(tmp_path, data) -> str:
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.fixture
def spec() -> dict:
    return yaml.safe_load(open(shipped_or_given(DEFAULT_SCENARIO, "simulations", ".yaml")))


@pytest.mark.parametrize("path", ["simulations/h100-llama8b.yaml", "simulations/h100-llama8b-cluster.yaml"])
def test_shipped_scenarios_load(path):
    assert isinstance(load_scenario(path), Scenario)


def test_negative_bandwidth_names_file_and_field(tmp_path, spec):
    spec["tiers"]["host"]["read_gbps"] = -5
    path = write(tmp_path, spec)
    with pytest.raises(ConfigError, match=rf"{path}.*tiers\.host\.read_gbps"):
        load_scenario(path)


def test_zero_capacity_names_the_field(tmp_path, spec):
    spec["tiers"]["disk"]["capacity_pages"] = 0
    with pytest.raises(ConfigError, match=r"tiers\.disk\.capacity_pages"):
        load_scenario(write(tmp_path, spec))


def test_unknown_tier_and_unknown_key_are_rejected(tmp_path, spec):
    spec["tiers"]["tape"] = spec["tiers"]["disk"]
    with pytest.raises(ConfigError, match="unknown tier.*tape"):
        load_scenario(write(tmp_path, spec))
    del spec["tiers"]["tape"]
    spec["compute"]["gpus"] = 2
    with pytest.raises(ConfigError, match=r"compute\.gpus"):
        load_scenario(write(tmp_path, spec))


def test_load_times_follow_bandwidth_and_latency():
    model = CostModel(load_scenario(DEFAULT_SCENARIO))
    page = 32 * 2 * 512 * 8 * 128 * 2  # Llama-3-8B, bf16, 512 tokens
    assert model.page_nbytes == page
    assert model.load_ms(Tier.HOST) == pytest.approx(0.010 + page / 50e6)
    assert model.load_ms(Tier.DEVICE) < model.load_ms(Tier.HOST) < model.load_ms(Tier.DISK) < model.page_prefill_ms()
    assert model.load_ms(Tier.DISK, pages=3) == pytest.approx(3 * model.load_ms(Tier.DISK))
    assert model.prefill_ms(0) == 0.0
    assert model.prefill_ms(1000) == pytest.approx(5 + 1000 * 0.035)


def test_remote_reads_are_capped_by_the_network():
    model = CostModel(load_scenario("simulations/h100-llama8b-cluster.yaml"))
    assert model.load_ms(Tier.REMOTE) == pytest.approx((10 + 5) / 1e3 + model.page_nbytes / 25e6)


def test_scaling_keeps_tier_ratios():
    scenario = load_scenario(DEFAULT_SCENARIO)
    sized = scenario.scaled(fast_pages=1000)
    assert sized[Tier.DEVICE] + sized[Tier.HOST] == 1000
    assert sized[Tier.DISK] == round(16384 * 1000 / (768 + 8192))


def test_bandwidth_scale_speeds_every_link_and_nothing_else():
    scenario = load_scenario(DEFAULT_SCENARIO)
    base, half = CostModel(scenario), CostModel(scenario.with_bandwidth(0.5))
    for tier in (Tier.HOST, Tier.DISK):
        latency = scenario.tiers[tier.label].latency_us / 1e3
        assert half.load_ms(tier) - latency == pytest.approx(2 * (base.load_ms(tier) - latency))
    assert half.page_prefill_ms() == base.page_prefill_ms()
    assert scenario.with_bandwidth(0.5).capacities() == scenario.capacities()
    cluster = load_scenario("h100-8node-hetero")
    fast = cluster.with_bandwidth(1.5)
    assert fast.name == "h100-8node-hetero@bandwidth-x1.5"
    for node, sped in zip(cluster.node_scenarios(), fast.node_scenarios()):  # overrides and defaults alike
        assert sped.network_gbps == pytest.approx(1.5 * node.network_gbps)
        assert sped.tiers["disk"].write_gbps == pytest.approx(1.5 * node.tiers["disk"].write_gbps)
    with pytest.raises(ValueError, match="bandwidth scale must be positive"):
        scenario.with_bandwidth(0.0)


def test_prefill_queue_waits_while_engines_are_busy():
    queue = PrefillQueue(servers=2)
    assert queue.serve(0, 10) == 0
    assert queue.serve(0, 10) == 0  # the second engine
    assert queue.serve(5, 10) == 5  # both busy until 10
    assert queue.backlog_ms(6) == 4
