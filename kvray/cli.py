"""The ``kvray`` command line: demo, run, up/status/down, sim, train, eval, calibrate, bench.

Help is rendered by click's plain formatter (``rich_markup_mode=None``): it shows flags as
flags and every default, where typer's rich panels print a ``<bool>`` after each flag.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer
from rich.console import Console

from kvray.core.errors import ConfigError, KvrayError
from kvray.progress import progress_bar

app = typer.Typer(
    add_completion=False, no_args_is_help=True, rich_markup_mode=None, help="kvray: tiered KV-cache offload and reuse"
)
console = Console(stderr=True)


@contextmanager
def reported_errors() -> Iterator[None]:
    """Bad input ends the command with its one-line message (exit code 2), not a traceback."""
    try:
        yield
    except KvrayError as exc:
        console.print(f"[red]kvray: {exc}[/]", soft_wrap=True)
        raise typer.Exit(2) from None


LOAD_HELP = "scale the trace's arrival gaps so that under LRU the prefill engines are busy this share of the time (0 < U < 1)"


def checked_load(load: float | None) -> float | None:
    """``--load`` is a busy share strictly between 0 and 1 (0: no requests, 1: saturated)."""
    if load is not None and not 0 < load < 1:
        raise typer.BadParameter(f"must be a busy share in (0, 1), got {load:g}", param_hint="--load")
    return load


@app.command()
def bench(
    json_out: bool = typer.Option(False, "--json", help="print a JSON list instead of a table"),
    only: list[str] = typer.Option([], "--only", help="run only benchmarks whose name contains this"),
    quick: bool = typer.Option(False, "--quick", help="fewer repetitions and smaller sizes"),
    out: Path | None = typer.Option(None, "--out", help="also save the results as this JSON file, and a plot beside it (.png)"),
) -> None:
    """Run the side-by-side benchmarks: kvray's figure, a baseline's, and their ratio."""
    from kvray.bench import run_benchmarks

    results = run_benchmarks(only=only, quick=quick, progress=not json_out)
    if out is not None:
        from kvray.bench.report import save

        console.print(f"saved {out} and {save(results, out)}", soft_wrap=True)
    if json_out:
        print(json.dumps([r.as_dict() for r in results], indent=2))
    else:
        from kvray.bench.report import print_table

        print_table(results)


@app.command()
def demo(
    requests: int = typer.Option(400, "--requests", help="requests of the bundled conversation trace to replay"),
    nodes: int = typer.Option(2, "--nodes", min=2, help="local Ray nodes to start"),
    out: str = typer.Option("results", "--out", help="directory for the JSON and the plots"),
    chat_turns: int = typer.Option(4, "--chat-turns", min=0, help="turns of the real-model conversation (0: skip)"),
) -> None:
    """Replay a slice of the real conversation trace on local Ray nodes without and with kvray;
    then serve a multi-turn conversation on a real (random-weight) Llama, with and without kvray."""
    from kvray.apps.demo import run_demo

    with reported_errors():
        run_demo(requests=requests, nodes=nodes, out_dir=out, console=console)
    if chat_turns:
        from kvray.apps.chat import conversation_demo

        conversation_demo(turns=chat_turns, console=Console(), plot=Path(out) / "chat_ttft.png")


@app.command()
def run(
    trace: str = typer.Option(..., "--trace", help="Mooncake JSONL or Parquet trace"),
    policy: str | None = typer.Option(None, "--policy", help="placement policy of every node's tiers (default lru)"),
    cluster_policy: str | None = typer.Option(
        None, "--cluster-policy", help="which node keeps each new page (default local-first)"
    ),
    nodes: int | None = typer.Option(None, "--nodes", help="local Ray nodes to start (ignored with --address)"),
    scenario: str | None = typer.Option(
        None, "--scenario", help="YAML file of replay settings, or a kvray sim scenario (one node)"
    ),
    address: str | None = typer.Option(None, "--address", help="existing Ray cluster (default: $RAY_ADDRESS)"),
    name: str | None = typer.Option(
        None, "--name", help="replay on this runtime, up on the cluster (kvray up), with its own tiers and policy; it stays up"
    ),
    limit: int | None = typer.Option(None, "--limit", help="replay only the first N requests"),
    host_pages: int | None = typer.Option(None, "--host-pages", help="host-tier pages per node"),
    disk_pages: int | None = typer.Option(None, "--disk-pages", help="disk-tier pages per node (needs --disk-root)"),
    disk_root: str | None = typer.Option(None, "--disk-root", help="directory for the nodes' disk tiers"),
    prefill_us: float | None = typer.Option(None, "--prefill-us-per-token", help="calibrated prefill cost"),
    capacity_fraction: float | None = typer.Option(
        None, "--capacity-fraction", help="per node, device+host = F x unique pages (as kvray sim)"
    ),
    capacity: int | None = typer.Option(None, "--capacity", help="per node, device+host pages (other tiers keep their ratio)"),
    json_out: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Replay a trace on the Ray runtime with real page bytes; report measured TTFT and hits."""
    from kvray.apps.replay import run_replay, settings_from

    with reported_errors():
        settings = settings_from(
            scenario,
            runtime={"policy": policy, "cluster_policy": cluster_policy, "disk_root": disk_root},
            tiers={"host": host_pages, "disk": disk_pages},
            replay={
                "nodes": nodes,
                "limit": limit,
                "prefill_us_per_token": prefill_us,
                "capacity_fraction": capacity_fraction,
                "capacity": capacity,
            },
        )
        result = run_replay(trace, settings, address=address, progress=not json_out, runtime_name=name)
    if result.wrong_pages:
        console.print(f"[red]{result.wrong_pages} pages came back with wrong KV[/]")
        raise typer.Exit(2)
    if json_out:
        print(json.dumps(result.as_dict()))
    else:
        from kvray.apps.results import print_results

        print_results({result.policy: result}, Console(), title=f"kvray run: measured replay ({result.scenario} settings)")
        if settings.prefill_us_per_token > 0:  # how far this machine ran from its calibration, which `kvray sim` assumes
            console.print(
                f"prefill: {result.prefill_us_per_token_measured:.2f} us per missed token measured, "
                f"{settings.prefill_us_per_token:g} calibrated"
            )


