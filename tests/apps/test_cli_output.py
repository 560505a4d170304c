"""What a new user sees from the offline commands: an empty trace is one clear line and a
nonzero exit everywhere, human output carries its units and the scenario's name, `kvray
train --json` keeps stdout for the JSON, one capacity is drawn as bars, and `--help`
shows flags as flags with their defaults."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvray.apps.evaluate import _draw
from kvray.cli import app
from tests.conftest import kvray_command

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "data" / "traces" / "conversation_trace_first30min.jsonl"


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def one_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, text
    return lines[0]


@pytest.fixture
def empty_trace(tmp_path) -> Path:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    return path


@pytest.mark.parametrize(
    "command",
    [
        ["sim", "--trace", "{trace}"],
        ["train", "--trace", "{trace}", "--out", "{out}", "--timesteps", "1"],
        ["eval", "--trace", "{trace}", "--out", "{out}", "--policy", "lru"],
        ["eval", "--trace", "{trace}@0.5", "--out", "{out}", "--policy", "lru"],
    ],
    ids=["sim", "train", "eval", "eval-slice"],
)
def test_an_empty_trace_is_one_clear_line(command, empty_trace, tmp_path):
    args = [a.format(trace=empty_trace, out=tmp_path / "out") for a in command]
    result = invoke(*args)
    assert result.exit_code == 2
    assert one_line(result.stderr) == f"kvray: {empty_trace}: the trace holds no requests"
    assert not (tmp_path / "out").exists()


def test_eval_at_another_bandwidth_names_it_in_every_row(tmp_path):
    out = tmp_path / "out"
    result = invoke(
        "eval",
        "--trace",
        str(TRACE),
        "--policy",
        "lru",
        "--capacity-fraction",
        "0.1",
        "--bandwidth-scale",
        "0.5",
        "--out",
        str(out),
    )
    assert result.exit_code == 0, result.output
    rows = json.loads((out / "eval.json").read_text())["rows"]
    assert [r["scenario"] for r in rows] == ["h100-llama8b@bandwidth-x0.5"]
    refused = invoke("eval", "--trace", str(TRACE), "--policy", "lru", "--bandwidth-scale", "0", "--out", str(out))
    assert refused.exit_code == 2 and "--bandwidth-scale" in refused.output
    no_rl = invoke("eval", "--trace", str(TRACE), "--policy", "lru", "--noise", "2", "--out", str(out))
    assert no_rl.exit_code == 2 and "--noise" in no_rl.output


def test_train_refuses_a_trace_with_nothing_before_the_split(tmp_path):
    single = tmp_path / "single.jsonl"
    single.write_text(TRACE.read_text().splitlines()[0] + "\n")
    result = invoke("train", "--trace", str(single), "--out", str(tmp_path / "out"), "--no-evaluate")
    assert result.exit_code == 2
    assert "no requests in the first 0.6 of its time span to train on" in one_line(result.stderr)


def test_train_refuses_a_bad_bandwidth_and_a_cluster_without_one_node(tmp_path):
    out = tmp_path / "out"
    refused = invoke("train", "--trace", str(TRACE), "--bandwidth-scale", "-1", "--out", str(out), "--no-evaluate")
    assert refused.exit_code == 2 and "--bandwidth-scale" in refused.output
    cluster = ROOT / "simulations" / "h100-2node-train.yaml"
    result = invoke("train", "--trace", str(TRACE), "--scenario", str(cluster), "--out", str(out), "--no-evaluate")
    assert result.exit_code == 2
    assert "give at least one one-node training scenario" in one_line(result.stderr)
    assert not out.exists()


def test_sim_reports_in_units_and_names_the_scenario():
    scenario = ROOT / "simulations" / "reference-single-tier.yaml"
    result = invoke("sim", "--trace", str(TRACE), "--limit", "60", "--scenario", str(scenario))
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert "scenario reference-single-tier" in text and str(scenario) not in text
    assert "capacity (pages): host" in text


def test_sim_scales_its_figures_and_says_what_its_move_time_is():
    """At 50 columns: no figure cut, bytes and times scaled, the time of the moves between
    tiers named for what it is (the links' busy time, summed over the moves)."""
    result = CliRunner().invoke(
        app, ["sim", "--trace", str(TRACE), "--limit", "300", "--capacity-fraction", "0.05"], env={"COLUMNS": "50"}
    )
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())
    assert "…" not in result.stdout and re.search(r"│ [\d.]+ GiB │", text), result.stdout
    assert re.search(r"time links spent moving pages between tiers \d+\.\d (min|s) \(summed over the moves", text), text


