"""``kvray train``: the training scenarios from the command line's files and link bandwidths,
training (:func:`kvray.rl.train.train`), and the card's scores on held-out data.

Every scenario file is trained on at every bandwidth scale, the scale nearest 1 first, so the
first scenario at its own bandwidth (when 1 is among the scales) gives the policy its default
tier costs. The held-out scores compare the trained policy with every heuristic and Belady on
the held-out rest of each trace and on the ``--holdout`` traces, at capacity fractions 0.05
and 0.10, on the first scenario file at its own bandwidth.

Example::

    card = train_policy(TrainRequest(traces=[Path("t.jsonl")], out=Path("policies/mine"), timesteps=0, ...))
    print(summary_line(card, Path("policies/mine")))
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvray.core.errors import ConfigError
from kvray.rl.teacher_recipe import TeacherRecipe
from kvray.scenario import DEFAULT_CLUSTER_SCENARIO, DEFAULT_SCENARIO, Scenario, load_scenario
from kvray.traces import TraceRequest

CARD_KEYS = ("trace", "capacity_fraction", "policy", "token_hit_rate", "mean_ttft_ms", "p99_ttft_ms")
SCORED_FRACTIONS = (0.05, 0.10)


@dataclass(frozen=True, kw_only=True)
class TrainRequest:
    """What ``kvray train`` was asked for: its flags' values, checked as they were parsed
    (their defaults are the command's); ``progress`` tells of each held-out replay."""

    traces: Sequence[Path]
    out: Path
    scenarios: Sequence[Path]
    bandwidth_scales: Sequence[float]
    timesteps: int
    counterfactual_horizon: int
    counterfactual_epochs: int
    correction_decay: float
    seed: int
    train_fraction: float
    families: Sequence[str]
    capacity_fractions: Sequence[float]
    holdout: Sequence[Path]
    evaluate: bool
    tensorboard: Path | None
    jobs: int
    progress: Callable[[str], None] | None = field(default=None, compare=False)


def train_policy(request: TrainRequest) -> dict:
    """Train the policy ``request`` asks for into ``request.out``; returns its model card
    (with the held-out scores unless ``request.evaluate`` is off)."""
    if not request.traces:
        raise ConfigError("give at least one --trace to train the placement policy on (or --cluster)")
    from kvray.rl.train import train

    bases = [load_scenario(path) for path in request.scenarios or [DEFAULT_SCENARIO]]
    return train(
        scenarios_at_bandwidths(bases, request.bandwidth_scales),
        request.traces,
        request.timesteps,
        request.out,
        request.seed,
        request.train_fraction,
        capacity_fractions=request.capacity_fractions,
        families=request.families,
        counterfactual_horizon=request.counterfactual_horizon,
        counterfactual_epochs=request.counterfactual_epochs,
        correction_decay=request.correction_decay,
        progress=True,
        evaluate=HeldOutScores(request, bases[0]) if request.evaluate else None,
        tensorboard=request.tensorboard or request.out / "tensorboard",
        jobs=request.jobs,
    )


def scenarios_at_bandwidths(bases: Sequence[Scenario], scales: Sequence[float]) -> list[Scenario]:
    """Every scenario at every scale, the scale nearest 1 first (the first gives the default tier costs)."""
    nearest_first = sorted(scales, key=lambda b: abs(math.log(b)))
    return [s if b == 1.0 else s.with_bandwidth(b) for s in bases for b in nearest_first]


@dataclass(frozen=True)
class HeldOutScores:
    """The card's evaluation: the trained policy (named ``rl``) against every heuristic and
    Belady on the held-out data, and the goals those rows meet (:func:`kvray.apps.evaluate.goals`)."""

    request: TrainRequest
    scenario: Scenario

    def __call__(self, folder: Path, held_out: list[list[TraceRequest]]) -> dict:
        from kvray.apps.evaluate import HEURISTICS, compare, goals
        from kvray.traces import read_trace

        fraction = self.request.train_fraction
        sets = {f"{t.stem}@{fraction:g}": rest for t, rest in zip(self.request.traces, held_out)}
        sets.update({t.stem: read_trace(t) for t in self.request.holdout})
        say = self.request.progress
        rows = compare(
            sets,
            [*HEURISTICS, "belady", f"rl:{folder}"],
            list(SCORED_FRACTIONS),
            self.scenario,
            progress=None if say is None else lambda what: say(f"evaluating {what}"),
        )
        for row in rows:
            row["policy"] = "rl" if row["policy"].startswith("rl:") else row["policy"]
        return {"goals": goals(rows), "rows": [{k: r[k] for k in CARD_KEYS} for r in rows]}


def summary_line(card: dict, out: Path) -> str:
    """What was written and how the fit and PPO went, in one line."""
    fitted = card["training"]["counterfactual"]
    fit_line = (
        f"fitted to {fitted['choices']} counterfactual choices in {fitted['wall_s']} s (expected regret "
        f"{fitted['fitted_expected_regret']}, follow-the-leader {fitted['follow_the_leader_regret']}); "
        if fitted
        else ""
    )
    return f"wrote {out}: {fit_line}{card['training']['timesteps']} PPO steps in {card['training']['wall_s']} s"


def train_reuse_policy(
    out: Path,
    seed: int,
    rounds: int,
    jobs: int,
    record: float,
    families: Sequence[str],
    traces: Sequence[Path],
    capacity_fractions: Sequence[float],
    train_fraction: float,
    pool: tuple[int, int, int],
    progress: Callable[[str], None] | None = None,
    loads: Sequence[float | None] = (None,),
    recipe: TeacherRecipe = TeacherRecipe(),
    ensemble: int = 1,
) -> dict:
    """``kvray train-reuse``: the per-page reuse model imitating the oracle over the training
    sources (:mod:`kvray.rl.imitation`), the teacher as ``recipe`` says, written with its card into ``out``;
    with ``ensemble`` K > 1, K such models of consecutive seeds scoring their mean (:mod:`kvray.rl.reuse_ensemble`)."""
    from kvray.rl.imitation import train_reuse, training_sources
    from kvray.rl.reuse_ensemble import train_reuse_ensemble

    sources = training_sources(families, [str(t) for t in traces], train_fraction)
    settings = dict(
        rounds=rounds,
        jobs=jobs,
        record=record,
        capacities=capacity_fractions,
        say=progress,
        pool=pool,
        loads=loads,
        recipe=recipe,
    )
    if ensemble > 1:
        return train_reuse_ensemble(out, sources, ensemble, seed, **settings)
    return train_reuse(out, sources, seed, **settings)


def train_cluster_reuse_policy(
    *,
    out: Path,
    scenarios: Sequence[Path],
    bandwidth_scales: Sequence[float],
    families: Sequence[str],
    loads: Sequence[float],
    capacity_fractions: Sequence[float],
    requests: int,
    seed: int,
    rounds: int,
    record: float,
    pool: tuple[int, int, int],
    promote_gate: float | None,
    jobs: int,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """``kvray train-reuse --cluster``: the reuse model imitating Belady on every node of the
    training clusters (:mod:`kvray.rl.cluster_imitation`), ``h100-2node-train`` by default
    (the held-out clusters and bandwidths are ``cluster-eval``'s), at one cache size."""
    from kvray.resources import bundled
    from kvray.rl.cluster_imitation import train_cluster_reuse

    if len(capacity_fractions) != 1:
        raise ConfigError("--cluster trains at one cache size: give one --capacity-fraction")
    bases = [load_scenario(path) for path in scenarios or [bundled(DEFAULT_CLUSTER_SCENARIO)]]
    return train_cluster_reuse(
        out,
        scenarios_at_bandwidths(bases, bandwidth_scales),
        families=families,
        loads=loads,
        capacity_fraction=capacity_fractions[0],
        requests=requests,
        seed=seed,
        rounds=rounds,
        record=record,
        pool=pool,
        promote_gate=promote_gate,
        jobs=jobs,
        say=progress,
    )
