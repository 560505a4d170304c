"""The learned cluster policy: a residual on the cost router, trained by PPO in the cluster simulator.

:class:`ResidualRouter` is :class:`~kvray.policy.cluster.CostRouter` with five discrete
deviations a ``decide`` function picks per request (:data:`ACTION_HEADS`), from an
observation of what the runtime can also observe (:data:`REQUEST_FEATURES`, then
:data:`CANDIDATE_FEATURES` for each of the cost router's :data:`CANDIDATES` cheapest nodes,
the cheapest first):

- ``node``: which candidate serves (0: the cost router's pick);
- ``load``: the share of the cached prefix to load (:data:`LOAD_SHARES`; 0: all of it, the
  rest of the prefix is recomputed);
- ``prefetch``: load the prefix while the request waits in the queue (1) or not (0);
- ``replicate``: copy the hit chain's pages the serving node lacks to it (1) or not (0);
- ``write_budget``: the serving node's NVMe write budget from this request on, a share of its
  drive's write rate, or no cap (:data:`WRITE_BUDGET_CHOICES`; 0: keep the node's budget, none
  until one is set). Demotions and new pages that the drive takes delay the loads that read
  it (on a shared channel) and the PCIe link they cross; a budget trades those writes for
  later misses, which pays on slow or busy drives and costs on fast idle ones: a choice for
  the state, not a constant. A budget holds until a later decision for that node changes it:
  one lifted at the next request would never refuse a page (a new budget starts with a
  second's burst), so neither its effect nor PPO's signal for it would exist.

Choice 0 in every head reproduces the cost router exactly (same choice, same tie-breaks;
every hit page loaded; no prefetch; no replica; no write budget ever set), so training starts where the best
heuristic is and learns only deviations that pay. Discrete heads, rather than thresholds
on Gaussian outputs, let PPO see what one yes/no is worth. ``decide`` is the trained network
here (:class:`RLRouter`, numpy, weights in ``policies/cluster-default``) and the learner in
the training environment (:mod:`kvray.rl.cluster_env`), which shows the same observation.

Example::
    from kvray.policy.cluster import make_cluster_policy

    policy = make_cluster_policy("rl-router")    # the shipped weights; rl-router:FOLDER: one `kvray train --cluster` wrote
    policy.card["training"]["timesteps"]
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from kvray.core.errors import ConfigError, PolicyError
from kvray.policy.cluster import ClusterView, CostRouter, NodeView, RequestView, budget_rate
from kvray.resources import shipped_or_given

REQUEST_FEATURES = (
    "log_pages",  # log(1 + request pages) / log(1 + 4096)
    "hit_share",  # cached prefix pages / request pages
    "heat",  # log(1 + requests seen with this root page) / log(1 + 1000)
    "page_prefill_ms",  # recomputing one page on these engines, ms / 100
    "nodes",  # nodes in the cluster / 8
    "mean_backlog",  # mean engine backlog over the nodes / the request's full recompute time
)
CANDIDATE_FEATURES = (
    "present",  # 1 for a candidate (0: the cluster has fewer nodes)
    "front",  # the front end's node for this request
    "backlog",  # engine backlog / the request's full recompute time
    "cost_above_best",  # the cost router's cost minus the least one, same unit
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
    "write_budget",  # the budget the router's decisions left this node, a share of its drive's write rate (1: none)
)
CANDIDATES = 2  # the cost router's best nodes the router chooses between (the cheapest first)
LOAD_SHARES = (1.0, 0.75, 0.5, 0.0)  # of the cached prefix, loaded (the rest recomputed)
# the serving node's write budget: keep it, lift it, or a share of the drive's write rate
WRITE_BUDGET_CHOICES = ("keep", "none", 0.5, 0.2, 0.05)
ACTION_HEADS = (
    ("node", CANDIDATES),
    ("load", len(LOAD_SHARES)),
    ("prefetch", 2),
    ("replicate", 2),
    ("write_budget", len(WRITE_BUDGET_CHOICES)),
)
CLIP = 10.0
LOG_PAGES, LOG_HEAT = math.log1p(4096), math.log1p(1000)
DEFAULT_ROUTER = "cluster-default"  # policies/cluster-default (kvray.resources)
WEIGHTS_FILE = "policy.safetensors"
CARD_FILE = "card.json"

Decision = Sequence[int]  # one choice per head of ACTION_HEADS; all 0: the cost router
Decide = Callable[[np.ndarray], Decision]


def observation_size() -> int:
    return len(REQUEST_FEATURES) + CANDIDATES * len(CANDIDATE_FEATURES)


def observation_spec() -> dict:
    """What a router's weights must have been trained on to be usable here."""
    return {
        "request_features": list(REQUEST_FEATURES),
        "candidate_features": list(CANDIDATE_FEATURES),
        "candidates": CANDIDATES,
        "load_shares": list(LOAD_SHARES),
        "write_budget_choices": list(WRITE_BUDGET_CHOICES),
        "heads": [list(h) for h in ACTION_HEADS],
    }


