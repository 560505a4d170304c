"""kvray cluster-eval's tables: one per scenario and trace, every heuristic and the oracle,
the oracle's headroom over the best heuristic, and cells under 10% named."""

from kvray.apps.cluster_eval import evaluate, headroom, write_markdown
from kvray.scenario import load_scenario
from kvray.sim.workloads import WorkloadSpec, generate


def test_tables_name_the_best_heuristic_and_the_oracles_headroom(tmp_path):
    scenario = load_scenario("simulations/h100-4node-skewed.yaml")
    trace = generate(WorkloadSpec(sessions=40, session_rate_per_s=20.0, system_prompt_pages=1), seed=1)
    heuristics = (("lru", "local-first"), ("lru", "cost-router"))
    candidate = ("experts", "cost-router")
    rows = evaluate({"four": scenario}, {"chat": trace}, 0.05, heuristics, candidates=[candidate])
    assert [(r["policy"], r["cluster_policy"]) for r in rows] == [*heuristics, candidate, ("oracle", "oracle")]
    best, oracle, room = headroom(rows)["four", "chat"]
    assert best["mean_ttft_ms"] == min(r["mean_ttft_ms"] for r in rows[:2])  # a candidate is never the baseline
    assert room == 1 - oracle["mean_ttft_ms"] / best["mean_ttft_ms"]
    assert all(r["link_gib"]["pcie_d2h"] > 0 for r in rows)
    text = write_markdown(rows, tmp_path / "cluster.md", command="kvray cluster-eval ...").read_text()
    assert "## four, chat" in text and f"headroom {room:.1%}" in text
    ratio = rows[2]["mean_ttft_ms"] / best["mean_ttft_ms"]
    assert f"experts + cost-router: mean TTFT {ratio:.3f}x" in text
    assert ("four / chat" in text.split("## Headroom under 10%")[1]) == (room < 0.10)


def test_compare_replays_the_pairs_beside_the_cost_router_only_and_reports_their_spread(tmp_path):
    """--compare: no other heuristic, no oracle; each pair's ratio to lru + cost-router and the
    pairs' spread per cell, and the counts the seed targets are read from."""
    import json

    from typer.testing import CliRunner

    from kvray.apps.cluster_compare import comparison
    from kvray.cli import app

    args = ["cluster-eval", "--compare", "--scenario", "simulations/h100-4node-skewed.yaml", "--generated", "40"]
    args += ["--bandwidth-scale", "0.5", "--bandwidth-scale", "1", "--out", str(tmp_path)]
    result = CliRunner().invoke(app, [*args, "--policy", "lru+always-prefetch", "--policy", "lru+local-first"])
    assert result.exit_code == 0, result.output
    saved = json.loads((tmp_path / "compare.json").read_text())
    rows = saved["rows"]
    assert {(r["policy"], r["cluster_policy"]) for r in rows} == {
        ("lru", "cost-router"),
        ("lru", "always-prefetch"),
        ("lru", "local-first"),
    }
    summary = comparison(rows)
    assert len(summary["cells"]) == 2 and summary == saved["summary"]
    for cell in summary["cells"]:
        reference = cell["reference"]["mean_ttft_ms"]
        means = [r["mean_ttft_ms"] for r in cell["candidates"]]
        assert cell["ratios"] == [m / reference for m in means]
        assert cell["spread"] == max(means) / min(means) - 1.0
    assert summary["cells_within_2pct"] == sum(c["spread"] <= 0.02 for c in summary["cells"])
    text = (tmp_path / "compare.md").read_text()
    assert "lru+always-prefetch: mean ratio" in text and f"{summary['cells_within_2pct']} of 2." in text
    refused = CliRunner().invoke(app, args)
    assert refused.exit_code != 0 and "give at least one" in " ".join(refused.output.split())
