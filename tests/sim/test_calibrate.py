"""`kvray calibrate` measures this machine and writes a scenario the simulator accepts."""

import json

from typer.testing import CliRunner

from kvray.cli import app
from kvray.core.tiers import Tier
from kvray.scenario import load_scenario
from kvray.sim.cost import CostModel


def test_calibrate_writes_a_valid_measured_scenario(tmp_path):
    out = tmp_path / "here.yaml"
    result = CliRunner().invoke(
        app, ["calibrate", "--out", str(out), "--disk-dir", str(tmp_path), "--repeats", "1", "--size-mib", "8"]
    )
    assert result.exit_code == 0, result.output
    scenario = load_scenario(out)
    printed = json.loads(result.stdout)
    assert printed["compute"] == scenario.compute.model_dump()
    assert scenario.compute.prefill_us_per_token > 0 and scenario.network_gbps > 0
    assert all(t.read_gbps > 0 and t.write_gbps > 0 for t in scenario.tiers.values())
    assert "measured by kvray calibrate" in out.read_text()
    model = CostModel(scenario)
    assert model.load_ms(Tier.DISK) > 0 and model.page_prefill_ms() > 0
