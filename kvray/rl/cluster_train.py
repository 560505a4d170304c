"""Training the cluster router: PPO (stable-baselines3) as a residual on the cost router.

The actor is the network :class:`~kvray.policy.residual.RouterNetwork` runs in numpy: one
MLP shared by every node's row (its residual on the cost router's cost) and a head over
the request's features and the cost router's pick's row (the share of the hit to load,
prefetch). Both last layers start at zero and SB3's orthogonal initialisation is off, so
the policy's mean action starts as the cost router exactly; PPO's Gaussian noise explores
around it. The critic is a plain MLP over the whole observation and is dropped.

Training data: the generated workload families (:data:`kvray.sim.workloads.FAMILIES`, seeds
never evaluated on) on the training scenarios (``h100-2node-train`` by default) at several
link bandwidths, each trace's arrival gaps scaled to each training load (LRU's busy share of
the prefill engines, :mod:`kvray.sim.load`). The held-out clusters (``h100-4node-skewed``,
``h100-8node-hetero``), bandwidths (0.5x, 2x) and traces are ``kvray cluster-eval``'s.

Example::
    from pathlib import Path
    from kvray.rl.cluster_train import train_router
    from kvray.scenario import load_scenario

    card = train_router([load_scenario("h100-2node-train")], timesteps=64, out=Path("policies-mine"),
                        families=("chat",), loads=(0.6,), requests=120, episode_requests=16, n_steps=32, progress=False)
    card["training"]["timesteps"]
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from kvray.policy.residual import ACTION_VERBS, CARD_FILE, REQUEST_FEATURES, ROW_FEATURES, WEIGHTS_FILE, observation_spec
from kvray.progress import progress_bar
from kvray.rl.cluster_env import MAX_NODES, observation_size
from kvray.rl.train import _reward_curve, identity_head_policy
from kvray.scenario import Scenario
from kvray.sim.workloads import FAMILIES
from kvray.traces import TraceRequest


def _mlp(inputs: int, hidden: int, outputs: int) -> nn.ModuleList:
    layers = nn.ModuleList([nn.Linear(inputs, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, outputs)])
    nn.init.zeros_(layers[-1].weight)  # no deviation yet: the policy starts as the cost router
    nn.init.zeros_(layers[-1].bias)
    return layers


def _run(layers: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for i, layer in enumerate(layers):
        x = layer(x)
        if i < len(layers) - 1:
            x = torch.relu(x)
    return x


class RouterActor(nn.Module):
    """The actor: per-node residuals from the shared row MLP, then the verbs' head."""

    def __init__(self, hidden: int = 32, max_nodes: int = MAX_NODES) -> None:
        super().__init__()
        self.max_nodes = max_nodes
        self.route = _mlp(len(ROW_FEATURES), hidden, 1)
        self.verbs = _mlp(len(REQUEST_FEATURES) + len(ROW_FEATURES), hidden, len(ACTION_VERBS))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        rows = obs[:, : self.max_nodes * len(ROW_FEATURES)].view(-1, self.max_nodes, len(ROW_FEATURES))
        features = obs[:, self.max_nodes * len(ROW_FEATURES) :]
        pick = (rows * (rows[:, :, 2:3] > 0.5)).sum(dim=1)  # the cost router's pick's row
        residual = _run(self.route, rows).squeeze(-1)
        return torch.cat([residual, _run(self.verbs, torch.cat([features, pick], dim=1))], dim=1)


