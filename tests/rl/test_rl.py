"""The learned policy: tiny PPO training (on generated families and a trace's first part)
writes safe weights and a model card, `rl:PATH` loads them, decisions are deterministic,
and files for another observation space (or not a policy at all) are refused with
PolicyError."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from kvray.apps.evaluate import compare, goals, noise_counts, noise_floor, noise_table, plot, without_one_request, write_report
from kvray.core.errors import ConfigError, PolicyError
from kvray.policy import make_policy
from kvray.policy.experts import EXPERTS, SELECTOR_FEATURES
from kvray.policy.rl import CARD_FILE, DEFAULT_POLICY, WEIGHTS_FILE, RLPolicy, load_scorer, observation_spec
from kvray.resources import shipped_or_given
from kvray.rl.train import split_by_time, train
from kvray.scenario import DEFAULT_SCENARIO, load_scenario
from kvray.sim.simulator import simulate
from kvray.traces import read_trace

SCENARIO = load_scenario(DEFAULT_SCENARIO)


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory):
    trace = tmp_path_factory.mktemp("trace") / "t.jsonl"
    lines = Path("data/traces/conversation_trace_first30min.jsonl").read_text().splitlines(keepends=True)[:200]
    trace.write_text("".join(lines))
    out = tmp_path_factory.mktemp("policy") / "tiny"
    card = train(
        [SCENARIO, SCENARIO.with_bandwidth(0.5), load_scenario("h100-2node-train")],
        [trace],
        timesteps=16,
        out=out,
        capacity_fractions=(0.1,),
        families=("chat",),
        episode_windows=2,
        progress=False,
    )
    return out, card


def test_training_writes_safetensors_and_a_card(tiny_policy):
    out, card = tiny_policy
    assert (out / WEIGHTS_FILE).read_bytes()[8:9] == b"{"  # safetensors: length + JSON header, no pickle
    written = json.loads((out / CARD_FILE).read_text())
    assert written["observation"] == observation_spec()
    assert written["observation"]["features"] == list(SELECTOR_FEATURES) and written["observation"]["experts"] == list(EXPERTS)
    fitted = written["training"]["counterfactual"]
    assert fitted["choices"] > 0 and fitted["fitted_expected_regret"] >= 0
    assert written["training"]["timesteps"] >= 16 and written["training"]["seed"] == 0
    assert written["training"]["gamma"] > 0
    assert written["training"]["scenarios"] == [
        {"name": "h100-llama8b", "nodes": 1},
        {"name": "h100-llama8b@bandwidth-x0.5", "nodes": 1},
        {"name": "h100-2node-train", "nodes": 2},
    ]
    assert written["scenario"] == "h100-llama8b"  # the default tier costs come from the first
    sources = written["training"]["traces"]
    assert sources[0] == {"family": "chat", "seed": 100, "train_requests": sources[0]["train_requests"]}
    assert sources[1]["train_requests"] > 0 and sources[1]["held_out_requests"] > 0


def test_trained_policy_runs_in_the_simulator_deterministically(tiny_policy):
    out, _ = tiny_policy
    requests = read_trace("data/traces/synthetic_trace.jsonl", limit=150)
    runs = [simulate(requests, f"rl:{out}", SCENARIO, capacity=50).as_dict() for _ in range(2)]
    assert runs[0] == runs[1] and runs[0]["requests"] == 150


def test_policy_for_another_observation_space_is_refused(tiny_policy, tmp_path):
    out, _ = tiny_policy
    other = tmp_path / "other"
    shutil.copytree(out, other)
    card = json.loads((other / CARD_FILE).read_text())
    card["observation"]["features"] = card["observation"]["features"][:-1]
    (other / CARD_FILE).write_text(json.dumps(card))
    with pytest.raises(PolicyError, match="trained on observation"):
        make_policy(f"rl:{other}")
    with pytest.raises(PolicyError, match="not a policy"):
        make_policy(f"rl:{tmp_path / 'missing'}")
    (other / CARD_FILE).write_text(json.dumps({**card, "observation": json.loads((out / CARD_FILE).read_text())["observation"]}))
    (other / WEIGHTS_FILE).write_bytes(b"\x80\x04pickle")
    with pytest.raises(PolicyError, match="unreadable"):
        make_policy(f"rl:{other}")


def test_shipped_default_policy_scores_rows_as_its_weights_say():
    """The numpy scorer (chunked, transposed weights) equals a plain torch forward of the
    shipped weights, and it tells pages apart (a constant scorer would rank nothing)."""
    import torch
    from safetensors.torch import load_file

    policy = make_policy("rl")
    assert isinstance(policy, RLPolicy) and policy.card["training"]["counterfactual"]["choices"] > 0
    scorer, _ = load_scorer(DEFAULT_POLICY)
    rows = np.random.default_rng(0).random((5000, len(SELECTOR_FEATURES)), dtype=np.float32)  # > one chunk
    tensors = load_file(str(shipped_or_given(DEFAULT_POLICY, "policies") / WEIGHTS_FILE))
    x = torch.from_numpy(rows)
    layers = len(tensors) // 2
    for i in range(layers):
        x = torch.nn.functional.linear(x, tensors[f"layer{i}.weight"].float(), tensors[f"layer{i}.bias"].float())
        x = torch.relu(x) if i < layers - 1 else x
    scores = scorer.score(rows)
    np.testing.assert_allclose(scores, x[:, 0].numpy(), rtol=1e-4, atol=1e-5)
    assert np.std(scores) > 1e-3


def test_eval_compares_policies_and_saves_plots(tiny_policy, tmp_path):
    out, card = tiny_policy
    _, held = split_by_time(read_trace("data/traces/conversation_trace_first30min.jsonl", limit=300), 0.5)
    rows = compare({"conv@0.5": held}, ["lru", "belady", f"rl:{out}"], [0.05, 0.1], SCENARIO, jobs=2)
    summary = goals(rows, learned=f"rl:{out}")
    assert set(summary) == {"conv@0.5@0.05", "conv@0.5@0.1"}
    assert all(v["rl_hit_rate_vs_belady"] > 0 and v["best_heuristic"] == "lru" for v in summary.values())
    assert all(v["ttft_vs_best_heuristic"]["lru"] == 1.0 and "rl_share_of_oracle_gain" in v for v in summary.values())
    write_report(tmp_path, rows, summary)
    files = plot(rows, tmp_path, card)
    assert {f.name for f in files} == {"conv_at_0.5.png", "training_curve.png"}
    assert all(f.stat().st_size > 1000 for f in files) and (tmp_path / "eval.json").is_file()


def test_a_noise_copy_leaves_out_one_request_chosen_by_its_seed():
    trace = read_trace("data/traces/conversation_trace_first30min.jsonl", limit=50)
    copies = [without_one_request(trace, seed) for seed in range(4)]
    assert all(len(c) == 49 and all(r in trace for r in c) for c in copies)
    assert without_one_request(trace, 2) == copies[2]
    assert len({tuple(r.timestamp_ms for r in c) for c in copies}) > 1  # seeds drop different requests
    with pytest.raises(ConfigError, match="has 1"):
        without_one_request(trace[:1], 0)


def test_noise_floor_replays_the_best_heuristic_and_rl_on_each_copy(tiny_policy):
    """Each copy's figures are the replays of that copy: the best heuristic's over its own
    on the whole trace, and rl's over the best heuristic's on the same copy."""
    out, _ = tiny_policy
    learned = f"rl:{out}"
    _, held = split_by_time(read_trace("data/traces/conversation_trace_first30min.jsonl", limit=300), 0.5)
    traces = {"conv@0.5": held}
    summary = goals(compare(traces, ["lru", "arc", learned], [0.05], SCENARIO, jobs=2), learned=learned)
    floor = noise_floor(traces, [0.05], summary, SCENARIO, copies=2, learned=learned, jobs=2)
    entry, cell = floor["conv@0.5@0.05"], summary["conv@0.5@0.05"]
    assert entry["best_heuristic"] == cell["best_heuristic"] and len(entry["rl_ttft_vs_best_heuristic"]) == 2
    copy = without_one_request(held, 1)
    best = simulate(copy, cell["best_heuristic"], SCENARIO, capacity_fraction=0.05).mean_ttft_ms
    rl = simulate(copy, learned, SCENARIO, capacity_fraction=0.05).mean_ttft_ms
    assert entry["best_heuristic_moves"][1] == pytest.approx(best / cell["best_heuristic_ttft_ms"])
    assert entry["rl_ttft_vs_best_heuristic"][1] == pytest.approx(rl / best)
    counts = noise_counts(floor)
    assert counts["cells"] == 1 and counts["rl_within_1.02_some_copy"] + counts["rl_within_1.02_no_copy"] == 1
    assert "| conv@0.5@0.05 |" in noise_table(floor)


def test_rl_policy_runs_inside_the_runtime_page_store(tiny_layout):
    """The same policy object works in PageStore, which sends no on_request: its selector
    is never asked, so it follows its first expert (LRU) and keeps what LRU keeps."""
    import torch

    from kvray.core.config import StoreConfig, TierSizes
    from kvray.core.store import PageStore
    from tests.conftest import prefix_kv

    store = PageStore(StoreConfig(layout=tiny_layout, tiers=TierSizes(device=2, host=4)), policy=make_policy("rl"))
    hit_tokens = []
    for start in range(0, 40, 8):
        tokens = list(range(start, start + 16))
        store.store(tokens, prefix_kv(tiny_layout, tokens))
        hit = store.load(tokens)
        assert torch.equal(hit.kv, prefix_kv(tiny_layout, tokens)[:, :, : hit.tokens])
        hit_tokens.append(hit.tokens)
    assert len(store) == 5  # the tiers are full (device 2 + host 4 slots; a chain's parent stays): LRU's count
    assert hit_tokens == [16] * 5  # what was just stored is served from the tiers, bit-exact


@pytest.mark.train
def test_kvray_train_writes_tensorboard_events(tmp_path):
    """`kvray train` logs to TensorBoard under the policy folder by default."""
    from typer.testing import CliRunner

    from kvray.cli import app

    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(Path("data/traces/conversation_trace_first30min.jsonl").read_text().splitlines(keepends=True)[:120]))
    out = tmp_path / "tiny"
    result = CliRunner().invoke(
        app,
        [
            "train",
            "--trace",
            str(trace),
            "--timesteps",
            "8",
            "--family",
            "chat",
            "--capacity-fraction",
            "0.1",
            "--out",
            str(out),
            "--no-evaluate",
        ],
    )
    assert result.exit_code == 0, result.output
    events = list((out / "tensorboard").rglob("events.out.tfevents.*"))
    assert events and all(e.stat().st_size > 0 for e in events)
