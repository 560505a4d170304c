"""Training the reuse model by imitating the oracle, with DAgger rounds (Parrot, ICML'20).

In the simulator the next use of every page is known (the Belady oracle's future), so every
eviction decision of :class:`~kvray.policy.reuse.ReusePolicy` can be labelled: each of its
candidates with the requests until its next use (never: :data:`~kvray.policy.reuse_model.NEVER_REQUESTS`),
weighted by what a miss of that page costs from where the eviction sends it. So can every
promotion decision (a page read from disk moves up to host only if the model ranks it
nearer its next use than host's next victim): with the recipe's ``promotions``
(:class:`~kvray.rl.teacher_recipe.TeacherRecipe`)
the pair is recorded too, labelled the same way, weighted by what a disk read costs over a
host read. Without those rows the model that prices a promotion is fitted on eviction pools
of old pages only, and a page read this request lies outside them; with them it was not
better on the held-out cells (docs/sim-eval/README.md, "Promotion decisions in the teacher's
replays"), so the default records none. With the recipe's pointwise ``promotion_label`` the
pairs fit a promotion head of its own instead (:mod:`kvray.policy.reuse_promotion`: is the page
read before the victim?), not better either ("A pointwise promotion head"). Round 0 acts as the oracle among the candidates (the
expert; it promotes a page iff it is used before host's victim); every later round rolls out the model
fitted so far, so that it is labelled on the states its own choices lead to, and the model
is refitted on all rounds' rows (DAgger's aggregation). Only the training sources are
replayed: the five generated families (seeds 100-104) and the first part of each training
trace by time, at capacities 2/5/10/25% of each source's unique pages, on one node; with
``loads``, each source and capacity is also replayed with its arrival gaps scaled so that
LRU keeps the prefill engine busy that share of the time (:mod:`kvray.sim.load`). A miss
also delays the requests queued behind it, so a decision's weight (at any rate where a
queue forms) is multiplied by one plus the requests' worth of work queued ahead of it
(:func:`~kvray.policy.reuse_weights.queue_weight`).

Everything random (which decisions are recorded, the fit's initialisation and batches)
comes from the seed: a run reproduces its weights bit for bit on one machine.

Example::

    import tempfile
    from pathlib import Path
    from kvray.rl.imitation import train_reuse
    from kvray.sim.workloads import WorkloadSpec, generate

    # kvray train-reuse's sources are training_sources(list(FAMILY_SEEDS), [TRAIN_TRACE], 0.6); a tiny one here
    sources = {"tiny": generate(WorkloadSpec(sessions=10), seed=1)}
    card = train_reuse(Path(tempfile.mkdtemp()), sources, seed=0, rounds=1, record=1.0, capacities=(0.05,), epochs=1)
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from kvray.policy.reuse import POOL, TAKE, ReusePolicy
from kvray.policy.reuse_model import WEIGHTS_FILE, ReuseModel, batch_groups
from kvray.policy.reuse_promotion import HEAD_FILE, PromotionHead
from kvray.rl.teacher_recipe import TeacherRecipe
from kvray.rl.train import split_by_time
from kvray.scenario import DEFAULT_SCENARIO, Scenario, load_scenario
from kvray.sim.load import find_load
from kvray.sim.node import node_capacities
from kvray.sim.simulator import Simulator
from kvray.traces import TraceRequest, read_trace

FAMILY_SEEDS = {"chat": 100, "document": 101, "agent": 102, "bursty": 103, "phase": 104}
TRAIN_TRACE = "conversation_trace_first30min.jsonl"
CAPACITIES = (0.02, 0.05, 0.10, 0.25)
CARD_FILE = "card.json"


def training_sources(families: Sequence[str], traces: Sequence[str], train_fraction: float) -> dict[str, list[TraceRequest]]:
    """The replays' traces: each family at its seed, the first ``train_fraction`` of each trace."""
    from kvray.sim.workloads import generate, named_workload

    sources = {f"{f}:{FAMILY_SEEDS[f]}": generate(named_workload(f), FAMILY_SEEDS[f]) for f in families}
    for path in traces:
        trace = read_trace(path)
        sources[f"{Path(path).stem}@<{train_fraction:g}"] = split_by_time(trace, train_fraction)[0]
    return sources


