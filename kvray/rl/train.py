"""Training the learned selector of the adaptive policy: PPO (stable-baselines3) in the env.

The policy is :class:`~kvray.policy.experts.ExpertsPolicy`: shadow caches tell how each
expert heuristic would do on the workload seen so far, and the selector picks the expert
the real cache follows for the next window. The actor is one small MLP applied to every
expert's row (a shared scorer: the same function ranks LRU, ARC and the threshold rule by
what their rows say), added to the leader ranking
(:func:`~kvray.policy.experts.leader_scores`). A fresh :class:`RowScorer` adds nothing (its
last layer is zero), but inside PPO's policy stable-baselines3's orthogonal initialisation
redraws every layer, so the counterfactual fit starts from a random correction; left out one
training source at a time, either start fits to the same regret (docs/sim-eval). Only that scorer is kept:
it is exported to ``policy.safetensors`` and run by :class:`~kvray.policy.rl.RLPolicy` in
numpy. The critic (a baseline for PPO) is dropped.

Training data: generated workloads of every family (:data:`kvray.sim.workloads.FAMILIES`,
seeds never used for evaluation) plus the first part (by time) of each given trace
(:func:`split_by_time`); the rest of those traces, and whole held-out traces and
generator configurations, are for evaluation (``kvray eval``).

Example::
    from pathlib import Path
    from kvray.rl.train import train
    from kvray.scenario import load_scenario
    from kvray.resources import bundled

    card = train([load_scenario("h100-llama8b")], [bundled("data/traces/synthetic_trace.jsonl")],
                 timesteps=64, out=Path("policies-mine"), families=(), capacity_fractions=(0.1,),
                 episode_windows=2, progress=False)
    card["training"]["timesteps"]     # what was trained on; `kvray train` also fills card["evaluation"]
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from kvray.core.errors import ConfigError, TraceError
from kvray.policy.experts import EXPERTS, SELECTOR_FEATURES, corrected_scores, leader_scores
from kvray.policy.rl import CARD_FILE, WEIGHTS_FILE, observation_spec
from kvray.progress import progress_bar
from kvray.scenario import Scenario
from kvray.sim.workloads import FAMILIES
from kvray.traces import TraceRequest


def split_by_time(trace: Sequence[TraceRequest], train_fraction: float) -> tuple[list[TraceRequest], list[TraceRequest]]:
    """The requests before and after ``train_fraction`` of the trace's time span."""
    end = trace[-1].timestamp_ms
    cut = trace[0].timestamp_ms + train_fraction * (end - trace[0].timestamp_ms)
    first = [r for r in trace if r.timestamp_ms < cut]
    return first, list(trace[len(first) :])


class RowScorer(nn.Module):
    """Feature row -> correction to the leader ranking; ReLU MLP (what :class:`~kvray.policy.rl.MLPScorer` runs)."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(len(SELECTOR_FEATURES), hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, 1)])
        nn.init.zeros_(self.layers[-1].weight)  # no correction yet: the policy starts as follow-the-leader
        nn.init.zeros_(self.layers[-1].bias)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        x = rows
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x.squeeze(-1)


class _ScorerExtractor(nn.Module):
    """PPO's actor latent = the scores of the experts' rows; the critic sees them all."""

    def __init__(self) -> None:
        super().__init__()
        self.scorer = RowScorer()
        self.latent_dim_pi = len(EXPERTS)
        self.latent_dim_vf = 64
        self.value = nn.Sequential(nn.Linear(len(EXPERTS) * len(SELECTOR_FEATURES), 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())

    def forward_actor(self, obs: torch.Tensor) -> torch.Tensor:
        rows = obs.view(-1, len(EXPERTS), len(SELECTOR_FEATURES))
        return corrected_scores(rows, self.scorer(rows))  # as RLPolicy.best ranks them

    def forward_critic(self, obs: torch.Tensor) -> torch.Tensor:
        return self.value(obs)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.forward_actor(obs), self.forward_critic(obs)


def identity_head_policy(make_extractor: Callable[[], nn.Module]):
    """An SB3 actor-critic policy whose actor output is ``make_extractor()``'s actor latent
    itself (no extra linear head): the logits, or the Gaussian's mean, a network of ours computes."""
    from stable_baselines3.common.policies import ActorCriticPolicy

    class ScorerPolicy(ActorCriticPolicy):
        """Actor logits (or action means) are the extractor's actor latent (no extra linear head)."""

        def _build_mlp_extractor(self) -> None:
            self.mlp_extractor = make_extractor()

        def _build(self, lr_schedule) -> None:
            super()._build(lr_schedule)
            self.action_net = nn.Identity()
            self.optimizer = self.optimizer_class(self.parameters(), lr=lr_schedule(1), **self.optimizer_kwargs)

    return ScorerPolicy