@app.command()
def status(
    address: str | None = typer.Option(None, "--address", help="Ray cluster (default: $RAY_ADDRESS or a local one)"),
    name: str = typer.Option("kvray", "--name", help="kvray runtime name"),
    json_out: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Metrics of a running kvray runtime (kvray up): hit rate, hits per tier, occupancy, latency, bytes moved."""
    from kvray.apps.status import fetch_status, print_status

    with reported_errors():
        snapshot = fetch_status(address, name)
    if json_out:
        print(json.dumps(snapshot, default=str))
    else:
        print_status(snapshot, console)


@app.command()
def up(
    address: str | None = typer.Option(None, "--address", help="Ray cluster (default: $RAY_ADDRESS or a local one)"),
    name: str = typer.Option("kvray", "--name", help="kvray runtime name"),
    scenario: str | None = typer.Option(None, "--scenario", help="YAML file of runtime settings, as for kvray run"),
    policy: str | None = typer.Option(None, "--policy", help="placement policy of every node's tiers (default lru)"),
    host_pages: int | None = typer.Option(None, "--host-pages", help="host-tier pages per node (default 256)"),
    disk_pages: int | None = typer.Option(None, "--disk-pages", help="disk-tier pages per node (needs --disk-root)"),
    disk_root: str | None = typer.Option(None, "--disk-root", help="directory for the nodes' disk tiers"),
    controller_shards: int | None = typer.Option(
        None, "--controller-shards", help="controller actors sharing the metadata (default 1; README: sizing shards)"
    ),
) -> None:
    """Start a kvray runtime on a Ray cluster that stays up after this command (until kvray down)."""
    from kvray.apps.replay import settings_from
    from kvray.apps.service import up as start

    with reported_errors():
        config = settings_from(
            scenario,
            runtime={"name": name, "policy": policy, "disk_root": disk_root, "controller_shards": controller_shards},
            tiers={"host": host_pages, "disk": disk_pages},
            replay={},
        ).runtime
        nodes = start(address, config)
    console.print(
        f"kvray runtime {name!r} is up: {config.policy} over {config.tiers.host} host pages per node on "
        f"{len(nodes)} node{'' if len(nodes) == 1 else 's'}, {config.controller_shards} controller shard"
        f"{'' if config.controller_shards == 1 else 's'}; `kvray status --name {name}` reads it, "
        f"`kvray down --name {name}` stops it"
    )


@app.command()
def down(
    address: str | None = typer.Option(None, "--address", help="Ray cluster (default: $RAY_ADDRESS or a local one)"),
    name: str = typer.Option("kvray", "--name", help="kvray runtime name"),
) -> None:
    """Stop a kvray runtime started by kvray up (its stores release their memory; disk files stay)."""
    from kvray.apps.service import down as stop

    with reported_errors():
        stores = stop(address, name)
    console.print(f"kvray runtime {name!r} is down ({stores} store{'' if stores == 1 else 's'} stopped)")


@app.command()
def sim(
    trace: Path = typer.Option(..., "--trace", help="Mooncake JSONL or Parquet trace"),
    policy: str = typer.Option("lru", "--policy", help="each node's policy (kvray.policy.POLICIES), rl:PATH"),
    cluster_policy: str = typer.Option(
        None,
        "--cluster-policy",
        help="local-first, cost-router, always-prefetch, replicate-hot, or oracle (Belady, searched prefetch/replication)",
    ),
    scenario: Path = typer.Option(None, "--scenario", help="scenario YAML (default simulations/h100-llama8b.yaml)"),
    warmup_requests: int = typer.Option(0, "--warmup-requests", help="requests that fill the cache unmeasured"),
    capacity_fraction: float = typer.Option(None, "--capacity-fraction", help="device+host = F x unique pages"),
    capacity: int = typer.Option(None, "--capacity", help="device+host pages (other tiers keep their ratio)"),
    limit: int = typer.Option(None, "--limit", help="replay only the first N requests"),
    load: float = typer.Option(None, "--load", help=LOAD_HELP, callback=checked_load),
    json_out: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Replay a trace through the real cache manager and policy with modeled time."""
    from kvray.scenario import DEFAULT_SCENARIO, load_scenario
    from kvray.sim.load import describe
    from kvray.sim.simulator import simulate
    from kvray.traces import read_trace

    with reported_errors():
        requests = read_trace(trace, limit=limit)
        spec = load_scenario(scenario or DEFAULT_SCENARIO)
        with progress_bar(len(requests), f"sim {policy}", enabled=not json_out) as tick:
            result = simulate(requests, policy, spec, warmup_requests, capacity_fraction, capacity, tick, cluster_policy, load)
    if load is not None:
        console.print(describe(result.extra["load"]), soft_wrap=True)
    if json_out:
        print(result.as_json())
    else:
        from kvray.apps.results import print_results

        out = Console()
        label = result.policy if cluster_policy is None else f"{result.policy} / {cluster_policy}"
        print_results({label: result}, out, title=f"kvray sim: modeled replay on scenario {result.scenario}")
        capacity = ", ".join(f"{tier} {pages}" for tier, pages in result.extra["capacity_pages"].items())
        out.print(
            f"capacity (pages): {capacity}; warm-up requests {warmup_requests}; "
            f"moves between tiers {result.extra['background_move_ms']:.1f} ms (off the TTFT path)"
        )
        busiest = sorted(result.extra["link_utilisation"].items(), key=lambda item: -item[1])[:6]
        out.print("busiest links (busy share over the replay): " + ", ".join(f"{n} {u:.3f}" for n, u in busiest))


@app.command(name="cluster-eval")
def cluster_eval(
    scenario: list[Path] = typer.Option(..., "--scenario", help="cluster scenario YAML (repeat for several)"),
    trace: list[Path] = typer.Option([], "--trace", help="trace file (repeat for several)"),
    generated: int = typer.Option(0, "--generated", help="also a generated chat workload of about N requests"),
    limit: int = typer.Option(None, "--limit", help="replay only the first N requests of each trace"),
    capacity_fraction: float = typer.Option(0.05, "--capacity-fraction", help="cluster device+host = F x unique pages"),
    out: Path = typer.Option(Path("docs/sim-eval"), "--out", help="folder for cluster.md, cluster.json, cluster.png"),
    policy: list[str] = typer.Option(
        [], "--policy", help="also NODE_POLICY+CLUSTER_POLICY (e.g. rl+cost-router), reported against the best heuristic"
    ),
    load: float = typer.Option(None, "--load", help=LOAD_HELP + ", per scenario and trace", callback=checked_load),
) -> None:
    """Every heuristic and the oracle on cluster scenarios: one table per scenario and trace."""
    import shlex
    import sys

    from kvray.apps.cluster_eval import evaluate, write_results
    from kvray.policy import make_policy
    from kvray.policy.cluster import make_cluster_policy
    from kvray.scenario import load_scenario
    from kvray.sim.load import describe
    from kvray.sim.workloads import WorkloadSpec, generate
    from kvray.traces import read_trace

    with reported_errors():
        scenarios = {load_scenario(s).name: load_scenario(s) for s in scenario}
        traces = {t.stem: read_trace(t, limit=limit) for t in trace}
        if generated:
            spec = WorkloadSpec(sessions=max(1, generated // 4), system_prompt_pages=1, document_probability=0.5)
            traces[f"generated-{generated}"] = generate(spec, seed=0)
        if not traces:
            raise ConfigError("give at least one --trace or --generated N")
        candidates = []
        for pair in policy:
            node_policy, plus, cluster_policy = pair.partition("+")
            if not plus or not node_policy or not cluster_policy:
                raise ConfigError(f"--policy {pair!r}: expected NODE_POLICY+CLUSTER_POLICY, e.g. rl+cost-router")
            make_policy(node_policy), make_cluster_policy(cluster_policy)  # unknown names fail before any replay
            candidates.append((node_policy, cluster_policy))
        total = len(scenarios) * len(traces)
        with console.status("replaying") as status:
            rows = evaluate(
                scenarios, traces, capacity_fraction, progress=lambda what: status.update(what), candidates=candidates, load=load
            )
        for row in {(r["scenario"], r["trace"]): r for r in rows if "load" in r}.values():
            console.print(f"{row['scenario']} / {row['trace']}: {describe(row['load'])}", soft_wrap=True)
        command = "kvray " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        paths = write_results(rows, out, command)
    console.print(f"{total} tables; wrote {', '.join(str(p) for p in paths)}")


@app.command()
def train(
    scenario: list[Path] = typer.Option(
        [], "--scenario", help="training scenario YAML(s), one node or a cluster (default simulations/h100-llama8b.yaml)"
    ),
    bandwidth_scale: list[float] = typer.Option(
        [1.0], "--bandwidth-scale", help="link bandwidths trained over: each scenario with every link this many times as fast"
    ),
    trace: list[Path] = typer.Option(..., "--trace", help="training trace(s); each is split by time"),
    timesteps: int = typer.Option(50_000, "--timesteps", min=0, help="PPO steps after the counterfactual fit (0: none)"),
    horizon: int = typer.Option(
        8, "--counterfactual-horizon", min=0, help="windows of every expert's future cost the scorer is first fitted to (0: none)"
    ),
    epochs: int = typer.Option(300, "--counterfactual-epochs", min=1, help="full-batch epochs of that fit"),
    correction_decay: float = typer.Option(
        0.0,
        "--correction-decay",
        min=0.0,
        help="penalty on the size of the fitted correction to follow-the-leader (0: none; docs/sim-eval)",
    ),
    out: Path = typer.Option(..., "--out", help="policy folder, e.g. policies/mine"),
    seed: int = typer.Option(0, "--seed"),
    train_fraction: float = typer.Option(0.6, "--train-fraction", help="first part of each trace (by time) trained on"),
    family: list[str] = typer.Option(
        ["chat", "document", "agent", "bursty", "phase"],
        "--family",
        help="generated workload families trained on (kvray generate)",
    ),
    fraction: list[float] = typer.Option(
        [0.02, 0.05, 0.10, 0.25], "--capacity-fraction", help="cache sizes trained on: device+host = F x unique pages"
    ),
    holdout: list[Path] = typer.Option([], "--holdout", help="traces held out whole, evaluated in the card"),
    evaluate: bool = typer.Option(True, "--evaluate/--no-evaluate", help="score the policy on held-out data"),
    tensorboard: Path = typer.Option(None, "--tensorboard", help="TensorBoard log folder (default OUT/tensorboard)"),
    json_out: bool = typer.Option(False, "--json", help="print the model card as one JSON object"),
    jobs: int = typer.Option(1, "--jobs", min=1, help="counterfactual replays run at once (worker processes)"),
) -> None:
    """Train the RL placement policy (the selector of the adaptive expert policy): fitted to every expert's
    counterfactual cost, then PPO, on generated workload families and the first part of each trace, replayed on
    every --scenario (one node or a cluster) at every --bandwidth-scale; writes
    policy.safetensors, card.json and TensorBoard logs. --correction-decay penalises the size of the fitted
    correction to follow-the-leader; 0 by default, as leave-one-source-out cross-validation over the training
    sources chose (docs/sim-eval).
    Progress and logs go to stderr, so stdout holds only the result."""
    from kvray.rl.train import train as run_training
    from kvray.scenario import DEFAULT_SCENARIO, load_scenario

    bad_scale = next((b for b in bandwidth_scale if not b > 0), None)
    if bad_scale is not None:
        raise typer.BadParameter(f"must be positive, got {bad_scale}", param_hint="--bandwidth-scale")
    with reported_errors():
        bases = [load_scenario(path) for path in scenario or [DEFAULT_SCENARIO]]
        nearest_first = sorted(bandwidth_scale, key=lambda b: abs(math.log(b)))  # the first scenario gives the default tier costs
        scenarios = [s if b == 1.0 else s.with_bandwidth(b) for s in bases for b in nearest_first]
        spec = bases[0]

        def score(folder: Path, held_out: list) -> dict:
            from kvray.apps.evaluate import HEURISTICS, compare, goals
            from kvray.traces import read_trace

            sets = {f"{t.stem}@{train_fraction:g}": h for t, h in zip(trace, held_out)}
            sets.update({t.stem: read_trace(t) for t in holdout})
            rows = compare(
                sets,
                [*HEURISTICS, "belady", f"rl:{folder}"],
                [0.05, 0.10],
                spec,
                progress=lambda what: console.print(f"evaluating {what}"),
            )
            for row in rows:
                row["policy"] = "rl" if row["policy"].startswith("rl:") else row["policy"]
            return {"goals": goals(rows), "rows": [{k: r[k] for k in _CARD_KEYS} for r in rows]}

        card = run_training(
            scenarios,
            trace,
            timesteps,
            out,
            seed,
            train_fraction,
            capacity_fractions=fraction,
            families=family,
            counterfactual_horizon=horizon,
            counterfactual_epochs=epochs,
            correction_decay=correction_decay,
            progress=True,
            evaluate=score if evaluate else None,
            tensorboard=tensorboard or out / "tensorboard",
            jobs=jobs,
        )
    fitted = card["training"]["counterfactual"]
    fit_line = (
        f"fitted to {fitted['choices']} counterfactual choices in {fitted['wall_s']} s (expected regret "
        f"{fitted['fitted_expected_regret']}, follow-the-leader {fitted['follow_the_leader_regret']}); "
        if fitted
        else ""
    )
    console.print(f"wrote {out}: {fit_line}{card['training']['timesteps']} PPO steps in {card['training']['wall_s']} s")
    if json_out:
        print(json.dumps(card))
    elif "evaluation" in card:
        print(json.dumps(card["evaluation"]["goals"], indent=2))


_CARD_KEYS = ("trace", "capacity_fraction", "policy", "token_hit_rate", "mean_ttft_ms", "p99_ttft_ms")


@app.command(name="eval")
def eval_(
    trace: list[str] = typer.Option(..., "--trace", help="PATH or PATH@F (only requests after fraction F of its time)"),
    policy: list[str] = typer.Option(
        ["lru", "lfu", "arc", "wfq", "threshold", "lecar", "s3fifo", "sieve", "belady", "experts", "rl"],
        "--policy",
        help="policies to compare (rl: the shipped one, rl:PATH: a trained one; several rl:PATH are seeds)",
    ),
    fraction: list[float] = typer.Option(
        [0.02, 0.05, 0.10, 0.25], "--capacity-fraction", help="device+host = F x unique pages; one value draws bars"
    ),
    scenario: Path = typer.Option(None, "--scenario", help="scenario YAML (default simulations/h100-llama8b.yaml)"),
    bandwidth_scale: float = typer.Option(1.0, "--bandwidth-scale", help="every link of the scenario this many times as fast"),
    out: Path = typer.Option(Path("results/eval"), "--out", help="folder for eval.json and plots"),
    card: Path = typer.Option(None, "--card", help="model card whose training curve to plot (default: the rl policy's)"),
    jobs: int = typer.Option(1, "--jobs", min=1, help="replays run at once (worker processes)"),
    noise: int = typer.Option(
        0, "--noise", min=0, help="also replay each cell's best heuristic and rl on N copies less one request (noise.md)"
    ),
    load: float = typer.Option(None, "--load", help=LOAD_HELP + ", per trace and capacity", callback=checked_load),
) -> None:
    """Compare policies over traces and capacities; writes eval.json and plots.
    A trace is PATH, PATH@F (after fraction F of its time) or gen:NAME:SEED (kvray generate's families);
    --bandwidth-scale evaluates at link bandwidths the policy was not trained at; --noise N
    says per cell how far one request left out moves the best heuristic, and rl's ratio then;
    --load U replays each cell's trace with its arrival gaps scaled so that LRU keeps the
    prefill engines busy U of the time there."""
    from kvray.apps.evaluate import (
        compare,
        goals,
        load_trace_spec,
        loads,
        markdown_table,
        noise_counts,
        noise_floor,
        noise_table,
        plot,
        targets,
        write_report,
    )
    from kvray.policy.rl import CARD_FILE, DEFAULT_POLICY, decision_time_us, load_scorer
    from kvray.resources import shipped_or_given
    from kvray.scenario import DEFAULT_SCENARIO, load_scenario

    if not bandwidth_scale > 0:
        raise typer.BadParameter(f"must be positive, got {bandwidth_scale}", param_hint="--bandwidth-scale")
    if noise and not any(p.startswith("rl") for p in policy):
        raise typer.BadParameter("compares rl with the best heuristic: add --policy rl (or rl:PATH)", param_hint="--noise")
    with reported_errors():
        spec = load_scenario(scenario or DEFAULT_SCENARIO)
        if bandwidth_scale != 1.0:
            spec = spec.with_bandwidth(bandwidth_scale)
        traces = dict(load_trace_spec(t) for t in trace)
        total = len(traces) * len(policy) * len(fraction)
        with progress_bar(total, "eval") as tick:
            done = iter(range(total))
            rows = compare(traces, policy, fraction, spec, progress=lambda what: tick(next(done)), jobs=jobs, load=load)
        learned = next((p for p in policy if p.startswith("rl")), None)
        cells = goals(rows, learned=learned or "rl")
        summary: dict = {"capacity": cells, "targets": targets(cells, learned=learned or "rl")}
        if load is not None:
            from kvray.sim.load import describe

            summary["load"] = loads(rows)
            for cell, record in summary["load"].items():
                console.print(f"{cell}: {describe(record)}", soft_wrap=True)
        if noise:
            replays = len(cells) * noise * 2  # the best heuristic and rl on every copy
            with progress_bar(replays, "noise") as tick:
                done = iter(range(replays))
                floor = noise_floor(
                    traces,
                    fraction,
                    cells,
                    spec,
                    noise,
                    learned,
                    progress=lambda what: tick(next(done)),
                    jobs=jobs,
                    loads=summary.get("load"),
                )
            summary["noise"] = {"copies": noise, "counts": noise_counts(floor), "cells": floor}
        folder = shipped_or_given(learned[3:] if learned and learned.startswith("rl:") else DEFAULT_POLICY, "policies")
        if learned is not None:
            summary["rl_decision_us_batched"] = decision_time_us(load_scorer(folder)[0])
        card_path = card or folder / CARD_FILE
        model_card = json.loads(card_path.read_text()) if card_path.is_file() else None
        path = write_report(out, rows, summary)
        (out / "table.md").write_text(markdown_table(cells, policy))
        if noise:
            (out / "noise.md").write_text(noise_table(floor))
        plots = plot(rows, out, model_card)
    console.print(f"wrote {path} and {', '.join(p.name for p in plots)}")
    print(json.dumps(summary, indent=2))


@app.command()
def calibrate(
    out: Path = typer.Option(Path("simulations/this-machine.yaml"), "--out"),
    disk_dir: Path = typer.Option(None, "--disk-dir", help="where to measure the disk (default: the temp dir)"),
    repeats: int = typer.Option(3, "--repeats", min=1),
    size_mib: int = typer.Option(64, "--size-mib", min=1, help="bytes per copy, disk and socket run"),
) -> None:
    """Measure memcpy, disk, loopback and a small Llama's prefill here; write a scenario."""
    from kvray.sim.calibrate import calibrate as measure
    from kvray.sim.calibrate import write_scenario

    with console.status("measuring memcpy, disk, loopback and prefill"):
        scenario = measure(disk_dir, repeats, size_mib)
    write_scenario(scenario, out)
    console.print(f"wrote {out}")
    print(json.dumps(scenario.model_dump(), indent=2))


@app.command()
def generate(
    out: Path = typer.Option(..., "--out", help="trace file to write (.jsonl or .parquet)"),
    family: str = typer.Option(
        None, "--family", help="chat, document, agent, bursty, phase, or a held-out configuration (kvray.sim.workloads)"
    ),
    sessions: int = typer.Option(None, "--sessions", min=1, help="sessions (default: the family's or 500)"),
    seed: int = typer.Option(0, "--seed"),
    spec: Path = typer.Option(None, "--spec", help="WorkloadSpec YAML (fields of kvray.sim.workloads)"),
) -> None:
    """Generate a seeded workload (a family, or a spec's sessions over shared prompts and documents) as a trace."""
    from kvray.core.config import load_yaml
    from kvray.core.errors import ConfigError
    from kvray.sim.workloads import PhasedWorkload, WorkloadSpec, named_workload
    from kvray.sim.workloads import generate as make
    from kvray.traces import write_trace

    with reported_errors():
        if family and spec:
            raise ConfigError("give --family or --spec, not both")
        shape = named_workload(family) if family else load_yaml(spec, WorkloadSpec) if spec else WorkloadSpec()
        if sessions is not None:
            if isinstance(shape, PhasedWorkload):
                raise ConfigError(f"--sessions does not apply to the phased workload {family!r}")
            shape = shape.model_copy(update={"sessions": sessions})
        trace = make(shape, seed)
        write_trace(trace, out)
    console.print(f"wrote {len(trace)} requests to {out}")


@app.command("chat-demo")
def chat_demo(
    model: str = typer.Option("tiny-llama", help="model config under data/models/ (random weights)"),
    turns: int = typer.Option(6, min=1, help="conversation turns"),
    plot: Path | None = typer.Option(None, help="also save TTFT per turn as a chart (PNG) here"),
) -> None:
    """A multi-turn conversation on a real Llama: TTFT per turn, recomputing vs with kvray."""
    from kvray.apps.chat import conversation_demo

    conversation_demo(model_name=model, turns=turns, console=Console(), plot=plot)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
