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
each expert times how much more that expert costs than the best over the horizon, so
mistakes count by what they cost and windows where every expert is alike (a cache not yet
full) teach nothing. "What they cost" is in the replay's own unit, the mean best horizon
cost of that replay, not relative to each window's best: mean TTFT is a sum of absolute
costs, dominated by the windows where the prefill queue is backed up, and a choice there
should weigh as much as it moves the mean. Chosen by leave-one-source-out cross-validation
on the training sources (fitted on five, scored on the sixth, three seeds, horizon 8; the
method is in docs/sim-eval): the chosen expert's excess cost over the left-out replays, as a
share of the best's, 0.031 against 0.035 with per-window relative regrets capped at 4
(follow-the-leader 0.043).

Example::
    from kvray.rl.counterfactual import collect, fit
    from kvray.rl.train import RowScorer
    from kvray.scenario import load_scenario
    from kvray.sim.workloads import generate, named_workload

    scenario = load_scenario("h100-llama8b")
    rows, regret = collect([generate(named_workload("chat"), 1)[:400]], [0.05], [scenario], horizon=4)
    scorer = RowScorer()
    fit(scorer, rows, regret, epochs=5, seed=0)   # the mean expected regret after each epoch
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from kvray.policy.experts import ExpertsPolicy, Selector, corrected_scores, follow_the_leader, leader_scores
from kvray.scenario import Scenario
from kvray.traces import TraceRequest

CLUSTER_POLICY = "cost-router"  # what the policy runs under on a cluster (kvray cluster-eval)


class _Recorder:
    """One node's adaptive policy and what its selector saw: the rows of every choice, and
    each expert's shadow cost in every window."""

    def __init__(self, selector: Selector) -> None:
        self.selector = selector
        self.rows: list[np.ndarray] = []
        self.costs: list[np.ndarray] = []
        self.policy = ExpertsPolicy(selector=self._record)

    def _record(self, rows: np.ndarray) -> int:
        self.rows.append(rows)
        self.costs.append(self.policy.window_costs())  # the window that just ended (zeros before the first)
        return self.selector(rows)

    def labels(self, horizon: int) -> tuple[np.ndarray, np.ndarray]:
        """The rows, and each expert's excess cost over the best expert's in the ``horizon``
        windows after each choice, in units of this node's mean best horizon cost."""
        costs = np.array([*self.costs[1:], self.policy.window_costs()])  # costs[w]: the window after choice w
        ahead = np.cumsum(costs[::-1], axis=0)[::-1]  # from window w to the end
        ahead = ahead - np.concatenate([ahead[horizon:], np.zeros((min(horizon, len(ahead)), costs.shape[1]))])
        best = ahead.min(axis=1, keepdims=True)
        regret = (ahead - best) / max(float(best.mean()), 1e-9)
        return np.array(self.rows, dtype=np.float32), regret.astype(np.float32)


def _replay(job: tuple) -> list[tuple[np.ndarray, np.ndarray]]:
    """Rows and regrets of one replay whose real caches follow ``selector``: one pair per
    node that served a request. On a cluster each node's selector sees only its own
    requests and shadows, as in :class:`~kvray.policy.rl.RLPolicy` on a cluster, under
    :data:`CLUSTER_POLICY`."""
    from kvray.policy.cluster import make_cluster_policy
    from kvray.sim.cluster import ClusterSimulator
    from kvray.sim.node import node_capacities

    trace, fraction, scenario, horizon, selector = job
    recorders = [_Recorder(selector) for _ in scenario.node_scenarios()]
    cluster = make_cluster_policy(CLUSTER_POLICY) if len(recorders) > 1 else None
    capacities = node_capacities(scenario, trace, fraction)
    ClusterSimulator(scenario, [r.policy for r in recorders], cluster, capacities).replay(trace)
    return [r.labels(horizon) for r in recorders if r.rows]