def export_scorer(scorer: RowScorer, folder: Path) -> None:
    from safetensors.torch import save_file

    tensors = {
        f"layer{i}.{name}": p.detach().cpu().contiguous()
        for i, layer in enumerate(scorer.layers)
        for name, p in layer.named_parameters()
    }
    save_file(tensors, str(folder / WEIGHTS_FILE))


def training_sets(
    traces: Sequence[Path], train_fraction: float, families: Sequence[str], family_seed: int
) -> tuple[dict[str, list[TraceRequest]], list[list[TraceRequest]], list[dict]]:
    """The named training traces (each family generated, the first part of each trace),
    the held-out rests of the traces, and the card's description of the sources."""
    from kvray.sim.workloads import generate, named_workload
    from kvray.traces import read_trace

    train_sets: dict[str, list[TraceRequest]] = {}
    held_out, sources = [], []
    for i, family in enumerate(families):
        train_sets[family] = generate(named_workload(family), family_seed + i)
        sources.append({"family": family, "seed": family_seed + i, "train_requests": len(train_sets[family])})
    for path in traces:
        first, rest = split_by_time(read_trace(path), train_fraction)
        if not first:  # the held-out rest never is empty: the last request is at or after the cut
            raise TraceError(f"{path}: no requests in the first {train_fraction:g} of its time span to train on")
        train_sets[Path(path).stem] = first
        held_out.append(rest)
        sources.append({"trace": str(path), "train_requests": len(first), "held_out_requests": len(rest)})
    return train_sets, held_out, sources


