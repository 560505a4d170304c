"""The reuse model trained on cluster replays: what Belady keeps on each node, charged for links.

On the held-out clusters the oracle's lead over the cost router is mostly which pages each
node keeps (docs/sim-eval, "Where the rest of the headroom is"): Belady on every node under
the cost router, no prefetch, is 0.69-0.80x the cost router where no router reaches 40% of
the headroom. The single-node reuse model (:mod:`kvray.rl.imitation`) was fitted on one node
whose every request it sees; here the same DAgger (:func:`~kvray.rl.imitation.dagger`) rolls
out :class:`~kvray.policy.reuse.ReusePolicy` teachers on *every node* of the cluster simulator
under the cost router, each decision labelled with the oracle's next use of its candidates
in requests of the trace (:class:`TraceNextUse`: a node hears only of some requests, so the
next use it was told of may have passed elsewhere; :attr:`RequestInfo.index` is the clock) and
weighted by what a miss costs there including the link the page would be reloaded over
(:func:`~kvray.policy.reuse_weights.link_charged_miss`, from that node's load paths' utilisation) and
the queue behind it (:func:`~kvray.policy.reuse_weights.queue_weight`).

Training data keeps to the held-out protocol of ``kvray train --cluster``
(:func:`kvray.rl.cluster_train.training_traces`): the generated families at seeds from 100
(never the evaluated trace, seed 0), on the training cluster ``h100-2node-train`` at link
bandwidths other than the held-out 0.5x and 2x, arrival gaps scaled to loads 0.6 and 0.85.

Example::

    from pathlib import Path
    import tempfile
    from kvray.rl.cluster_imitation import train_cluster_reuse
    from kvray.scenario import load_scenario

    card = train_cluster_reuse(Path(tempfile.mkdtemp()), [load_scenario("h100-2node-train")], families=("chat",),
                               loads=(0.6,), requests=60, rounds=0, record=1.0, epochs=1)
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from kvray.policy.reuse import POOL, TAKE, ReusePolicy
from kvray.policy.reuse_model import WEIGHTS_FILE, ReuseModel
from kvray.rl.imitation import CARD_FILE, Collected, dagger
from kvray.scenario import Scenario
from kvray.sim.workloads import FAMILIES
from kvray.traces import TraceRequest, full_blocks


class TraceNextUse:
    """The request index at which each key is next used after a given one, read from the
    whole trace (the oracle's future, for every node whichever node serves the use)."""

    def __init__(self, trace: Sequence[TraceRequest], page_tokens: int) -> None:
        uses: dict[int, list[int]] = {}
        for i, request in enumerate(trace):
            for key in full_blocks(request.hash_ids, request.input_length, page_tokens):
                uses.setdefault(key, []).append(i)
        self._uses = {k: np.asarray(v, dtype=np.float64) for k, v in uses.items()}

    def __call__(self, keys: list[int], now: float) -> np.ndarray:
        out = np.full(len(keys), np.inf)
        for j, key in enumerate(keys):
            at = self._uses.get(key)
            if at is not None:
                k = int(np.searchsorted(at, now, side="right"))
                if k < len(at):
                    out[j] = at[k]
        return out


CLUSTER_POLICY = "cost-router"  # the cluster policy the teachers serve under: the pair the target compares with
FAMILY_SEED = 100  # the families' first seed (kvray train --cluster's); the held-out trace is seed 0


def collect_cluster(job: tuple) -> Collected:
    """One cluster replay with a teacher-labelled reuse policy on every node: every node's
    recorded decisions (rows, labels, link-charged weights) and the replay's mean TTFT (no
    promotion decisions: the nodes promote every disk read or none)."""
    from kvray.policy.cluster import make_cluster_policy
    from kvray.sim.cluster import ClusterSimulator

    scenario, trace, capacities, model, record, seed, pool, promote_gate = job
    future = TraceNextUse(trace, scenario.layout.page_tokens)
    policies = [
        ReusePolicy(
            model,
            teacher=True,
            record=record,
            seed=seed * 64 + n,
            pool=pool,
            link_charged=True,
            promote="none" if promote_gate is None else "every",
            promote_gate=promote_gate,
            next_use=future,
        )
        for n in range(len(capacities))
    ]
    result = ClusterSimulator(scenario, policies, make_cluster_policy(CLUSTER_POLICY), capacities).replay(trace)
    rows, labels, weights = [], [], []
    for policy in policies:
        rows += policy.rows
        labels += policy.labels
        weights += policy.weights
    return rows, labels, weights, result.mean_ttft_ms, 0, ([], [], [])


def train_cluster_reuse(
    out: Path,
    scenarios: Sequence[Scenario],
    families: Sequence[str] = tuple(FAMILIES),
    loads: Sequence[float] = (0.6, 0.85),
    capacity_fraction: float = 0.05,
    requests: int = 1200,
    seed: int = 0,
    rounds: int = 2,
    record: float = 0.1,
    epochs: int = 8,
    pool: tuple[int, int, int] = POOL,
    promote_gate: float | None = None,
    jobs: int = 1,
    say: Callable[[str], None] | None = None,
) -> dict:
    """DAgger over the cluster cells (each scenario x family x load, :func:`training_traces`);
    the rollouts' nodes promote only while the disk's load path is busy less than
    ``promote_gate`` (None: never), as the deployed policy will. Writes the model and its card
    (``node_policy``: the settings the model was rolled out with) into ``out``."""
    from kvray.rl.cluster_train import training_traces

    started = time.perf_counter()
    cells, sources = training_traces(scenarios, families, FAMILY_SEED, loads, capacity_fraction, requests)
    model, decisions, history = dagger(
        lambda model, r: [
            (scenario, trace, caps, model, record, seed * 1_000_003 + r * 1009 + i, pool, promote_gate)
            for i, (scenario, trace, caps) in enumerate(cells)
        ],
        collect_cluster,
        rounds,
        jobs,
        seed,
        epochs,
        pool,
        say,
    )
    model.save(out)
    card = cluster_card(model, pool, promote_gate)
    card["training"] = {
        "seed": seed,
        "dagger_rounds": rounds,
        "record_share": record,
        "epochs_per_fit": epochs,
        "cluster_policy": CLUSTER_POLICY,
        "capacity_fraction": capacity_fraction,
        "sources": sources,
        "decisions": decisions,
        "rounds": history,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    (out / CARD_FILE).write_text(json.dumps(card, indent=2) + "\n")
    return card


def cluster_card(model: ReuseModel, pool: tuple[int, int, int], promote_gate: float | None) -> dict:
    """The card's description of a cluster-trained reuse model (its training goes beside)."""
    return {
        "policy": "reuse-cluster",
        "weights": WEIGHTS_FILE,
        "features": list(model.features()),
        "candidates": {"lru_oldest": pool[0], "least_frequent": pool[1], "oldest_never_read": pool[2]},
        "take": TAKE,
        "node_policy": {"promote_gate": promote_gate},
        "label": "softmax over a decision's candidates of log1p(trace requests to next use) (never = 1e5), on every "
        "node of a cluster replay, cross-entropy weighted by the link-charged miss cost where the eviction sends the "
        "page times the queue behind it",
    }