def zero_decision(obs: np.ndarray) -> Decision:
    """No deviation: the cost router's route, every hit page loaded, no prefetch, no replica,
    no write budget."""
    return (0,) * len(ACTION_HEADS)


class ResidualRouter(CostRouter):
    """The cost router plus the deviations ``decide`` picks for each request's observation."""

    name = "residual-router"

    def __init__(self, decide: Decide = zero_decision, remote_weight: float = 0.5, local_limit: int = 1024) -> None:
        super().__init__(remote_weight, local_limit)
        self.decide = decide
        self._heat: dict[int, int] = {}
        self._verbs: tuple[tuple[int, ...], float, bool, bool] = ((), 1.0, False, False)  # keys, load share, prefetch, replicate
        self.write_budgets: dict[str, float] = {}  # node -> its budget's share of the drive's write rate (absent: none)
        self._budget_choice: float | str = "keep"  # the last decision's, until the serving node is asked its budget
        self._state_of: ClusterView | None = None
        self._state: tuple[list[str], list[float], dict[str, int], float] = ([], [], {}, 0.0)

    def observe(self, request: RequestView, cluster: ClusterView) -> tuple[np.ndarray, list[str]]:
        """The observation (:func:`observation_size` floats) and the candidates' names, the
        cost router's pick first. Counts the request towards its root page's heat (call once
        per request). The decision's budget is 20 us, and a view may serve one request only
        (``view_refresh_ms: 0``): the nodes' costs in one pass, the state columns read for
        the candidates alone, one float32 array."""
        keys, hits = request.keys, request.hit_nodes
        n_keys, n_hits = len(keys), len(hits)
        n_pages = n_keys or 1
        page_ms = cluster.page_prefill_ms or 1.0
        missing = n_keys - n_hits
        names, backlogs, index, total_backlog = self._node_state(cluster)
        remote_weight = self.remote_weight_in(cluster)
        # CostRouter.route's cost, to the bit: a node holding none of the hit fetches all of it
        far = page_ms * (missing + remote_weight * n_hits)
        costs = [b + far for b in backlogs]
        local = Counter(hits) if hits else {}
        for name, here in local.items():
            i = index.get(name)
            if i is not None:
                costs[i] = backlogs[i] + page_ms * (missing + remote_weight * (n_hits - here))
        # CostRouter's tie-breaks: least cost, then the requester, then the scenario's order
        order = sorted(range(len(costs)), key=costs.__getitem__)
        requester = index.get(request.requester, -1)
        if requester >= 0:
            at = first = order.index(requester)
            while first > 0 and costs[order[first - 1]] == costs[requester]:
                first -= 1
            if first < at:
                order.insert(first, order.pop(at))
        unit = page_ms * n_pages
        heat = 0
        if keys:
            heat = self._heat[keys[0]] = self._heat.get(keys[0], 0) + 1
        flat = [
            math.log1p(n_keys) / LOG_PAGES,
            n_hits / n_pages,
            math.log1p(heat) / LOG_HEAT,
            min(page_ms / 100.0, CLIP),
            len(names) / 8.0,
            min(total_backlog / (len(names) * unit), CLIP),
        ]
        by_tier = Counter(zip(hits, request.hit_tiers)) if hits else {}
        best_cost = costs[order[0]]
        picked = order[:CANDIDATES]
        budgets = self.write_budgets
        for i in picked:
            name, node = names[i], cluster.nodes[i]
            here = local.get(name, 0)
            free = node.free_share
            flat += (
                1.0,
                1.0 if i == requester else 0.0,
                min(backlogs[i] / unit, CLIP),
                min((costs[i] - best_cost) / unit, CLIP),
                here / n_pages,
                by_tier.get((name, "device"), 0) / n_pages,
                by_tier.get((name, "host"), 0) / n_pages,
                by_tier.get((name, "disk"), 0) / n_pages,
                (n_hits - here) / n_pages,
                free.get("device", 0.0),
                free.get("host", 0.0),
                free.get("disk", 0.0),
                node.nic_in_util,
                node.nic_out_util,
                node.pcie_util,
                node.disk_read_util,
                node.disk_write_util,
                budgets.get(name, 1.0),
            )
        flat += [0.0] * (len(CANDIDATE_FEATURES) * (CANDIDATES - len(picked)))
        return np.array(flat, np.float32), [names[i] for i in picked]

    def _node_state(self, cluster: ClusterView) -> tuple[list[str], list[float], dict[str, int], float]:
        """The nodes' names, engine backlogs, index by name and total backlog, kept while the
        view is (the simulator refreshes it every ``view_refresh_ms``)."""
        if cluster is not self._state_of:
            names = [n.name for n in cluster.nodes]
            backlogs = [n.backlog_ms for n in cluster.nodes]
            self._state_of = cluster
            self._state = (names, backlogs, {name: i for i, name in enumerate(names)}, sum(backlogs))
        return self._state

    def route(self, request: RequestView, cluster: ClusterView) -> str:
        obs, names = self.observe(request, cluster)
        node, load, prefetch, replicate, budget = self.decide(obs)
        served = names[node] if node < len(names) else names[0]
        self._verbs = (request.keys, LOAD_SHARES[load], prefetch == 1, replicate == 1)
        self._budget_choice = WRITE_BUDGET_CHOICES[budget]
        return served

    def load_pages(self, request: RequestView, cluster: ClusterView) -> int:
        keys, share, _, _ = self._verbs
        hits = len(request.hit_nodes)
        if keys != request.keys or share >= 1.0:
            return hits
        return int(math.floor(share * hits + 0.5))

    def prefetch(self, request: RequestView, cluster: ClusterView) -> bool:
        keys, _, prefetch, _ = self._verbs
        return prefetch and keys == request.keys

    def replicate(self, request: RequestView, cluster: ClusterView) -> list[str]:
        """The serving node (``request.requester`` once routed) receives a copy of the hit
        chain's pages it lacks, when the decision said so."""
        keys, _, _, replicate = self._verbs
        if not replicate or keys != request.keys or request.requester is None:
            return []
        return [request.requester] if any(h != request.requester for h in request.hit_nodes) else []

    def disk_write_budget(self, node: NodeView, cluster: ClusterView) -> float | None:
        """``node``'s budget as the decisions for it left it, in bytes per second. The last
        decision's choice lands on the node asked first after ``route``: the one serving the
        request, whether the router picked it (the simulator, ``Controller.decide``) or an
        engine was routed to already (``route=False``: the engine's own node, not the pick).
        A node without a drive keeps no budget."""
        choice, self._budget_choice = self._budget_choice, "keep"
        if node.disk_write_gbps <= 0:
            return None
        if choice == "none":
            self.write_budgets.pop(node.name, None)
        elif choice != "keep":
            self.write_budgets[node.name] = choice
        share = self.write_budgets.get(node.name)
        return None if share is None else budget_rate(share, node)