def train(
    scenarios: Sequence[Scenario],
    traces: Sequence[Path],
    timesteps: int,
    out: Path,
    seed: int = 0,
    train_fraction: float = 0.6,
    capacity_fractions: Sequence[float] = (0.02, 0.05, 0.10, 0.25),
    families: Sequence[str] = tuple(FAMILIES),
    family_seed: int = 100,
    episode_windows: int = 12,
    gamma: float = 0.9,
    counterfactual_horizon: int = 8,
    counterfactual_epochs: int = 300,
    correction_decay: float = 0.0,
    progress: bool = True,
    evaluate: Callable[[Path, list[list[TraceRequest]]], dict] | None = None,
    tensorboard: Path | None = None,
    jobs: int = 1,
) -> dict:
    """Train, export the scorer and its model card into ``out``; returns the card.

    Every training trace is replayed at every capacity fraction (of its unique pages) on
    every scenario of ``scenarios`` (one node or a cluster, at the link bandwidths to train
    over: :meth:`~kvray.scenario.Scenario.with_bandwidth`), so the selector learns tight and
    loose caches of every family, fast and slow links, one node's whole stream and a
    cluster node's share of it; the first scenario's tier costs are the policy's default
    where nothing tells it the cost of a load (the runtime without a cost model). First the
    scorer is fitted to the counterfactual regrets of every expert over the next
    ``counterfactual_horizon`` windows (:mod:`kvray.rl.counterfactual`; 0 skips it), then
    PPO fine-tunes it for ``timesteps`` steps (0: none) in one environment per trace,
    fraction and one-node scenario (the environment replays one node). ``correction_decay`` penalises the
    size of the fitted correction (:func:`kvray.rl.counterfactual.fit`), pulling the
    selector toward follow-the-leader wherever the training sources disagree.
    ``evaluate(out, held_out)`` fills the card's evaluation scores.
    ``tensorboard`` is a folder for SB3's TensorBoard logs (losses, entropy, the mean
    reward per rollout), so a long run can be watched while it trains. ``jobs`` replays of
    the counterfactual collection run at once.

    The steps, in this order (the order fixes what the seed reproduces): the training sets,
    PPO and its environments (which draw the scorer's first weights), the counterfactual fit
    of that scorer, PPO's steps, the scorer and its card written out, the held-out scores.
    """
    torch.set_num_threads(1)
    single = _one_node_scenarios(scenarios)
    train_sets, held_out, sources = training_sets(traces, train_fraction, families, family_seed)
    model = _ppo(single, list(train_sets.values()), capacity_fractions, episode_windows, timesteps, gamma, seed, tensorboard)
    scorer = model.policy.mlp_extractor.scorer
    counterfactual = None
    if counterfactual_horizon > 0:
        counterfactual = _fit_to_counterfactual(
            scorer,
            list(train_sets.values()),
            capacity_fractions,
            scenarios,
            horizon=counterfactual_horizon,
            epochs=counterfactual_epochs,
            correction_decay=correction_decay,
            seed=seed,
            jobs=jobs,
        )
    started = time.time()
    curve = _run_ppo(model, timesteps, progress)
    out.mkdir(parents=True, exist_ok=True)
    export_scorer(scorer, out)
    training = {
        "scenarios": [{"name": s.name, "nodes": len(s.node_scenarios())} for s in scenarios],
        "traces": sources,
        "train_fraction_by_time": train_fraction,
        "capacity_fractions": list(capacity_fractions),
        "episode_windows": episode_windows,
        "gamma": gamma,
        "counterfactual": counterfactual,
        "timesteps": int(model.num_timesteps),
        "seed": seed,
        "wall_s": round(time.time() - started, 1),
        "curve": curve,
    }
    card = _model_card(out.name, scenarios[0], training)
    _write_card(out, card)
    if evaluate is not None:
        card["evaluation"] = evaluate(out, held_out)
        _write_card(out, card)
    return card


def _one_node_scenarios(scenarios: Sequence[Scenario]) -> list[Scenario]:
    """The scenarios PPO's environments replay: the environment replays one node."""
    single = [s for s in scenarios if len(s.node_scenarios()) == 1]
    if not single:
        raise ConfigError("give at least one one-node training scenario: the training environment replays one node")
    return single