class _RouterExtractor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.actor = RouterActor()
        self.latent_dim_pi = MAX_NODES + len(ACTION_VERBS)
        self.latent_dim_vf = 64
        self.value = nn.Sequential(nn.Linear(observation_size(), 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())

    def forward_actor(self, obs: torch.Tensor) -> torch.Tensor:
        return self.actor(obs)

    def forward_critic(self, obs: torch.Tensor) -> torch.Tensor:
        return self.value(obs)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.forward_actor(obs), self.forward_critic(obs)


def export_actor(actor: RouterActor, folder: Path) -> None:
    from safetensors.torch import save_file

    tensors = {
        f"{head}.layer{i}.{name}": p.detach().cpu().contiguous()
        for head in ("route", "verbs")
        for i, layer in enumerate(getattr(actor, head))
        for name, p in layer.named_parameters()
    }
    save_file(tensors, str(folder / WEIGHTS_FILE))


def training_traces(
    scenarios: Sequence[Scenario],
    families: Sequence[str],
    family_seed: int,
    loads: Sequence[float],
    capacity_fraction: float,
    requests: int,
) -> tuple[list[tuple[Scenario, list[TraceRequest], list]], list[dict]]:
    """(scenario, trace at a load, capacities) per scenario x family x load, and the card's account."""
    from kvray.sim.load import find_load
    from kvray.sim.node import node_capacities
    from kvray.sim.workloads import generate, named_workload

    cells, sources = [], []
    for i, family in enumerate(families):
        trace = generate(named_workload(family), family_seed + i)[:requests]
        for scenario in scenarios:
            capacities = node_capacities(scenario, trace, capacity_fraction)
            for load in loads:
                found = find_load(trace, scenario, load, capacities)
                cells.append((scenario, found.trace, capacities))
                sources.append(
                    {
                        "family": family,
                        "seed": family_seed + i,
                        "requests": len(trace),
                        "scenario": scenario.name,
                        "load": load,
                        "arrival_scale": round(found.factor, 4),
                    }
                )
    return cells, sources


def train_router(
    scenarios: Sequence[Scenario],
    timesteps: int,
    out: Path,
    seed: int = 0,
    families: Sequence[str] = tuple(FAMILIES),
    family_seed: int = 100,
    loads: Sequence[float] = (0.6, 0.85),
    capacity_fraction: float = 0.05,
    requests: int = 1200,
    episode_requests: int = 256,
    n_steps: int = 128,
    gamma: float = 0.9,
    policy: str = "lru",
    progress: bool = True,
    learning_rate: float = 3e-4,
    n_epochs: int = 4,
) -> dict:
    """Train the router's residual with PPO, export it and its card into ``out``; returns the card.

    The steps, in this order (the order fixes what the seed reproduces): the training
    traces and their loads, PPO and its environments (one per cell, in a DummyVecEnv), PPO's
    steps, the actor and its card written out."""
    import gymnasium as gym
    from stable_baselines3 import PPO
    from stable_baselines3.common.vec_env import DummyVecEnv

    import kvray.rl.cluster_env  # noqa: F401  (registers kvray/Cluster-v0)

    torch.set_num_threads(1)
    cells, sources = training_traces(scenarios, families, family_seed, loads, capacity_fraction, requests)
    env = DummyVecEnv(
        [
            (
                lambda s=s, t=t, c=c: gym.make(
                    "kvray/Cluster-v0", trace=t, scenario=s, policy=policy, capacities=c, episode_requests=episode_requests
                )
            )
            for s, t, c in cells
        ]
    )
    env.seed(seed)
    model = PPO(
        identity_head_policy(_RouterExtractor),
        env,
        n_steps=n_steps,
        batch_size=min(256, n_steps * len(cells)),
        n_epochs=n_epochs,
        gamma=gamma,
        gae_lambda=0.9,
        learning_rate=learning_rate,
        ent_coef=0.0,
        seed=seed,
        device="cpu",
        verbose=0,
        policy_kwargs={"ortho_init": False, "log_std_init": -1.5},
    )
    started = time.time()
    curve: list[dict] = []
    if timesteps > 0:
        with progress_bar(timesteps, "train", enabled=progress) as tick:
            model.learn(total_timesteps=timesteps, callback=_reward_curve(curve, tick))
    actor = model.policy.mlp_extractor.actor
    out.mkdir(parents=True, exist_ok=True)
    export_actor(actor, out)
    card = {
        "name": out.name,
        "algorithm": "PPO (stable-baselines3) residual on the cost router: a row MLP shared by every node adds a "
        "residual to the router's per-node cost; a head over the request and the router's pick sets the share of "
        "the hit to load and prefetch; zero output is the cost router exactly. Reward: minus each request's "
        "realised modeled TTFT (queueing included) over the trace's mean full-prefill time, discounted",
        "observation": observation_spec(),
        "training": {
            "scenarios": sorted({s.name for s in scenarios}),
            "sources": sources,
            "per_node_policy": policy,
            "capacity_fraction": capacity_fraction,
            "episode_requests": episode_requests,
            "environments": len(cells),
            "n_steps": n_steps,
            "n_epochs": n_epochs,
            "learning_rate": learning_rate,
            "gamma": gamma,
            "timesteps": int(model.num_timesteps),
            "seed": seed,
            "wall_s": round(time.time() - started, 1),
            "log_std": [round(float(x), 4) for x in model.policy.log_std.detach()],
            "curve": curve,
        },
    }
    write_card(out, card)
    return card


def write_card(out: Path, card: dict) -> None:
    (out / CARD_FILE).write_text(json.dumps(card, indent=2) + "\n")