class RouterNetwork:
    """The trained decision, numpy only: a ReLU MLP from the observation to every head's
    logits (:data:`ACTION_HEADS`, concatenated); each head takes its most likely choice, as
    stable-baselines3's ``predict(deterministic=True)`` does (the first on ties, as torch's argmax).

    Each layer is one matrix whose last row is its bias, fed by an input that ends in a
    constant 1 (carried through the hidden layers by one more unit), and every product lands
    in a buffer allocated once: a forward is three dot products and two in-place ReLUs. The
    buffers make one network serve one caller at a time, as the router's own per-request
    state already does.

    Example::

        net, card = RouterNetwork.load("cluster-default")
        node, load, prefetch, replicate, write_budget = net(obs)
    """

    def __init__(self, weights: list[np.ndarray], biases: list[np.ndarray]) -> None:
        self._matrices, self._outputs = [], []
        for i, (w, b) in enumerate(zip(weights, biases)):
            hidden = i < len(weights) - 1
            outputs, inputs = w.shape
            m = np.zeros((inputs + 1, outputs + hidden), np.float32)
            m[:inputs, :outputs] = w.T
            m[inputs, :outputs] = b
            if hidden:
                m[inputs, outputs] = 1.0  # the next layer's constant input
            self._matrices.append(m)
            self._outputs.append(np.empty(outputs + hidden, np.float32))
        self._input = np.ones(weights[0].shape[1] + 1, np.float32)
        bounds, at = [], 0
        for _, size in ACTION_HEADS:
            bounds.append((at, at + size))
            at += size
        self._heads = bounds

    def logits(self, obs: np.ndarray) -> list[float]:
        x = self._input
        x[:-1] = obs
        last = len(self._matrices) - 1
        for i, (m, out) in enumerate(zip(self._matrices, self._outputs)):
            np.dot(x, m, out=out)
            if i < last:
                np.maximum(out, 0.0, out=out)
            x = out
        return x.tolist()

    def __call__(self, obs: np.ndarray) -> Decision:
        logits = self.logits(obs)
        choices = []
        for lo, hi in self._heads:  # argmax, the first on ties (as torch's)
            head = logits[lo:hi]
            choices.append(head.index(max(head)))
        return choices

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
        n = sum(1 for k in tensors if k.startswith("layer") and k.endswith(".weight"))
        try:
            weights = [tensors[f"layer{i}.weight"] for i in range(n)]
            biases = [tensors[f"layer{i}.bias"] for i in range(n)]
        except KeyError as exc:
            raise PolicyError(f"{weights_path}: missing tensor {exc}") from None
        outputs = sum(size for _, size in ACTION_HEADS)
        if not weights or weights[0].shape[1] != observation_size() or weights[-1].shape[0] != outputs:
            raise PolicyError(f"{weights_path}: does not take {observation_size()} features to {outputs} logits")
        return cls(weights, biases), card


class RLRouter(ResidualRouter):
    """The residual router with trained weights (``policies/cluster-default`` unless a folder is given)."""

    name = "rl-router"

    def __init__(self, path: str | Path = DEFAULT_ROUTER, local_limit: int = 1024) -> None:
        network, self.card = RouterNetwork.load(path)
        super().__init__(network, local_limit=local_limit)
        if str(path) != DEFAULT_ROUTER:  # reports say which weights, by the name that builds it again
            self.name = f"{RLRouter.name}:{path}"
