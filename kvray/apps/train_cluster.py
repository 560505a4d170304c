"""``kvray train --cluster``: the cluster router (a PPO residual on the cost router) from the
command line's training scenarios, link bandwidths, families and cache size.

Every ``--scenario`` (``h100-2node-train`` by default: the held-out clusters are
``cluster-eval``'s) is trained on at every ``--bandwidth-scale``, every family's generated
trace at loads 0.6 and 0.85 (:func:`kvray.rl.cluster_train.train_router`). Held-out
scores come from ``kvray cluster-eval --policy lru+rl-router:OUT`` (docs/sim-eval).

Example::

    card = train_router_policy(TrainRequest(cluster=True, out=Path("policies/mine"), timesteps=4096, ...))
"""

from __future__ import annotations

from pathlib import Path

from kvray.apps.train import TrainRequest, scenarios_at_bandwidths
from kvray.core.errors import ConfigError
from kvray.resources import bundled
from kvray.scenario import load_scenario

DEFAULT_CLUSTER_SCENARIO = "simulations/h100-2node-train.yaml"


def train_router_policy(request: TrainRequest) -> dict:
    """Train the router ``request`` asks for into ``request.out``; returns its card."""
    from kvray.rl.cluster_train import train_router

    if request.traces:
        raise ConfigError("--cluster trains on the generated families (--family): leave out --trace")
    if len(request.capacity_fractions) != 1:
        raise ConfigError("--cluster trains at one cache size: give one --capacity-fraction")
    bases = [load_scenario(path) for path in request.scenarios or [bundled(DEFAULT_CLUSTER_SCENARIO)]]
    return train_router(
        scenarios_at_bandwidths(bases, request.bandwidth_scales),
        request.timesteps,
        Path(request.out),
        request.seed,
        families=request.families,
        capacity_fraction=request.capacity_fractions[0],
    )
