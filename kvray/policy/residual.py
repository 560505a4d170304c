"""The learned cluster policy: a residual on the cost router, trained by PPO in the cluster simulator.

:class:`ResidualRouter` is :class:`~kvray.policy.cluster.CostRouter` with three deviations
a ``decide`` function chooses per request, from an observation of what the runtime can
also observe (:data:`ROW_FEATURES`, one row per node, and :data:`REQUEST_FEATURES`):

- ``route``: a residual per node added to the cost router's cost (in units of the
  request's full recompute time), the node with the least sum serving;
- ``load_pages``: the share of the cached prefix to load, ``1 + load`` clipped to [0, 1]
  (the rest of the prefix is recomputed);
- ``prefetch``: on when its output is above 0.

The zero decision reproduces the cost router exactly (same choice, same tie-breaks; every
hit page loaded; no prefetch), so training starts where the best heuristic is and learns
only deviations that pay. ``decide`` is the trained network here (:class:`RLRouter`, numpy,
weights in ``policies/cluster-default``) and the learner in the training environment
(:mod:`kvray.rl.cluster_env`), which shows the same observation.

Example::
    from kvray.policy.cluster import make_cluster_policy

    policy = make_cluster_policy("rl-router")    # the shipped weights; rl-router:FOLDER: one `kvray train --cluster` wrote
    policy.card["training"]["timesteps"]
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvray.core.errors import ConfigError, PolicyError
from kvray.policy.cluster import ClusterView, CostRouter, RequestView
from kvray.policy.rl import MLPScorer
from kvray.resources import shipped_or_given

ROW_FEATURES = (
    "present",  # 1 for a node (0: padding in the training environment)
    "front",  # the front end's node for this request
    "cost_router_pick",  # the node the cost router would choose
    "backlog",  # engine backlog / the request's full recompute time
    "cost",  # the cost router's cost / the request's full recompute time
    "cost_above_best",  # that cost minus the least one, same unit
    "local_hit_share",  # cached prefix pages on this node / request pages
    "local_device_share",  # of those, in the device tier
    "local_host_share",  # in host memory
    "local_disk_share",  # on NVMe
    "remote_hit_share",  # cached prefix pages elsewhere / request pages
    "free_device",
    "free_host",
    "free_disk",
    "nic_in_util",
    "nic_out_util",
    "pcie_util",
    "disk_read_util",
    "disk_write_util",
)
REQUEST_FEATURES = (
    "log_pages",  # log(1 + request pages) / log(1 + 4096)
    "hit_share",  # cached prefix pages / request pages
    "heat",  # log(1 + requests seen with this root page) / log(1 + 1000)
    "page_prefill_ms",  # recomputing one page on these engines, ms / 100
)
ACTION_VERBS = ("load", "prefetch")  # after one residual per node
CLIP = 10.0
DEFAULT_ROUTER = "cluster-default"  # policies/cluster-default (kvray.resources)
WEIGHTS_FILE = "policy.safetensors"
CARD_FILE = "card.json"

Decision = tuple[np.ndarray, float, float]  # (residual per node, load, prefetch)
Decide = Callable[[np.ndarray, np.ndarray], Decision]


def observation_spec() -> dict:
    """What a router's weights must have been trained on to be usable here."""
    return {"row_features": list(ROW_FEATURES), "request_features": list(REQUEST_FEATURES), "verbs": list(ACTION_VERBS)}


def zero_decision(rows: np.ndarray, request: np.ndarray) -> Decision:
    """No deviation: the cost router's route, every hit page loaded, no prefetch."""
    return np.zeros(len(rows), np.float32), 0.0, 0.0