def _at_load(job: tuple) -> list[TraceRequest]:
    """``trace`` at capacity ``fraction`` scaled to ``load`` (None: as it is)."""
    trace, fraction, scenario, load = job
    if load is None:
        return trace
    return find_load(trace, scenario, load, node_capacities(scenario, trace, fraction)).trace


# the eviction decisions' rows, labels and weights, the replay's mean TTFT, the promotion decisions
# recorded, and those the promotion head is fitted on (pairs, labels, weights; empty without one)
Collected = tuple[list[np.ndarray], list[np.ndarray], list[float], float, int, tuple[list, list, list]]


def collect(job: tuple) -> Collected:
    """One replay of the teacher-labelled policy: its recorded decisions (each candidate's
    rows and labels, the decision's weight), its mean TTFT and how many of the decisions
    were promotions (the page read and host's next victim; ``TeacherRecipe.promotions``), and with
    a pointwise ``promotion_label`` those decisions as the promotion head's rows instead."""
    trace, fraction, scenario, model, record, seed, pool, recipe = job
    policy = ReusePolicy(
        model,
        teacher=True,
        record=record,
        seed=seed,
        pool=pool,
        record_promotions=recipe.records_promotions(rollout=model is not None),
        pointwise_promotions=recipe.promotion_label == "pointwise",
        promote=recipe.promote,
        queue_weighted=recipe.queue_weighted,
        libm_counts=recipe.libm_counts,
    )
    capacities = node_capacities(scenario, trace, fraction)[0]
    result = Simulator(scenario, policy, capacities).replay(trace)
    head = policy.head_rows or ([], [], [])
    return policy.rows, policy.labels, policy.weights, result.mean_ttft_ms, policy.promotions_recorded, head


def dagger(
    work: Callable[[ReuseModel | None, int], list[tuple]],
    collect_one: Callable[[tuple], Collected],
    rounds: int,
    jobs: int,
    seed: int,
    epochs: int,
    pool: tuple[int, int, int],
    say: Callable[[str], None] | None = None,
) -> tuple[ReuseModel, int, list[dict]]:
    """DAgger: round 0 replays ``work(None, 0)``'s jobs acting as the oracle among the
    candidates, every later round ``work(model, r)``'s with the model fitted so far;
    ``collect_one`` replays a job into its recorded decisions, and after each round the model
    is refitted on every round's rows, and its promotion head on every round's promotion
    decisions where the replays recorded them for one (:mod:`kvray.policy.reuse_promotion`;
    the rollouts then promote as the head says). Returns the last model, the eviction
    decisions fitted on and each round's account."""
    model: ReuseModel | None = None
    rows, labels, weights = [], [], []
    pairs, pair_labels, pair_weights = [], [], []
    history = []
    for r in range(rounds + 1):
        jobs_now = work(model, r)
        if jobs > 1:
            with ProcessPoolExecutor(jobs) as workers:
                results = list(workers.map(collect_one, jobs_now))
        else:
            results = [collect_one(job) for job in jobs_now]
        for x, y, w, _, _, (px, py, pw) in results:
            rows += x
            labels += y
            weights += w
            pairs += px
            pair_labels += py
            pair_weights += pw
        groups, targets, mask = batch_groups(rows, labels, sum(pool))
        model = ReuseModel.fit(groups, targets, mask, np.asarray(weights), seed, epochs=epochs)
        model.pool = pool
        if pairs:
            model.promotion = PromotionHead.fit(pairs, pair_labels, np.asarray(pair_weights), seed, epochs=epochs)
        history.append(
            {
                "round": r,
                "acted_by": "oracle among candidates" if r == 0 else "model",
                "decisions": sum(len(x) for x, *_ in results),
                "promotion_decisions": sum(res[4] for res in results),
                "promotion_head_decisions": sum(len(res[5][0]) for res in results),
                "mean_ttft_ms": [round(res[3], 1) for res in results],
            }
        )
        if say is not None:
            say(f"round {r}: {history[-1]['decisions']} decisions, {len(rows)} in all")
    assert model is not None
    return model, len(rows), history


