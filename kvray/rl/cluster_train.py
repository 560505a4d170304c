"""Training the cluster router: PPO (stable-baselines3) as a residual on the cost router.

The actor is the network :class:`~kvray.policy.residual.RouterNetwork` runs in numpy: a
ReLU MLP from the observation to the logits of every discrete head (which of the cost
router's cheapest nodes serves, the share of the hit to load, prefetch yes/no, replicate
yes/no, the serving node's NVMe write budget). Its last layer starts with zero weights and a
bias that favours choice 0 in each head (:data:`HEAD_PRIOR`, :data:`HEAD_PRIORS`), so the
deployed policy (each head's most likely choice) starts
as the cost router exactly while PPO's samples try the other choices a share of the time.
The critic is a plain MLP over the observation and is dropped.

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
import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from kvray.policy.residual import ACTION_HEADS, CARD_FILE, WEIGHTS_FILE, observation_size, observation_spec
from kvray.progress import progress_bar
from kvray.rl.train import _reward_curve, identity_head_policy
from kvray.scenario import Scenario
from kvray.sim.workloads import FAMILIES
from kvray.traces import TraceRequest

HEAD_PRIOR = 1.5  # the initial logit of choice 0 over the others in every head: the cost router, explored around
# Heads explored less often: a write budget holds until a later decision changes it, so one
# explored at 47% of requests (the prior above, five choices) changed about every other
# request of its node and no budget lasted long enough to show what it does; at 3.0, 17%.
HEAD_PRIORS = {"write_budget": 3.0}


class RouterActor(nn.Module):
    """The actor: observation -> every head's logits (concatenated, :data:`ACTION_HEADS`' order)."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        outputs = sum(size for _, size in ACTION_HEADS)
        self.layers = nn.ModuleList(
            [nn.Linear(observation_size(), hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, outputs)]
        )
        last = self.layers[-1]
        nn.init.zeros_(last.weight)  # no deviation yet: the most likely action is the cost router's
        with torch.no_grad():
            last.bias.zero_()
            at = 0
            for name, size in ACTION_HEADS:
                last.bias[at] = HEAD_PRIORS.get(name, HEAD_PRIOR)
                at += size

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        x = obs
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


class _RouterExtractor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.actor = RouterActor()
        self.latent_dim_pi = sum(size for _, size in ACTION_HEADS)
        self.latent_dim_vf = 64
        self.value = nn.Sequential(nn.Linear(observation_size(), 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())

    def forward_actor(self, obs: torch.Tensor) -> torch.Tensor:
        return self.actor(obs)

    def forward_critic(self, obs: torch.Tensor) -> torch.Tensor:
        return self.value(obs)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.forward_actor(obs), self.forward_critic(obs)


def router_policy() -> type:
    """SB3's actor-critic policy for the router: the actor's logits are :class:`RouterActor`'s
    output itself, so ``predict(deterministic=True)`` is each head's argmax of what
    :class:`~kvray.policy.residual.RouterNetwork` computes from the exported weights."""
    return identity_head_policy(_RouterExtractor)


def export_actor(actor: RouterActor, folder: Path) -> None:
    from safetensors.torch import save_file

    tensors = {
        f"layer{i}.{name}": p.detach().cpu().contiguous()
        for i, layer in enumerate(actor.layers)
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
    n_steps: int = 64,
    gamma: float = 0.9,
    policy: str = "lru",
    progress: bool = True,
    learning_rate: float = 2e-3,
    n_epochs: int = 10,
    warmup_requests: int = 256,
    engine_weight: float = 4.0,
) -> dict:
    """Train the router's residual with PPO, export it and its card into ``out``; returns the card.

    The steps, in this order (the order fixes what the seed reproduces): the training
    traces and their loads, PPO and its environments (one per cell, in a DummyVecEnv), PPO's
    steps, the actor and its card written out. The card on disk holds only what the seed
    fixes (the folder is reproducible byte for byte); the returned one adds ``wall_s``."""
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
                    "kvray/Cluster-v0",
                    trace=t,
                    scenario=s,
                    policy=policy,
                    capacities=c,
                    episode_requests=episode_requests,
                    warmup_requests=warmup_requests,
                    engine_weight=engine_weight,
                )
            )
            for s, t, c in cells
        ]
    )
    env.seed(seed)
    rollout = n_steps * len(cells)
    model = PPO(
        router_policy(),
        env,
        n_steps=n_steps,
        batch_size=rollout // max(1, round(rollout / 256)),  # minibatches of about 256, none truncated when it divides
        n_epochs=n_epochs,
        gamma=gamma,
        gae_lambda=0.9,
        learning_rate=learning_rate,
        ent_coef=0.0,
        seed=seed,
        device="cpu",
        verbose=0,
        policy_kwargs={"ortho_init": False},
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
        "algorithm": "PPO (stable-baselines3) residual on the cost router: an MLP over the request and the cost "
        "router's cheapest nodes picks, per discrete head, the serving candidate, the share of the hit to load, "
        "prefetch yes/no, replicate yes/no and the serving node's NVMe write budget; choice 0 everywhere is the cost "
        "router exactly. Reward: minus each "
        "request's realised modeled TTFT (queueing included) plus engine_weight x the time it held its prefill engine "
        "(the delay it imposes on the requests queued behind it), over the trace's mean full-prefill time, discounted",
        "observation": observation_spec(),
        "training": {
            "scenarios": sorted({s.name for s in scenarios}),
            "sources": sources,
            "per_node_policy": policy,
            "capacity_fraction": capacity_fraction,
            "episode_requests": episode_requests,
            "warmup_requests": warmup_requests,
            "environments": len(cells),
            "n_steps": n_steps,
            "n_epochs": n_epochs,
            "learning_rate": learning_rate,
            "gamma": gamma,
            "engine_weight": engine_weight,
            "head_priors": {name: HEAD_PRIORS.get(name, HEAD_PRIOR) for name, _ in ACTION_HEADS},
            # which kernels computed it (kvray.apps.train_cluster.PORTABLE_NUMERICS): the weights rebuild byte for byte with
            # the same on a CPU that rounds as the training one did
            "numerics": {"mkl_cbwr": os.environ.get("MKL_CBWR"), "aten_cpu_capability": torch.backends.cpu.get_cpu_capability()},
            "timesteps": int(model.num_timesteps),
            "seed": seed,
            "curve": curve,
        },
    }
    write_card(out, card)
    card["training"]["wall_s"] = round(time.time() - started, 1)
    return card


def write_card(out: Path, card: dict) -> None:
    (out / CARD_FILE).write_text(json.dumps(card, indent=2) + "\n")