class ResidualRouter(CostRouter):
    """The cost router plus the deviations ``decide`` returns for each request's observation."""

    name = "residual-router"

    def __init__(self, decide: Decide = zero_decision, remote_weight: float = 0.5, local_limit: int = 1024) -> None:
        super().__init__(remote_weight, local_limit)
        self.decide = decide
        self._heat: dict[int, int] = {}
        self._verbs: tuple[tuple[int, ...], float, bool] = ((), 1.0, False)
        self._state_of: ClusterView | None = None
        self._state = np.zeros((0, 8), np.float32)

    def observe(self, request: RequestView, cluster: ClusterView) -> tuple[np.ndarray, np.ndarray, list[float]]:
        """The rows (one per node), the request's features and the cost router's cost per node.
        Counts the request towards its root page's heat (call once per request)."""
        keys, hits = request.keys, request.hit_nodes
        n_pages, n_hits = max(len(keys), 1), len(hits)
        page_ms = cluster.page_prefill_ms or 1.0
        missing = len(keys) - n_hits
        local = Counter(hits)
        by_tier = Counter(zip(hits, request.hit_tiers))
        costs, best, best_cost = [], 0, float("inf")
        for i, node in enumerate(cluster.nodes):  # CostRouter.route's sum, to the bit
            cost = node.backlog_ms + page_ms * (missing + self.remote_weight * (n_hits - local[node.name]))
            costs.append(cost)
            if cost < best_cost or (cost == best_cost and node.name == request.requester):
                best, best_cost = i, cost
        unit = page_ms * n_pages
        requester = request.requester
        flat: list[float] = []
        for i, (node, cost) in enumerate(zip(cluster.nodes, costs)):
            name, here = node.name, local[node.name]
            flat += (
                1.0,
                name == requester,
                i == best,
                node.backlog_ms / unit,
                cost / unit,
                (cost - best_cost) / unit,
                here / n_pages,
                by_tier[name, "device"] / n_pages,
                by_tier[name, "host"] / n_pages,
                by_tier[name, "disk"] / n_pages,
                (n_hits - here) / n_pages,
            )
        rows = np.array(flat, np.float32).reshape(len(costs), -1)
        rows = np.concatenate([rows, self._node_state(cluster)], axis=1)
        np.clip(rows, -CLIP, CLIP, out=rows)
        heat = 0
        if keys:
            heat = self._heat[keys[0]] = self._heat.get(keys[0], 0) + 1
        features = np.array(
            [
                math.log1p(len(keys)) / math.log1p(4096),
                n_hits / n_pages,
                math.log1p(heat) / math.log1p(1000),
                min(page_ms / 100.0, CLIP),
            ],
            np.float32,
        )  # each in [0, 1] but the last, bounded
        return rows, features, costs

    def _node_state(self, cluster: ClusterView) -> np.ndarray:
        """The request-independent columns (free shares, link utilisations), per cluster view:
        a view is refreshed every ``view_refresh_ms``, not every request."""
        if cluster is not self._state_of:
            self._state_of = cluster
            self._state = np.array(
                [
                    (
                        n.free_share.get("device", 0.0),
                        n.free_share.get("host", 0.0),
                        n.free_share.get("disk", 0.0),
                        n.nic_in_util,
                        n.nic_out_util,
                        n.pcie_util,
                        n.disk_read_util,
                        n.disk_write_util,
                    )
                    for n in cluster.nodes
                ],
                np.float32,
            )
        return self._state

    def route(self, request: RequestView, cluster: ClusterView) -> str:
        rows, features, costs = self.observe(request, cluster)
        residual, load, prefetch = self.decide(rows, features)
        unit = (cluster.page_prefill_ms or 1.0) * max(len(request.keys), 1)
        best, best_cost = None, float("inf")
        for node, cost, extra in zip(cluster.nodes, costs, np.asarray(residual, np.float64).tolist()):
            cost = cost + extra * unit
            if cost < best_cost or (cost == best_cost and node.name == request.requester):
                best, best_cost = node.name, cost
        self._verbs = (request.keys, min(max(1.0 + float(load), 0.0), 1.0), float(prefetch) > 0.0)
        return best

    def load_pages(self, request: RequestView, cluster: ClusterView) -> int:
        keys, share, _ = self._verbs
        hits = len(request.hit_nodes)
        if keys != request.keys or share >= 1.0:
            return hits
        return int(math.floor(share * hits + 0.5))

    def prefetch(self, request: RequestView, cluster: ClusterView) -> bool:
        keys, _, prefetch = self._verbs
        return prefetch and keys == request.keys


class RouterNetwork:
    """The trained decision, numpy only: a scorer shared by every node's row (its residual),
    and a head over the request's features and the cost router's pick's row (load, prefetch).

    Example::

        net = RouterNetwork.load("cluster-default")
        residual, load, prefetch = net(rows, features)
    """

    def __init__(self, route: MLPScorer, verbs: MLPScorer) -> None:
        self.route = route
        self.verbs = verbs

    def __call__(self, rows: np.ndarray, features: np.ndarray) -> Decision:
        pick = rows[int(rows[:, 2].argmax())]
        head = self.verbs.forward(np.concatenate([features, pick])[None, :])[0]
        return self.route.forward(rows)[:, 0], float(head[0]), float(head[1])

    @classmethod
    def load(cls, path: str | Path) -> tuple[RouterNetwork, dict]:
        from safetensors import SafetensorError
        from safetensors.numpy import load_file

        try:
            path = shipped_or_given(path, "policies")
        except ConfigError:
            raise PolicyError(f"{path}: not a cluster policy: no such folder, nor one shipped by that name") from None
        weights_path, card_path = path / WEIGHTS_FILE, path / CARD_FILE
        if not weights_path.is_file() or not card_path.is_file():
            raise PolicyError(f"{path}: not a cluster policy: needs {WEIGHTS_FILE} and {CARD_FILE}")
        try:
            card = json.loads(card_path.read_text())
        except (json.JSONDecodeError, OSError) as exc:
            raise PolicyError(f"{card_path}: unreadable card ({exc})") from None
        spec = card.get("observation") if isinstance(card, dict) else None
        if spec != observation_spec():
            raise PolicyError(f"{card_path}: trained on observation {spec}, this kvray builds {observation_spec()}")
        try:
            tensors = load_file(str(weights_path))
        except (SafetensorError, OSError) as exc:
            raise PolicyError(f"{weights_path}: unreadable weights ({exc})") from None

        def mlp(prefix: str, inputs: int, outputs: int) -> MLPScorer:
            n = sum(1 for k in tensors if k.startswith(f"{prefix}.") and k.endswith(".weight"))
            try:
                weights = [tensors[f"{prefix}.layer{i}.weight"] for i in range(n)]
                biases = [tensors[f"{prefix}.layer{i}.bias"] for i in range(n)]
            except KeyError as exc:
                raise PolicyError(f"{weights_path}: missing tensor {exc}") from None
            if not weights or weights[0].shape[1] != inputs or weights[-1].shape[0] != outputs:
                raise PolicyError(f"{weights_path}: {prefix} does not take {inputs} features to {outputs} outputs")
            return MLPScorer(weights, biases)

        route = mlp("route", len(ROW_FEATURES), 1)
        verbs = mlp("verbs", len(REQUEST_FEATURES) + len(ROW_FEATURES), len(ACTION_VERBS))
        return cls(route, verbs), card


class RLRouter(ResidualRouter):
    """The residual router with trained weights (``policies/cluster-default`` unless a folder is given)."""

    name = "rl-router"

    def __init__(self, path: str | Path = DEFAULT_ROUTER, local_limit: int = 1024) -> None:
        network, self.card = RouterNetwork.load(path)
        super().__init__(network, local_limit=local_limit)
