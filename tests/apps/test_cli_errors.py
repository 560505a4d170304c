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
        "controller_shard_spread[conversation trace,4 shards, busiest vs even share]",
    ]
    assert "kvray bench: controller_lookup_vs_empty_call skipped: Ray did not start:" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("command", "refusal"),
    [
        (["run", "--trace", str(TRACE), "--nodes", "0"], "'--nodes': must be in [1, 16], got 0"),
        (["run", "--trace", str(TRACE), "--nodes", "17"], "'--nodes': must be in [1, 16], got 17"),
        (["run", "--trace", str(TRACE), "--limit", "-3"], "'--limit': must be >= 1, got -3"),
        (["run", "--trace", str(TRACE), "--host-pages", "-1"], "'--host-pages': must be >= 0, got -1"),
        (["run", "--trace", str(TRACE), "--capacity", "0"], "'--capacity': must be >= 1, got 0"),
        (["run", "--trace", str(TRACE), "--prefill-us-per-token", "-1"], "'--prefill-us-per-token': must be >= 0, got -1"),
        (["up", "--controller-shards", "0"], "'--controller-shards': must be in [1, 256], got 0"),
        (["up", "--disk-pages", "-2"], "'--disk-pages': must be >= 0, got -2"),
        (["demo", "--requests", "0"], "'--requests': must be >= 1, got 0"),
        (["demo", "--nodes", "1"], "'--nodes': must be in [2, 16], got 1"),
        (["train-reuse", "--ensemble", "0"], "'--ensemble': must be in [1, 16], got 0"),
        (["train-reuse", "--ensemble", "17"], "'--ensemble': must be in [1, 16], got 17"),
    ],
    ids=lambda v: " ".join([v[0], *v[-2:]]) if isinstance(v, list) else None,
)
def test_a_count_out_of_range_names_the_flag_not_a_settings_model(command, refusal):
    """Refused as parsed (exit 2, no Ray started), where `--nodes 0` used to read
    `invalid ReplaySettings: nodes: ...`."""
    started = time.monotonic()
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 2
    assert f"Invalid value for {refusal}" in result.output and "ReplaySettings" not in result.output
    assert time.monotonic() - started < 5


@pytest.mark.parametrize(
    ("command", "refusal"),
    [
        (["run", "--trace", str(TRACE), "--disk-pages", "10"], "--disk-pages > 0 needs --disk-root"),
        (["up", "--disk-pages", "10"], "--disk-pages > 0 needs --disk-root"),
        (["run", "--trace", str(TRACE), "--policy", "nosuch"], "unknown policy 'nosuch'"),
        (
            ["run", "--trace", str(TRACE), "--nodes", "1", "--cluster-policy", "cost-router"],
            "--cluster-policy cost-router: this replay starts one node",
        ),
        (["train-reuse", "--cluster", "--ensemble", "2"], "--ensemble trains one-node models; --cluster trains one model"),
    ],
    ids=["run disk-pages", "up disk-pages", "run policy", "run cluster-policy on one node", "train-reuse cluster ensemble"],
)
def test_settings_that_fail_together_name_the_flags_not_a_settings_model(command, refusal):
    """Errors found when the flags are validated together (no Ray started) name the flags typed,
    where they used to read `invalid ReplaySettings: runtime: Value error, tiers.disk > 0 needs disk_root`."""
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 2, result.output
    text = message(result)
    assert f"command-line options: {refusal}" in text or text.startswith(f"kvray: {refusal}")
    assert "ReplaySettings" not in text and "RuntimeConfig" not in text and "Value error" not in text


def test_the_flags_ranges_are_the_settings_ranges():
    """The command line checks --nodes and --controller-shards against the same bounds the
    settings models hold for a scenario file."""
    from annotated_types import Le

    from kvray.apps.replay import ReplaySettings
    from kvray.cli import MAX_CONTROLLER_SHARDS, MAX_NODES
    from kvray.cluster.config import RuntimeConfig

    def most(model, field: str) -> int:
        return next(m.le for m in model.model_fields[field].metadata if isinstance(m, Le))

    assert (most(ReplaySettings, "nodes"), most(RuntimeConfig, "controller_shards")) == (MAX_NODES, MAX_CONTROLLER_SHARDS)


def test_kvray_bench_help_lists_what_only_takes_and_refuses_what_matches_nothing():
    from kvray.bench import NAMES

    help_text = CliRunner().invoke(app, ["bench", "--help"]).output
    assert all(name in help_text.split() or f"{name}," in help_text.split() for name in NAMES)
    refused = CliRunner().invoke(app, ["bench", "--only", "no_such_bench"])
    assert refused.exit_code == 2 and "--only 'no_such_bench' matches no benchmark; names: host_tier_vs_memcpy" in message(
        refused
    )


def test_kvray_bench_trace_is_for_the_serve_benchmark_and_must_be_a_trace(tmp_path):
    """``--trace`` is refused without ``--only serve`` and for a file that is not a trace,
    before any engine starts."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}\n')
    alone = CliRunner().invoke(app, ["bench", "--only", "hf_ttft", "--trace", str(trace)])
    assert alone.exit_code == 2 and "--trace is for the serve benchmark: add --only serve" in message(alone)
    broken = tmp_path / "broken.jsonl"
    broken.write_text("not json\n")
    bad = CliRunner().invoke(app, ["bench", "--only", "serve", "--trace", str(broken)])
    assert bad.exit_code == 2 and "broken.jsonl:1: not valid JSON" in message(bad)


def test_the_listed_benchmarks_are_the_registered_ones():
    """kvray.bench.BENCHMARKS (what --help lists without importing the modules) names what
    each module registers, and nothing else is registered."""
    import importlib

    from kvray.bench import BENCHMARKS, NAMES, REGISTRY, benchmark

    for module in BENCHMARKS:
        importlib.import_module(module)
    assert sorted(REGISTRY) == sorted(NAMES)
    assert all(REGISTRY[name].__module__ == module for module, names in BENCHMARKS.items() for name in names)
    with pytest.raises(ValueError, match="not listed in kvray.bench.BENCHMARKS"):
        benchmark("unlisted")


def test_kvray_bench_workload_is_for_the_serve_benchmark_and_names_a_part_of_it(monkeypatch):
    """``--workload`` is refused without ``--only serve`` and for a part the run has not
    (``trace`` without ``--trace``), before any engine starts."""
    from kvray.bench.serve_workload import WORKLOADS_ENV

    monkeypatch.delenv(WORKLOADS_ENV, raising=False)  # the CLI sets it in this process; unset again at teardown
    alone = CliRunner().invoke(app, ["bench", "--only", "hf_ttft", "--workload", "agentic"])
    assert alone.exit_code == 2 and "--workload is for the serve benchmark: add --only serve" in message(alone)
    started = time.monotonic()
    unknown = CliRunner().invoke(app, ["bench", "--only", "serve", "--workload", "agentic", "--workload", "trace"])
    assert unknown.exit_code == 2 and message(unknown) == (
        "kvray: no serve workload trace; without --trace: multiround, agentic, longdoc"
    )
    assert time.monotonic() - started < 10  # refused before Ray or an engine starts
