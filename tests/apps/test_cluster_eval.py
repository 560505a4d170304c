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
