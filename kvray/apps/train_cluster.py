"""``kvray train --cluster``: the cluster router (a PPO residual on the cost router) from the
command line's training scenarios, link bandwidths, families and cache size.

Every ``--scenario`` (``h100-2node-train`` by default: the held-out clusters are
``cluster-eval``'s) is trained on at every ``--bandwidth-scale``, every family's generated
trace at loads 0.6 and 0.85 (:func:`kvray.rl.cluster_train.train_router`). Held-out
scores come from ``kvray cluster-eval --policy lru+rl-router:OUT`` (docs/sim-eval).

Example::

    card = train_router_policy(out=Path("policies/mine"), scenarios=[], bandwidth_scales=[1.0], traces=[],
                               families=["chat"], capacity_fractions=[0.05], timesteps=4096, seed=0)
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from kvray.apps.train import scenarios_at_bandwidths
from kvray.core.errors import ConfigError
from kvray.resources import bundled
from kvray.scenario import DEFAULT_CLUSTER_SCENARIO, load_scenario

# PPO's weights depend on the CPU kernels MKL and ATen pick for this processor (AVX-512 variants
# round differently from one CPU model to the next: the router shipped on 2026-12-03 did not rebuild
# on the next day's machine, its rewards parting after five rollouts). `kvray train --cluster` asks
# for MKL's compatible path and ATen's scalar kernels, which made the rebuild hold on the machines
# it met until 2026-12-05, but not on an AMD EPYC (Zen 4), where the fourth rollout parts even so
# (docs/sim-eval/README.md, "What the rebuild test checks"). Both are read when torch loads: a
# process that loaded it already keeps its own kernels, and the card's ``training.numerics`` says
# which were used.
PORTABLE_NUMERICS = {"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "default"}


def portable_numerics() -> None:
    """Ask for :data:`PORTABLE_NUMERICS` where torch is not loaded yet (a setting the user gave stays)."""
    if "torch" not in sys.modules:
        for name, value in PORTABLE_NUMERICS.items():
            os.environ.setdefault(name, value)


def train_router_policy(
    *,
    out: Path,
    scenarios: Sequence[Path],
    bandwidth_scales: Sequence[float],
    traces: Sequence[Path],
    families: Sequence[str],
    capacity_fractions: Sequence[float],
    timesteps: int,
    seed: int,
    node_policy: str = "lru",
    shared_disk: bool = False,
) -> dict:
    """Train the router the flags ask for into ``out``, over ``node_policy`` on every node
    (and, with ``shared_disk``, each scenario also with its drives on one channel:
    :meth:`~kvray.scenario.Scenario.with_shared_disk`); returns its card."""
    from kvray.policy import make_policy

    portable_numerics()
    from kvray.rl.cluster_train import train_router

    if traces:
        raise ConfigError("--cluster trains on the generated families (--family): leave out --trace")
    if len(capacity_fractions) != 1:
        raise ConfigError("--cluster trains at one cache size: give one --capacity-fraction")
    make_policy(node_policy)  # an unknown name fails before the traces are built
    bases = [load_scenario(path) for path in scenarios or [bundled(DEFAULT_CLUSTER_SCENARIO)]]
    trained_on = scenarios_at_bandwidths(bases, bandwidth_scales)
    if shared_disk:
        trained_on += [s.with_shared_disk() for s in trained_on]
    return train_router(
        trained_on,
        timesteps,
        Path(out),
        seed,
        families=families,
        capacity_fraction=capacity_fractions[0],
        policy=node_policy,
    )