def collect(
    traces: Sequence[Sequence[TraceRequest]],
    fractions: Sequence[float],
    scenarios: Sequence[Scenario],
    horizon: int = 16,
    selector: Selector = follow_the_leader,
    jobs: int = 1,
) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``[choices, experts, features]`` and regrets ``[choices, experts]`` from a
    replay of every trace at every capacity fraction (of the whole cluster's device + host)
    on every scenario, whose real caches follow ``selector`` (the regrets are the shadows'
    and do not depend on it; the rows' real-cache features do). ``jobs`` replays run at once
    in worker processes."""
    work = [
        (trace, fraction, scenario, horizon, selector) for scenario in scenarios for trace in traces for fraction in fractions
    ]
    if jobs > 1:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(jobs) as pool:
            parts = [part for replay in pool.map(_replay, work) for part in replay]
    else:
        parts = [part for job in work for part in _replay(job)]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def expected_regret(scorer: torch.nn.Module, rows: torch.Tensor, regret: torch.Tensor) -> torch.Tensor:
    """Mean over choices of the regret expected under the softmax of the selector's scores."""
    return _expected_regret(scorer(rows), rows, regret)


def _expected_regret(correction: torch.Tensor, rows: torch.Tensor, regret: torch.Tensor) -> torch.Tensor:
    scores = leader_scores(rows) + correction  # unbounded: the fit needs its gradient everywhere (RLPolicy bounds it)
    return (torch.softmax(scores, dim=-1) * regret).sum(dim=-1).mean()


def correction_size(correction: torch.Tensor) -> torch.Tensor:
    """Mean square of a correction ``[choices, experts]`` about its mean over each choice's
    experts: a shift common to every expert changes no choice, so only the rest counts."""
    return (correction - correction.mean(dim=-1, keepdim=True)).square().mean()


def fit(
    scorer: torch.nn.Module,
    rows: np.ndarray,
    regret: np.ndarray,
    epochs: int = 200,
    seed: int = 0,
    lr: float = 3e-3,
    correction_decay: float = 0.0,
) -> list[float]:
    """Fit ``scorer`` (the correction to the leader ranking) to the counterfactual regrets,
    full batch with Adam; returns the mean expected regret after each epoch.

    ``correction_decay`` adds that times :func:`correction_size` to the loss: a correction
    then survives only where it lowers the training regret by more than it costs, and the
    selector stays with the leader where the training rows do not agree on a deviation.
    Cross-validated over the training sources it did not help (the unpenalised correction
    already transfers to a source left out; docs/sim-eval), so ``kvray train`` defaults to 0.
    """
    torch.manual_seed(seed)
    x, y = torch.from_numpy(rows), torch.from_numpy(regret)
    optimizer = torch.optim.Adam(scorer.parameters(), lr=lr)
    curve = []
    for _ in range(epochs):
        optimizer.zero_grad()
        correction = scorer(x)
        loss = _expected_regret(correction, x, y)
        (loss + correction_decay * correction_size(correction) if correction_decay else loss).backward()
        optimizer.step()
        curve.append(loss.item())
    return curve


def leave_one_source_out(
    sources: Mapping[str, tuple[np.ndarray, np.ndarray]],
    make_scorer: Callable[[int], torch.nn.Module],
    correction_decay: float = 0.0,
    epochs: int = 300,
    seeds: Sequence[int] = (0,),
) -> dict[str, dict[str, float]]:
    """Cross-validation over training sources: for each source (its rows and regrets from
    :func:`collect`), a scorer per seed (``make_scorer(seed)``) is fitted on every other
    source and scored on the one left out; returns, per source, the mean over seeds of the
    expected regret (what :func:`fit` minimises) and of the regret of the argmax choice
    (what :class:`~kvray.policy.rl.RLPolicy` does). How ``kvray train``'s
    ``--correction-decay`` default was chosen without looking at held-out workloads."""
    scores: dict[str, dict[str, float]] = {}
    for left_out, (rows, regret) in sources.items():
        others = [v for k, v in sources.items() if k != left_out]
        train_rows, train_regret = np.concatenate([o[0] for o in others]), np.concatenate([o[1] for o in others])
        x, y = torch.from_numpy(rows), torch.from_numpy(regret)
        expected, chosen = [], []
        for seed in seeds:
            scorer = make_scorer(seed)
            fit(scorer, train_rows, train_regret, epochs, seed, correction_decay=correction_decay)
            with torch.no_grad():
                correction = scorer(x)
            expected.append(_expected_regret(correction, x, y).item())
            choice = corrected_scores(x, correction).argmax(dim=-1)  # what RLPolicy follows
            chosen.append(y[torch.arange(len(y)), choice].mean().item())
        scores[left_out] = {"expected_regret": float(np.mean(expected)), "argmax_regret": float(np.mean(chosen))}
    return scores
