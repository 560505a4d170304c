"""``kvray train`` and ``kvray train-reuse``: the two training commands' flags, kept apart from
the other commands because their recipes take most of the command line's options.

Registered on :data:`kvray.cli.app` by the package; each calls what trains in :mod:`kvray.apps`.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from kvray.cli.reporting import console, reported_errors
from kvray.core.errors import ConfigError
from kvray.flags import CAPACITY_FRACTION, COUNT, LOAD, LOAD_HELP, NON_NEGATIVE, POSITIVE, TIME_FRACTION, in_range, one_of
from kvray.rl.teacher_recipe import PROMOTION_LABELS, PROMOTION_ROWS, TEACHER_PROMOTE, TeacherRecipe

MAX_ENSEMBLE = 16  # kvray.rl.reuse_ensemble.MAX_MEMBERS, not imported here: it loads the simulator (a test holds them equal)


def train(
    scenario: list[Path] = typer.Option(
        [], "--scenario", help="training scenario YAML(s), one node or a cluster (default simulations/h100-llama8b.yaml)"
    ),
    bandwidth_scale: list[float] = typer.Option(
        [1.0],
        "--bandwidth-scale",
        callback=POSITIVE,
        help="link bandwidths trained over: each scenario with every link this many times as fast",
    ),
    trace: list[Path] = typer.Option(
        [], "--trace", help="training trace(s); each is split by time (required but with --cluster)"
    ),
    cluster: bool = typer.Option(
        False, "--cluster", help="train the cluster router instead: PPO residual on the cost router (rl-router; docs/sim-eval)"
    ),
    node_policy: str = typer.Option(
        "lru", "--node-policy", help="with --cluster: every node's placement policy while the router trains"
    ),
    shared_disk: bool = typer.Option(
        False,
        "--shared-disk",
        help="with --cluster: each scenario also with its drives' reads and writes on one channel (docs/sim-eval)",
    ),
    timesteps: int = typer.Option(
        50_000, "--timesteps", callback=NON_NEGATIVE, help="PPO steps after the counterfactual fit (0: none)"
    ),
    horizon: int = typer.Option(
        8,
        "--counterfactual-horizon",
        callback=NON_NEGATIVE,
        help="windows of every expert's future cost the scorer is first fitted to (0: none)",
    ),
    epochs: int = typer.Option(300, "--counterfactual-epochs", callback=COUNT, help="full-batch epochs of that fit"),
    correction_decay: float = typer.Option(
        0.0,
        "--correction-decay",
        callback=NON_NEGATIVE,
        help="penalty on the size of the fitted correction to follow-the-leader (0: none; docs/sim-eval)",
    ),
    out: Path = typer.Option(..., "--out", help="policy folder, e.g. policies/mine"),
    seed: int = typer.Option(0, "--seed", callback=NON_NEGATIVE),
    train_fraction: float = typer.Option(
        0.6, "--train-fraction", callback=TIME_FRACTION, help="first part of each trace (by time) trained on"
    ),
    family: list[str] = typer.Option(
        ["chat", "document", "agent", "bursty", "phase"],
        "--family",
        help="generated workload families trained on (kvray generate)",
    ),
    fraction: list[float] = typer.Option(
        [0.02, 0.05, 0.10, 0.25],
        "--capacity-fraction",
        callback=CAPACITY_FRACTION,
        help="cache sizes trained on: device+host = F x unique pages",
    ),
    holdout: list[Path] = typer.Option([], "--holdout", help="traces held out whole, evaluated in the card"),
    evaluate: bool = typer.Option(True, "--evaluate/--no-evaluate", help="score the policy on held-out data"),
    tensorboard: Path | None = typer.Option(None, "--tensorboard", help="TensorBoard log folder (default OUT/tensorboard)"),
    json_out: bool = typer.Option(False, "--json", help="print the model card as one JSON object"),
    jobs: int = typer.Option(1, "--jobs", callback=COUNT, help="counterfactual replays run at once (worker processes)"),
) -> None:
    """Train the RL placement policy (the selector of the adaptive expert policy): fitted to every expert's
    counterfactual cost, then PPO, on generated workload families and the first part of each trace, replayed on
    every --scenario (one node or a cluster) at every --bandwidth-scale; writes
    policy.safetensors, card.json and TensorBoard logs. --correction-decay penalises the size of the fitted
    correction to follow-the-leader; 0 by default, as leave-one-source-out cross-validation over the training
    sources chose (docs/sim-eval).
    Progress and logs go to stderr, so stdout holds only the result."""
    if cluster:
        from kvray.apps.train_cluster import train_router_policy

        with reported_errors():
            card = train_router_policy(
                out=out,
                scenarios=scenario,
                bandwidth_scales=bandwidth_scale,
                traces=trace,
                families=family,
                capacity_fractions=fraction,
                timesteps=timesteps,
                seed=seed,
                node_policy=node_policy,
                shared_disk=shared_disk,
            )
        console.print(f"wrote {out}: {card['training']['timesteps']} PPO steps in {card['training']['wall_s']} s")
        if json_out:
            print(json.dumps(card))
        return
    if shared_disk:
        raise typer.BadParameter("--shared-disk trains the cluster router: give --cluster too", param_hint="--shared-disk")
    from kvray.apps.train import TrainRequest, summary_line, train_policy

    request = TrainRequest(
        traces=trace,
        out=out,
        scenarios=scenario,
        bandwidth_scales=bandwidth_scale,
        timesteps=timesteps,
        counterfactual_horizon=horizon,
        counterfactual_epochs=epochs,
        correction_decay=correction_decay,
        seed=seed,
        train_fraction=train_fraction,
        families=family,
        capacity_fractions=fraction,
        holdout=holdout,
        evaluate=evaluate,
        tensorboard=tensorboard,
        jobs=jobs,
        progress=console.print,
    )
    with reported_errors():
        card = train_policy(request)
    console.print(summary_line(card, out))
    if json_out:
        print(json.dumps(card))
    elif "evaluation" in card:
        print(json.dumps(card["evaluation"]["goals"], indent=2))


def train_reuse(
    out: Path = typer.Option(Path("policies/reuse"), "--out", help="folder for reuse.safetensors and card.json"),
    seed: int = typer.Option(0, "--seed", callback=NON_NEGATIVE),
    rounds: int = typer.Option(2, "--rounds", callback=NON_NEGATIVE, help="DAgger rounds after the oracle's (0: none)"),
    record: float = typer.Option(0.1, "--record", callback=TIME_FRACTION, help="share of decisions kept as training rows"),
    trace: list[Path] = typer.Option(
        [Path("conversation_trace_first30min.jsonl")], "--trace", help="training trace(s); only their first part is used"
    ),
    train_fraction: float = typer.Option(
        0.6, "--train-fraction", callback=TIME_FRACTION, help="first part of each trace (by time) trained on"
    ),
    family: list[str] = typer.Option(
        ["chat", "document", "agent", "bursty", "phase"], "--family", help="generated workload families trained on"
    ),
    fraction: list[float] = typer.Option(
        [0.02, 0.05, 0.10, 0.25], "--capacity-fraction", callback=CAPACITY_FRACTION, help="cache sizes trained on"
    ),
    jobs: int = typer.Option(1, "--jobs", callback=COUNT, help="replays run at once (worker processes)"),
    lru_candidates: int = typer.Option(64, "--lru-candidates", callback=COUNT, help="candidates per decision: LRU's oldest"),
    frequency_candidates: int = typer.Option(
        32, "--frequency-candidates", callback=NON_NEGATIVE, help="... and the lowest decayed frequency (half-life 256 requests)"
    ),
    never_read_candidates: int = typer.Option(
        32, "--never-read-candidates", callback=NON_NEGATIVE, help="... and the oldest pages never read since stored"
    ),
    load: list[float] = typer.Option(
        [], "--load", callback=LOAD, help=LOAD_HELP + ", per source and capacity; repeat for several (none: the own rate)"
    ),
    own_rate: bool = typer.Option(True, "--own-rate/--no-own-rate", help="with --load, also train at each source's own rate"),
    promotions: str = typer.Option(
        "none",
        "--promotion-decisions",
        callback=one_of(*PROMOTION_ROWS),
        help="teacher replays that also record promotion decisions (page read vs host's next victim): all, rollouts "
        "(the DAgger rounds'), none (as policies/reuse was trained; docs/sim-eval/README.md, 'Promotion decisions in the "
        "teacher's replays')",
    ),
    promotion_label: str = typer.Option(
        "pair",
        "--promotion-label",
        callback=one_of(*PROMOTION_LABELS),
        help="where the recorded promotion decisions are fitted: pair (in the eviction model's softmax, whose score "
        "difference prices a promotion) or pointwise (a promotion head of its own: is the page read before host's next "
        "victim?; docs/sim-eval/README.md, 'A pointwise promotion head')",
    ),
    teacher_promote: str = typer.Option(
        "model",
        "--teacher-promote",
        callback=one_of(*TEACHER_PROMOTE),
        help="disk reads the teacher replays promote: model (round 0 as the oracle, then the model's choice) or none "
        "(with --no-queue-weight --pool-counts libm: how policies/reuse was trained; docs/sim-eval/README.md)",
    ),
    queue_weighted: bool = typer.Option(
        True, "--queue-weight/--no-queue-weight", help="weigh a decision by the requests queued behind its miss"
    ),
    pool_counts: str = typer.Option(
        "numpy",
        "--pool-counts",
        callback=one_of("numpy", "libm"),
        help="the teacher's decayed read counts: numpy's vector exp (as replays now), or libm's per page, "
        "as policies/reuse was trained (docs/sim-eval/README.md)",
    ),
    ensemble: int = typer.Option(
        1,
        "--ensemble",
        callback=in_range(1, MAX_ENSEMBLE),
        help="train K models of consecutive seeds (K x seed ...) and serve their mean score (docs/sim-eval/README.md, "
        "'Nine seeds, two recipe changes, and an ensemble of seeds'); 1: one model",
    ),
    cluster: bool = typer.Option(
        False,
        "--cluster",
        help="train on cluster replays (every node, the cost router, link-charged weights; `--policy reuse-cluster:OUT`)",
    ),
    scenario: list[Path] = typer.Option(
        [], "--scenario", help="with --cluster: training clusters (default simulations/h100-2node-train.yaml)"
    ),
    bandwidth_scale: list[float] = typer.Option(
        [1.0], "--bandwidth-scale", callback=POSITIVE, help="with --cluster: each scenario at these link speeds (repeat)"
    ),
    requests: int = typer.Option(1200, "--requests", callback=COUNT, help="with --cluster: requests of each family"),
    promote_gate: float | None = typer.Option(
        None,
        "--promote-gate",
        callback=in_range(0, 1, low_open=True),
        help="with --cluster: promote a disk read only while the disk's load path is busy less than this (none: never)",
    ),
) -> None:
    """Train the per-page reuse policy (`--policy reuse`) by imitating the Belady oracle with DAgger rounds,
    on one node (simulations/h100-llama8b.yaml), over the generated families (seeds 100-104) and the first part of
    each trace; writes reuse.safetensors and card.json. Deterministic for a seed on one machine. With --cluster,
    on every node of the training clusters under the cost router, the families at loads 0.6 and 0.85 (or --load)."""
    from kvray.apps.train import train_cluster_reuse_policy, train_reuse_policy

    with reported_errors():
        pool = (lru_candidates, frequency_candidates, never_read_candidates)
        if cluster:
            if ensemble > 1:
                raise ConfigError("--ensemble trains one-node models; --cluster trains one model")
            card = train_cluster_reuse_policy(
                out=out,
                scenarios=scenario,
                bandwidth_scales=bandwidth_scale,
                families=family,
                loads=load or [0.6, 0.85],
                capacity_fractions=fraction,
                requests=requests,
                seed=seed,
                rounds=rounds,
                record=record,
                pool=pool,
                promote_gate=promote_gate,
                jobs=jobs,
                progress=console.print,
            )
            console.print(f"wrote {out}: {card['training']['decisions']} decisions in {card['training']['wall_s']} s")
            return
        loads = ([None] if own_rate or not load else []) + list(load)
        recipe = TeacherRecipe(
            promotions=promotions,
            promote=teacher_promote,
            queue_weighted=queue_weighted,
            libm_counts=pool_counts == "libm",
            promotion_label=promotion_label,
        )
        card = train_reuse_policy(
            out,
            seed,
            rounds,
            jobs,
            record,
            family,
            trace,
            fraction,
            train_fraction,
            pool,
            console.print,
            loads,
            recipe,
            ensemble,
        )
    models = f"{ensemble} models' mean, " if ensemble > 1 else ""
    console.print(f"wrote {out}: {models}{card['training']['decisions']} decisions in {card['training']['wall_s']} s")
