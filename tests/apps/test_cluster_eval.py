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


def test_noise_places_each_pair_within_the_band_of_the_best_heuristic_under_its_cluster_policy(tmp_path):
    """--noise N: per cell and cluster policy of a pair, the best heuristic under it (LRU where
    none runs under it) and the pairs replayed on N copies less one request; the band is the
    reference's spread over the whole trace and its copies, a pair equal to its reference sits at exactly 1, and the
    oracle's per-node policy is not beyond the band."""
    from kvray.apps.cluster_noise import MIN_BAND, noise_bands, write_noise
    from kvray.apps.evaluate import without_one_request
    from kvray.policy.cluster import make_cluster_policy
    from kvray.sim.cluster import ClusterSimulator
    from kvray.sim.load import scaled
    from kvray.sim.node import node_capacities

    scenario = load_scenario("simulations/h100-4node-skewed.yaml")
    trace = generate(WorkloadSpec(sessions=40, session_rate_per_s=20.0, system_prompt_pages=1), seed=1)
    heuristics = (("lru", "local-first"), ("arc", "local-first"))
    candidates = [("belady", "local-first"), ("lru", "cost-prefetch")]
    rows = evaluate({"four": scenario}, {"chat": trace}, 0.05, heuristics, candidates=candidates, load=0.8, oracle=False)
    bands = noise_bands({"four": scenario}, {"chat": trace}, 0.05, rows, copies=3)
    assert [b["cluster_policy"] for b in bands] == ["local-first", "cost-prefetch"]
    local, prefetch = bands
    best = min(rows[:2], key=lambda r: r["mean_ttft_ms"])
    assert (local["reference"], local["reference_mean_ttft_ms"]) == (best["policy"], best["mean_ttft_ms"])
    assert prefetch["reference"] == "lru" and set(prefetch["candidates"]) == {"lru"}
    caps = node_capacities(scenario, trace, 0.05)
    loaded = scaled(trace, rows[0]["load"]["arrival_scale"])  # the copies are of the trace at its load
    copies = [
        ClusterSimulator(scenario, local["reference"], make_cluster_policy("local-first"), caps).replay(
            without_one_request(loaded, k)
        )
        for k in range(3)
    ]
    means = [best["mean_ttft_ms"], *(c.mean_ttft_ms for c in copies)]
    assert local["band"] == max(means) / min(means) - 1.0 > 0
    for band in bands:
        for pair in band["candidates"].values():
            assert pair["beyond_band"] == (pair["ratio"] > 1.0 + max(band["band"], MIN_BAND))
    assert local["candidates"]["belady"]["ratio"] < 1.0 and not local["candidates"]["belady"]["beyond_band"]
    same = prefetch["candidates"]["lru"]  # its own reference
    assert same["ratio"] == same["copies_median"] == same["copies_least"] == same["copies_largest"] == 1.0
    assert not same["beyond_band"] and same["nvme_write_vs_reference"] in (1.0, None)
    text = write_noise(bands, tmp_path, "kvray cluster-eval ... --noise 3")[1].read_text()
    assert "| four | chat | cost-prefetch | lru, " in text and "- belady + local-first: beyond the band in" in text


def test_noise_needs_a_pair_to_place_and_two_copies_and_a_pair_that_is_also_a_heuristic_stays_one():
    from typer.testing import CliRunner

    from kvray.cli import app

    args = ["cluster-eval", "--scenario", "simulations/h100-4node-skewed.yaml", "--generated", "40", "--noise", "2"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code != 0 and "--noise N places the --policy pairs" in result.output
    result = CliRunner().invoke(app, [*args[:-1], "1", "--policy", "lru+cost-prefetch"])
    assert result.exit_code != 0 and "at least 2 copies" in result.output
    scenario = load_scenario("simulations/h100-4node-skewed.yaml")
    trace = generate(WorkloadSpec(sessions=10, session_rate_per_s=20.0), seed=1)
    rows = evaluate({"four": scenario}, {"chat": trace}, 0.05, (("lru", "local-first"),), candidates=[("lru", "local-first")])
    assert [r["candidate"] for r in rows] == [False, True, False]  # the heuristic's row stays the reference
