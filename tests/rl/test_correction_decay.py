"""The penalty on the fitted correction (``kvray train --correction-decay``): a stronger one
leaves a smaller correction to follow-the-leader on the same rows, at some cost in training
regret; training stays byte-reproducible for a seed and records the strength in the card.
Also: counterfactual rows can be collected while a given selector drives the real cache."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from kvray.cli import app
from kvray.policy.experts import SELECTOR_FEATURES, follow_the_leader
from kvray.policy.rl import CARD_FILE, WEIGHTS_FILE
from kvray.rl.counterfactual import collect, correction_size, expected_regret, fit, leave_one_source_out
from kvray.rl.train import RowScorer, train
from kvray.scenario import DEFAULT_SCENARIO, load_scenario
from kvray.sim.workloads import generate, named_workload

pytestmark = pytest.mark.train

SCENARIO = load_scenario(DEFAULT_SCENARIO)
TRACE = generate(named_workload("phase"), 5)[:640]


@pytest.fixture(scope="module")
def rows_and_regret():
    return collect([TRACE], [0.02, 0.05, 0.10], [SCENARIO], horizon=4)


def _fitted(rows, regret, decay: float) -> tuple[float, float]:
    """(size of the fitted correction, expected regret) on the training rows."""
    torch.manual_seed(0)
    scorer = RowScorer()
    torch.nn.init.normal_(scorer.layers[-1].weight, std=1.0)  # start away from zero, as PPO's init does in kvray train
    fit(scorer, rows, regret, epochs=150, seed=0, correction_decay=decay)
    x, y = torch.from_numpy(rows), torch.from_numpy(regret)
    with torch.no_grad():
        return correction_size(scorer(x)).item(), expected_regret(scorer, x, y).item()


def test_a_stronger_penalty_leaves_a_smaller_correction(rows_and_regret):
    rows, regret = rows_and_regret
    fits = [_fitted(rows, regret, decay) for decay in (0.0, 0.03, 1.0)]
    sizes, regrets = [f[0] for f in fits], [f[1] for f in fits]
    assert sizes[0] > 3 * sizes[1] > 3 * 3 * sizes[2]  # shrinks by a lot at each step, not by noise
    assert regrets[0] <= regrets[1] <= regrets[2]  # what the penalty trades away: training regret


def test_correction_size_ignores_a_shift_common_to_every_expert():
    correction = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    assert correction_size(correction + 5.0).item() == pytest.approx(correction_size(correction).item())
    assert correction_size(torch.full((2, 3), 7.0)).item() == 0.0


def test_rows_follow_the_selector_in_charge_and_the_regrets_do_not(rows_and_regret):
    rows, regret = collect([TRACE], [0.05], [SCENARIO], horizon=4, selector=lambda r: 2)
    leader_rows, leader_regret = collect([TRACE], [0.05], [SCENARIO], horizon=4, selector=follow_the_leader)
    current = SELECTOR_FEATURES.index("is_current")
    assert (rows[1:, :, current] == [0, 0, 1]).all()  # the real cache followed expert 2 throughout
    assert not (leader_rows[1:, :, current] == [0, 0, 1]).all()
    np.testing.assert_allclose(regret, leader_regret)  # shadows replay alike whatever the real cache follows


def _train(out: Path, decay: float) -> dict:
    lines = Path("data/traces/conversation_trace_first30min.jsonl").read_text().splitlines(keepends=True)[:200]
    trace = out.parent / "t.jsonl"
    trace.write_text("".join(lines))
    return train(
        [SCENARIO], [trace], 0, out, capacity_fractions=(0.1,), families=("chat",), correction_decay=decay, progress=False
    )


def test_training_is_reproducible_and_records_the_decay(tmp_path):
    cards = [_train(tmp_path / name, decay) for name, decay in (("a", 0.1), ("b", 0.1), ("c", 0.0))]
    weights = [(tmp_path / name / WEIGHTS_FILE).read_bytes() for name in "abc"]
    assert weights[0] == weights[1] and weights[0] != weights[2]
    assert [c["training"]["counterfactual"]["correction_decay"] for c in cards] == [0.1, 0.1, 0.0]
    assert json.loads((tmp_path / "a" / CARD_FILE).read_text())["training"]["counterfactual"]["correction_decay"] == 0.1


def test_cli_refuses_a_negative_decay(tmp_path):
    result = CliRunner().invoke(app, ["train", "--trace", "x.jsonl", "--out", str(tmp_path / "p"), "--correction-decay", "-1"])
    assert result.exit_code != 0 and "--correction-decay" in result.output and not (tmp_path / "p").exists()


def test_leave_one_source_out_scores_each_source_with_a_scorer_that_never_saw_it(rows_and_regret):
    rows, regret = rows_and_regret
    other = collect([generate(named_workload("document"), 5)[:480]], [0.05], [SCENARIO], horizon=4)
    sources = {"phase": (rows, regret), "document": other}
    seen: list[int] = []

    def make(seed: int) -> RowScorer:
        seen.append(seed)
        torch.manual_seed(seed)
        return RowScorer()

    scores = leave_one_source_out(sources, make, epochs=60, seeds=(0, 1))
    assert set(scores) == {"phase", "document"} and seen == [0, 1, 0, 1]
    # the document source is scored by a scorer fitted on phase alone: the same fit, redone by hand
    by_hand = make(0)
    fit(by_hand, rows, regret, epochs=60, seed=0)
    x, y = torch.from_numpy(other[0]), torch.from_numpy(other[1])
    with torch.no_grad():
        alone = expected_regret(by_hand, x, y).item()
    assert min(s["expected_regret"] for s in scores.values()) >= 0
    one_seed = leave_one_source_out(sources, make, epochs=60, seeds=(0,))
    assert one_seed["document"]["expected_regret"] == pytest.approx(alone, rel=1e-5)