@pytest.mark.train
def test_train_json_leaves_stdout_to_the_card(tmp_path):
    """In a process of its own, so anything written to the real stdout (progress bars,
    library logs) would show."""
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(TRACE.read_text().splitlines(keepends=True)[:120]))
    proc = kvray_command(
        "train",
        "--trace",
        str(trace),
        "--timesteps",
        "64",
        "--out",
        str(tmp_path / "tiny"),
        "--no-evaluate",
        "--json",
        "--family",  # one generated family at one size: what is written where, not the fit, is tested
        "chat",
        "--capacity-fraction",
        "0.05",
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    card = json.loads(proc.stdout)
    assert card["name"] == "tiny" and card["training"]["timesteps"] >= 64
    assert "wrote" in proc.stderr


def test_one_capacity_is_drawn_as_bars_and_several_as_lines():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [
        {"policy": p, "capacity_fraction": f, "token_hit_rate": h} for p, h in (("lru", 0.2), ("arc", 0.3)) for f in (0.05, 0.1)
    ]
    fig, (single, several) = plt.subplots(1, 2)
    _draw(single, [r for r in rows if r["capacity_fraction"] == 0.05], "token_hit_rate")
    _draw(several, rows, "token_hit_rate")
    assert [bar.get_height() for bar in single.patches] == [0.2, 0.3] and not single.lines
    assert len(several.lines) == 2 and not several.patches
    plt.close(fig)


@pytest.mark.parametrize(
    ("command", "default"),
    [("sim", "[default: 0]"), ("train", "[default: 0.6]"), ("status", "[default: kvray]"), ("run", None)],
)
def test_help_shows_flags_as_flags_and_defaults(command, default):
    result = invoke(command, "--help")
    assert result.exit_code == 0
    json_flag = next(line.split() for line in result.stdout.splitlines() if line.strip().startswith("--json"))
    assert json_flag[1] != "<bool>" and "<bool>" not in result.stdout
    assert default is None or default in result.stdout


@pytest.mark.parametrize(
    ("command", "refusal"),
    [
        (["sim", "--trace", "{trace}", "--limit", "-3"], "'--limit': must be >= 1, got -3"),
        (["sim", "--trace", "{trace}", "--limit", "0"], "'--limit': must be >= 1, got 0"),
        (["sim", "--trace", "{trace}", "--warmup-requests", "-1"], "'--warmup-requests': must be >= 0, got -1"),
        (["sim", "--trace", "{trace}", "--capacity-fraction", "0"], "'--capacity-fraction': must be in (0, 100], got 0"),
        (["sim", "--trace", "{trace}", "--capacity", "0"], "'--capacity': must be >= 1, got 0"),
        (
            ["cluster-eval", "--scenario", "{cluster}", "--trace", "{trace}", "--limit", "-3", "--out", "{out}"],
            "'--limit': must be >= 1, got -3",
        ),
        (
            ["cluster-eval", "--scenario", "{cluster}", "--generated", "-1", "--out", "{out}"],
            "'--generated': must be >= 0, got -1",
        ),
        (["train", "--trace", "{trace}", "--out", "{out}", "--jobs", "0"], "'--jobs': must be >= 1, got 0"),
        (
            ["train", "--trace", "{trace}", "--out", "{out}", "--train-fraction", "0"],
            "'--train-fraction': must be in (0, 1], got 0",
        ),
        (
            ["train", "--trace", "{trace}", "--out", "{out}", "--capacity-fraction", "0.1", "--capacity-fraction", "-2"],
            "'--capacity-fraction': must be in (0, 100], got -2",
        ),
        (["train", "--trace", "{trace}", "--out", "{out}", "--seed", "-1"], "'--seed': must be >= 0, got -1"),
        (
            ["eval", "--trace", "{trace}", "--out", "{out}", "--capacity-fraction", "200"],
            "'--capacity-fraction': must be in (0, 100], got 200",
        ),
        (["eval", "--trace", "{trace}", "--out", "{out}", "--noise", "-1"], "'--noise': must be >= 0, got -1"),
        (["eval", "--trace", "{trace}", "--out", "{out}", "--jobs", "0"], "'--jobs': must be >= 1, got 0"),
        (["generate", "--out", "{out}", "--sessions", "0"], "'--sessions': must be >= 1, got 0"),
        (["calibrate", "--out", "{out}", "--repeats", "0"], "'--repeats': must be >= 1, got 0"),
        (["chat-demo", "--turns", "0"], "'--turns': must be >= 1, got 0"),
    ],
    ids=lambda v: " ".join(v[:1] + v[-2:]) if isinstance(v, list) else None,
)
def test_a_count_out_of_range_is_refused_naming_the_flag(command, refusal, tmp_path):
    """Checked as the flags are parsed: exit 2 before anything is read, replayed or written,
    where `sim --limit -3` used to replay all but the last three requests."""
    cluster = ROOT / "simulations" / "h100-4node-skewed.yaml"
    args = [a.format(trace=TRACE, cluster=cluster, out=tmp_path / "out") for a in command]
    result = invoke(*args)
    assert result.exit_code == 2
    assert f"Invalid value for {refusal}" in result.output
    assert not (tmp_path / "out").exists()


def sim_json(*args: str) -> dict:
    result = invoke("sim", "--trace", str(TRACE), "--limit", "40", "--json", *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


CLUSTER = str(ROOT / "simulations" / "h100-4node-skewed.yaml")


def test_the_default_cluster_policy_is_named_as_the_user_names_it():
    """`local-first`, the runtime's default too, on one node and on a cluster (not `base`)."""
    assert sim_json()["cluster_policy"] == "local-first"
    assert sim_json("--scenario", CLUSTER)["cluster_policy"] == "local-first"
    assert sim_json("--scenario", CLUSTER, "--cluster-policy", "cost-router")["cluster_policy"] == "cost-router"


def test_a_cluster_policy_on_one_node_is_refused_naming_the_flag_and_the_scenario():
    result = invoke("sim", "--trace", str(TRACE), "--limit", "40", "--cluster-policy", "cost-router")
    assert result.exit_code == 2
    line = " ".join(result.stderr.split())
    assert "--cluster-policy cost-router: scenario 'h100-llama8b' has one node" in line


def test_the_oracle_runs_belady_and_says_so():
    """`--policy lru --cluster-policy oracle` printed `oracle / oracle`: the oracle runs Belady
    on every node, so a --policy beside it is refused and the row reads `belady / oracle`."""
    refused = invoke("sim", "--trace", str(TRACE), "--scenario", CLUSTER, "--policy", "lru", "--cluster-policy", "oracle")
    assert refused.exit_code == 2 and "--cluster-policy oracle runs Belady on every node: leave out --policy lru" in " ".join(
        refused.stderr.split()
    )
    result = invoke("sim", "--trace", str(TRACE), "--limit", "40", "--scenario", CLUSTER, "--cluster-policy", "oracle")
    assert result.exit_code == 0, result.output
    assert "belady /" in result.stdout and "oracle /" not in result.stdout
    record = sim_json("--scenario", CLUSTER, "--cluster-policy", "oracle")
    assert (record["policy"], record["cluster_policy"]) == ("belady", "oracle")


def test_an_unknown_cluster_policy_lists_every_one_the_simulator_takes():
    result = invoke("sim", "--trace", str(TRACE), "--scenario", CLUSTER, "--cluster-policy", "nope")
    assert result.exit_code == 2
    assert (
        "unknown cluster policy 'nope'; known: always-prefetch, cost-prefetch, cost-prefetch-budget, cost-router, local-first, oracle, replicate-hot"
        in (" ".join(result.stderr.split()))
    )


def test_cluster_eval_writes_under_results_by_default_and_refuses_one_node(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    one_node = ROOT / "simulations" / "h100-llama8b.yaml"
    refused = invoke("cluster-eval", "--scenario", str(one_node), "--generated", "20")
    assert refused.exit_code == 2 and "scenario 'h100-llama8b' has one node" in " ".join(refused.stderr.split())
    result = invoke("cluster-eval", "--scenario", CLUSTER, "--generated", "20")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "results" / "cluster").iterdir()) == ["cluster.json", "cluster.md", "cluster.png"]
    assert [p.name for p in tmp_path.iterdir()] == ["results"]
