"""Teaching the selector from counterfactuals: every expert's future is observed for free.

The shadow caches of :class:`~kvray.policy.experts.ExpertsPolicy` replay the stream under
every expert whatever the real cache follows, so a replay of a training trace records, at
every window, the selector's rows *and* what each expert then cost over the next
``horizon`` windows: full information, not the one realised outcome that PPO's reward
gives. Fitting the selector to those outcomes is supervised learning with exact labels.

Why it matters (measured on the 20 training cells of ``kvray train``, mean TTFT over the
best heuristic per cell): follow-the-leader is within 1.02x on 7 of 20 cells; a selector
told the next 16 windows' shadow costs, 17 of 20. PPO on the realised window TTFT, whose
reward mixes the queue every earlier window left behind, learnt corrections that cost
more than they gained (1,152-4,608 steps). The selector here learns to predict the future
leader from the past rows; PPO may then fine-tune it (:func:`kvray.rl.train.train`).

The loss is the expected regret of the selector's softmax choice: the probability it gives
each expert times how much more that expert costs than the best over the horizon (relative,
capped), so mistakes count by what they cost and windows where every expert is alike
(a cache not yet full) teach nothing.

Example::
    from kvray.rl.counterfactual import collect, fit
    from kvray.rl.train import RowScorer
    from kvray.sim.cost import load_scenario
    from kvray.sim.workloads import generate, named_workload

    scenario = load_scenario("h100-llama8b")
    rows, regret = collect([generate(named_workload("chat"), 1)[:400]], [0.05], scenario, horizon=4)
    scorer = RowScorer()
    fit(scorer, rows, regret, epochs=5, seed=0)   # the mean expected regret after each epoch
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvray.policy.experts import ExpertsPolicy, follow_the_leader, leader_scores
from kvray.sim.cost import Scenario
from kvray.traces import TraceRequest

MAX_REGRET = 4.0  # relative excess cost over the horizon's best expert, as the rows' gaps are capped


def _replay(trace: Sequence[TraceRequest], fraction: float, scenario: Scenario, horizon: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows at every choice of one follow-the-leader replay, and each expert's relative
    excess cost over the ``horizon`` windows that follow it."""
    from kvray.sim.simulator import Simulator, fast_capacity

    seen_rows: list[np.ndarray] = []
    window_costs: list[np.ndarray] = []

    def record(rows: np.ndarray) -> int:
        seen_rows.append(rows)
        window_costs.append(policy.window_costs())  # the window that just ended (zeros before the first)
        return follow_the_leader(rows)

    policy = ExpertsPolicy(selector=record)
    Simulator(scenario, policy, fast_capacity(scenario, trace, fraction)).replay(trace)
    costs = np.array([*window_costs[1:], policy.window_costs()])  # costs[w]: the window after choice w
    ahead = np.cumsum(costs[::-1], axis=0)[::-1]  # from window w to the end
    ahead = ahead - np.concatenate([ahead[horizon:], np.zeros((min(horizon, len(ahead)), costs.shape[1]))])
    best = ahead.min(axis=1, keepdims=True)
    regret = np.minimum((ahead - best) / np.maximum(best, 1e-9), MAX_REGRET)
    return np.array(seen_rows, dtype=np.float32), regret.astype(np.float32)


def collect(
    traces: Sequence[Sequence[TraceRequest]], fractions: Sequence[float], scenario: Scenario, horizon: int = 16
) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``[choices, experts, features]`` and regrets ``[choices, experts]`` from a
    follow-the-leader replay of every trace at every capacity fraction."""
    parts = [_replay(trace, fraction, scenario, horizon) for trace in traces for fraction in fractions]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def expected_regret(scorer: torch.nn.Module, rows: torch.Tensor, regret: torch.Tensor) -> torch.Tensor:
    """Mean over choices of the regret expected under the softmax of the selector's scores."""
    scores = leader_scores(rows) + scorer(rows)
    return (torch.softmax(scores, dim=-1) * regret).sum(dim=-1).mean()


def fit(
    scorer: torch.nn.Module, rows: np.ndarray, regret: np.ndarray, epochs: int = 200, seed: int = 0, lr: float = 3e-3
) -> list[float]:
    """Fit ``scorer`` (the correction to the leader ranking) to the counterfactual regrets,
    full batch with Adam; returns the mean expected regret after each epoch."""
    torch.manual_seed(seed)
    x, y = torch.from_numpy(rows), torch.from_numpy(regret)
    optimizer = torch.optim.Adam(scorer.parameters(), lr=lr)
    curve = []
    for _ in range(epochs):
        optimizer.zero_grad()
        loss = expected_regret(scorer, x, y)
        loss.backward()
        optimizer.step()
        curve.append(loss.item())
    return curve
