"""Bad input to ``kvray run`` ends with one clear line naming the file (and line), before
any Ray process starts; so does Ray failing to start (and ``kvray bench`` then runs what
does not need Ray); an address no Ray cluster answers at ends ``kvray status``, ``up`` and
``down`` with one line within seconds."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvray.cli import app
from kvray.cluster.runtime import CONNECT_TIMEOUT_S
from tests.cluster.test_launcher import free_port

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "data" / "traces" / "conversation_trace_first30min.jsonl"


def run(*args: str):
    return CliRunner().invoke(app, ["run", *args, "--json"])


def message(result) -> str:
    return " ".join(result.output.split())  # rich wraps long lines


def test_unknown_trace_format_names_the_file(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text("a,b\n")
    result = run("--trace", str(path))
    assert result.exit_code == 2
    assert f"{path}: unknown trace format '.csv'" in message(result)


def test_malformed_line_names_file_and_line(tmp_path):
    path = tmp_path / "trace.jsonl"
    good = TRACE.read_text().splitlines()[:2]
    path.write_text("\n".join([*good, '{"timestamp": 5, "input_length": "many"}']) + "\n")
    result = run("--trace", str(path))
    assert result.exit_code == 2
    assert f"{path}:3: missing field(s) output_length, hash_ids" in message(result)


@pytest.mark.parametrize(
    ("yaml_text", "expected"),
    [
        ("runtime:\n  tiers: {host: 100000000}\n", "exceeds this machine's memory"),
        ("runtime:\n  tiers: {host: 0}\n", "every tier has 0 pages"),
        ("runtime:\n  tiers: {host: 8, disk: 64}\n", "tiers.disk > 0 needs disk_root"),
        ("runtime:\n  layout: {layers: 2, kv_heads: 2, head_dim: 16, page_tokens: 256}\n", "page_tokens must be 512"),
        ("nodes: 0\n", "nodes: Input should be greater than or equal to 1"),
    ],
)
def test_impossible_scenarios_name_the_file_and_field(tmp_path, yaml_text, expected):
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text(yaml_text)
    result = run("--trace", str(TRACE), "--scenario", str(scenario))
    assert result.exit_code == 2
    assert str(scenario) in message(result) and expected in message(result)


def test_unknown_policy_lists_the_known_ones():
    result = run("--trace", str(TRACE), "--policy", "mru")
    assert result.exit_code == 2 and "unknown policy 'mru'; known:" in message(result)


def test_an_empty_trace_is_refused_before_ray_starts(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    started = time.monotonic()
    result = run("--trace", str(path))
    assert result.exit_code == 2 and message(result) == f"kvray: {path}: the trace holds no requests"
    assert time.monotonic() - started < 5  # no Ray was started on the way


@pytest.mark.parametrize("command", ["status", "up", "down"])
def test_an_address_nobody_answers_at_is_one_line_within_seconds(command):
    """A closed loopback port: Ray itself would retry it for about a minute."""
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    result = CliRunner().invoke(app, [command, "--address", address])
    assert time.monotonic() - started < CONNECT_TIMEOUT_S + 5
    assert result.exit_code == 2
    assert len(result.stderr.strip().splitlines()) == 1 and f"no Ray cluster answers at {address}" in message(result)


def test_an_address_that_is_not_one_says_what_is_expected():
    result = CliRunner().invoke(app, ["status", "--address", "localhost"])
    assert result.exit_code == 2 and "'localhost' is not a Ray address: expected HOST:PORT" in message(result)


def ray_that_does_not_start(monkeypatch) -> None:
    """``ray.init`` failing as it does when Ray's GCS is not up in time on a loaded machine."""
    import ray

    def init(*args, **kwargs):
        raise RuntimeError("Timed out waiting for file /tmp/ray/session_x/gcs_server_port_ffff\nmore detail")

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def test_kvray_run_says_in_one_line_that_ray_did_not_start(monkeypatch):
    ray_that_does_not_start(monkeypatch)
    result = run("--trace", str(TRACE), "--limit", "1")
    assert result.exit_code == 2
    assert "kvray: Ray did not start: Timed out waiting for file" in message(result)
    assert "Traceback" not in result.output


def test_kvray_bench_skips_what_needs_ray_and_runs_the_rest(monkeypatch, capsys):
    from kvray.bench import run_benchmarks
    from kvray.bench.runtime import _Bench

    ray_that_does_not_start(monkeypatch)
    monkeypatch.setattr(_Bench, "_failure", None)
    results = run_benchmarks(only=["controller_"], quick=True, progress=False)
    assert [r.name for r in results] == [  # in-process: no Ray needed
        "controller_memory_per_page_vs_dict",
        "controller_memory_per_page_vs_dict[64 nodes,100000 pages]",
    ]
    assert "kvray bench: controller_lookup_vs_empty_call skipped: Ray did not start:" in capsys.readouterr().err