def _ppo(
    scenarios: Sequence[Scenario],
    train_sets: Sequence[list[TraceRequest]],
    capacity_fractions: Sequence[float],
    episode_windows: int,
    timesteps: int,
    gamma: float,
    seed: int,
    tensorboard: Path | None,
):
    """PPO over one environment per one-node scenario x training trace x capacity fraction,
    its actor the row scorer (:class:`_ScorerExtractor`)."""
    import gymnasium as gym
    from stable_baselines3 import PPO
    from stable_baselines3.common.vec_env import DummyVecEnv

    import kvray.rl.env  # noqa: F401  (registers kvray/Placement-v0)
    from kvray.sim.simulator import fast_capacity

    makers = [
        (
            lambda t=t, f=f, s=s: gym.make(
                "kvray/Placement-v0",
                trace=t,
                scenario=s,
                capacities=fast_capacity(s, t, fraction=f),
                episode_windows=episode_windows,
            )
        )
        for s in scenarios
        for t in train_sets
        for f in capacity_fractions
    ]
    env = DummyVecEnv(makers)
    env.seed(seed)
    n_steps = max(4, min(16, timesteps // len(makers)))
    return PPO(
        identity_head_policy(_ScorerExtractor),
        env,
        n_steps=n_steps,
        batch_size=min(64, n_steps * len(makers)),
        n_epochs=6,
        gamma=gamma,
        gae_lambda=0.9,
        learning_rate=3e-3,
        ent_coef=0.01,
        seed=seed,
        device="cpu",
        verbose=0,
        tensorboard_log=None if tensorboard is None else str(tensorboard),
    )


def _fit_to_counterfactual(
    scorer: RowScorer,
    train_sets: Sequence[list[TraceRequest]],
    capacity_fractions: Sequence[float],
    scenarios: Sequence[Scenario],
    *,
    horizon: int,
    epochs: int,
    correction_decay: float,
    seed: int,
    jobs: int,
) -> dict:
    """Fit ``scorer`` to every expert's counterfactual regret over the next ``horizon``
    windows, replayed on every scenario; returns the card's account of the fit."""
    from kvray.rl.counterfactual import collect, fit

    started = time.time()
    rows, regret = collect(train_sets, capacity_fractions, scenarios, horizon, jobs=jobs)
    leader = np.argmax(leader_scores(rows), axis=1)
    fitted = fit(scorer, rows, regret, epochs, seed, correction_decay=correction_decay)
    return {
        "horizon_windows": horizon,
        "epochs": epochs,
        "correction_decay": correction_decay,
        "choices": len(rows),
        "follow_the_leader_regret": round(float(regret[np.arange(len(rows)), leader].mean()), 4),
        "fitted_expected_regret": round(fitted[-1], 4),
        "wall_s": round(time.time() - started, 1),
    }


def _run_ppo(model, timesteps: int, progress: bool) -> list[dict]:
    """``timesteps`` PPO steps (0: none); returns the mean reward of each rollout."""
    curve: list[dict] = []
    if timesteps > 0:
        with progress_bar(timesteps, "train", enabled=progress) as tick:  # on stderr: stdout stays for --json
            model.learn(total_timesteps=timesteps, callback=_reward_curve(curve, tick))
    return curve


def _reward_curve(curve: list[dict], tick: Callable[[int], None] | None):
    """An SB3 callback appending each rollout's mean reward to ``curve`` and logging it to
    TensorBoard (episodes are long: SB3's ep_rew_mean lags), ticking the progress bar per step."""
    from stable_baselines3.common.callbacks import BaseCallback

    class RewardCurve(BaseCallback):
        def _on_rollout_end(self) -> None:
            mean_reward = float(np.mean(self.model.rollout_buffer.rewards))
            curve.append({"timesteps": int(self.num_timesteps), "mean_reward": mean_reward})
            self.logger.record("rollout/mean_reward", mean_reward)

        def _on_step(self) -> bool:
            if tick:
                tick(self.num_timesteps - 1)
            return True

    return RewardCurve()


def _model_card(name: str, scenario: Scenario, training: dict) -> dict:
    """The card written beside the weights: what the policy is, what it observes, its
    default tier costs (from ``scenario``, the first trained on) and how it was trained."""
    return {
        "name": name,
        "algorithm": "a shared row scorer corrects the follow-the-leader ranking of the expert heuristics, one "
        "choice per window; fitted to the counterfactual regret of every expert over the next windows (their "
        "shadow caches' modeled TTFT), then PPO (stable-baselines3) on the realised modeled TTFT of the window",
        "observation": observation_spec(),
        "scenario": scenario.name,
        "tier_cost": tier_costs(scenario),
        "training": training,
    }


def tier_costs(scenario: Scenario) -> dict[str, float]:
    """Each tier's page load time relative to recomputing the page: the policy's default
    view of bandwidth where nothing tells it (the runtime without a cost model)."""
    from kvray.sim.cost import CostModel

    return {t.label: cost for t, cost in CostModel(scenario).tier_cost(scenario.capacities()).items()}


def _write_card(out: Path, card: dict) -> None:
    (out / CARD_FILE).write_text(json.dumps(card, indent=2) + "\n")