def train_reuse(
    out: Path,
    sources: dict[str, list[TraceRequest]],
    seed: int = 0,
    rounds: int = 2,
    jobs: int = 1,
    record: float = 0.1,
    capacities: Sequence[float] = CAPACITIES,
    scenario: Scenario | None = None,
    epochs: int = 8,
    say: Callable[[str], None] | None = None,
    pool: tuple[int, int, int] = POOL,
    loads: Sequence[float | None] = (None,),
    recipe: TeacherRecipe = TeacherRecipe(),
) -> dict:
    """DAgger over the training ``sources`` (:func:`training_sources`) at every capacity
    fraction and load (None: the source's own rate), the teacher acting and weighing as ``recipe``
    says (:class:`~kvray.rl.teacher_recipe.TeacherRecipe`: without promotion rows the model that
    prices a promotion is fitted on eviction pools of old pages only; ``teacher_recipe.SHIPPED`` is
    the recipe policies/reuse was trained with, docs/sim-eval/README.md); writes the model and its
    card into ``out``."""
    scenario = scenario or load_scenario(DEFAULT_SCENARIO)
    started = time.perf_counter()
    cells = [(t, f, scenario, u) for t in sources.values() for f in capacities for u in loads]
    if jobs > 1:
        with ProcessPoolExecutor(jobs) as workers:
            traces = list(workers.map(_at_load, cells))
    else:
        traces = [_at_load(c) for c in cells]
    model, decisions, history = dagger(
        lambda model, r: [
            (
                trace,
                f,
                scenario,
                model,
                record,
                seed * 1_000_003 + r * 1009 + i,
                pool,
                recipe,
            )
            for i, (trace, (_, f, _, _)) in enumerate(zip(traces, cells))
        ],
        collect,
        rounds,
        jobs,
        seed,
        epochs,
        pool,
        say,
    )
    model.save(out)
    card = {
        "policy": "reuse",
        "weights": WEIGHTS_FILE,
        "features": list(model.features()),
        "candidates": {"lru_oldest": pool[0], "least_frequent": pool[1], "oldest_never_read": pool[2]},
        "take": TAKE,
        "label": "softmax over a decision's candidates of log1p(requests to next use) (never = 1e5), cross-entropy weighted by the miss cost where the eviction sends the page"
        + (
            "; a promotion decision's candidates are the page read from disk and host's next victim, weighted by a disk read's cost over a host read's"
            if recipe.promotions != "none" and recipe.promotion_label == "pair"
            else ""
        ),
        **(
            {
                "promotion_head": {
                    "weights": HEAD_FILE,
                    "inputs": "the page read from disk's row as it would sit in host, then host's next victim's row as ranked",
                    "label": "the page's next use comes strictly before the victim's (binary cross-entropy), weighted by a disk read's cost over a host read's times the queue behind it",
                }
            }
            if model.promotion is not None
            else {}
        ),
        "training": {
            **recipe.card(),
            # the fit's float32 products are OpenBLAS's, whose kernels differ by CPU: the shipped
            # policies/reuse rebuilds only on Haswell's (docs/sim-eval/README.md); None: detected
            "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE"),
            "seed": seed,
            "dagger_rounds": rounds,
            "record_share": record,
            "epochs_per_fit": epochs,
            "sources": list(sources),
            "capacity_fractions": list(capacities),
            "loads": [u if u is not None else "own rate" for u in loads],
            "scenario": scenario.name,
            "decisions": decisions,
            "rounds": history,
            "wall_s": round(time.perf_counter() - started, 1),
        },
    }
    (out / CARD_FILE).write_text(json.dumps(card, indent=2) + "\n")
    return card
