"""The ``kvray`` command line: demo, run, up/status/down, sim, train, eval, cluster-eval,
calibrate, generate, bench.

Each command parses its flags (numbers checked against their ranges as they are parsed,
:mod:`kvray.flags`) and calls what does the work, in :mod:`kvray.apps` (one module per
command) or the package it runs; bad input ends it with one line and exit code 2
(:mod:`kvray.cli.reporting`). The training commands' many flags are in :mod:`kvray.cli.training`.
Help is rendered by click's plain formatter (``rich_markup_mode=None``): it shows flags as
flags and every default, where typer's rich panels print a ``<bool>`` after each flag.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer
from rich.console import Console

from kvray.bench import NAMES as BENCHMARKS
from kvray.cli.reporting import console, reported_errors
from kvray.cli.training import train, train_reuse
from kvray.core.errors import ConfigError
from kvray.flags import CAPACITY_FRACTION, COUNT, LOAD, LOAD_HELP, NON_NEGATIVE, POSITIVE, in_range

app = typer.Typer(
    add_completion=False, no_args_is_help=True, rich_markup_mode=None, help="kvray: tiered KV-cache offload and reuse"
)
MAX_NODES = 16  # ReplaySettings.nodes: local Ray nodes one machine starts
MAX_CONTROLLER_SHARDS = 256  # RuntimeConfig.controller_shards


@app.command()
def bench(
    json_out: bool = typer.Option(False, "--json", help="print a JSON list instead of a table"),
    only: list[str] = typer.Option(
        [],
        "--only",
        help="run only benchmarks whose name contains this (repeat for several); the benchmarks: " + ", ".join(BENCHMARKS),
    ),
    quick: bool = typer.Option(False, "--quick", help="fewer repetitions and smaller sizes"),
    out: Path | None = typer.Option(None, "--out", help="also save the results as this JSON file, and a plot beside it (.png)"),
    trace: Path | None = typer.Option(
        None, "--trace", help="serve: replay this Mooncake JSONL trace's sessions closed loop instead of the generated workloads"
    ),
    workload: list[str] = typer.Option(
        [], "--workload", help="serve: run only this part (repeat for several): multiround, agentic (or trace), longdoc"
    ),
) -> None:
    """Run the side-by-side benchmarks: kvray's figure, a baseline's, and their ratio."""
    from kvray.bench import run_benchmarks

    with reported_errors():
        if trace is not None:
            from kvray.bench import chosen_names
            from kvray.bench.serve_workload import TRACE_ENV
            from kvray.traces import read_trace

            if "serve" not in chosen_names(only):
                raise ConfigError("--trace is for the serve benchmark: add --only serve")
            read_trace(trace)  # a bad trace ends here, before any engine starts
            os.environ[TRACE_ENV] = str(trace)
        if workload:
            from kvray.bench import chosen_names
            from kvray.bench.serve import chosen_workloads
            from kvray.bench.serve_workload import WORKLOADS_ENV

            if "serve" not in chosen_names(only):
                raise ConfigError("--workload is for the serve benchmark: add --only serve")
            os.environ[WORKLOADS_ENV] = ",".join(workload)
            chosen_workloads(str(trace) if trace else None)  # an unknown name ends here, before any engine starts
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
    requests: int = typer.Option(400, "--requests", callback=COUNT, help="requests of the bundled conversation trace to replay"),
    nodes: int = typer.Option(2, "--nodes", callback=in_range(2, MAX_NODES), help="local Ray nodes to start"),
    out: str = typer.Option("results", "--out", help="directory for the JSON and the plots"),
    rounds: int = typer.Option(4, "--rounds", callback=NON_NEGATIVE, help="rounds of the multi-round QA (0: skip)"),
    users: int = typer.Option(2, "--users", callback=COUNT, help="users of the multi-round QA"),
) -> None:
    """Measure what kvray buys: a closed-loop multi-round QA on two engines (a real,
    random-weight Llama), no cache vs kvray, TTFT per round; then replay a slice of the real
    conversation trace on local Ray nodes without and with kvray."""
    from kvray.apps.demo import run_demo

    with reported_errors():
        run_demo(requests=requests, nodes=nodes, out_dir=out, console=Console(), rounds=rounds, users=users)  # stdout


@app.command()
def run(
    trace: str = typer.Option(..., "--trace", help="Mooncake JSONL or Parquet trace"),
    policy: str | None = typer.Option(None, "--policy", help="placement policy of every node's tiers (default lru)"),
    cluster_policy: str | None = typer.Option(
        None,
        "--cluster-policy",
        help="decides across nodes: which node serves, keeps each new page, how much of a hit to load, prefetch, "
        "replicate (default local-first; counted in cluster_verbs)",
    ),
    nodes: int | None = typer.Option(
        None, "--nodes", callback=in_range(1, MAX_NODES), help="local Ray nodes to start (ignored with --address)"
    ),
    scenario: str | None = typer.Option(
        None, "--scenario", help="YAML file of replay settings, or a kvray sim scenario (its nodes alike)"
    ),
    address: str | None = typer.Option(None, "--address", help="existing Ray cluster (default: $RAY_ADDRESS)"),
    name: str | None = typer.Option(
        None, "--name", help="replay on this runtime, up on the cluster (kvray up), with its own tiers and policy; it stays up"
    ),
    limit: int | None = typer.Option(None, "--limit", callback=COUNT, help="replay only the first N requests"),
    host_pages: int | None = typer.Option(None, "--host-pages", callback=NON_NEGATIVE, help="host-tier pages per node"),
    disk_pages: int | None = typer.Option(
        None, "--disk-pages", callback=NON_NEGATIVE, help="disk-tier pages per node (needs --disk-root)"
    ),
    disk_root: str | None = typer.Option(None, "--disk-root", help="directory for the nodes' disk tiers"),
    prefill_us: float | None = typer.Option(
        None, "--prefill-us-per-token", callback=NON_NEGATIVE, help="calibrated prefill cost"
    ),
    capacity_fraction: float | None = typer.Option(
        None, "--capacity-fraction", callback=CAPACITY_FRACTION, help="per node, device+host = F x unique pages (as kvray sim)"
    ),
    capacity: int | None = typer.Option(
        None, "--capacity", callback=COUNT, help="per node, device+host pages (other tiers keep their ratio)"
    ),
    json_out: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Replay a trace on the Ray runtime with real page bytes; report measured TTFT and hits."""
    from kvray.apps.replay import print_run, run_replay, settings_from

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
        if cluster_policy is not None and address is None and name is None and settings.nodes == 1:
            raise ConfigError(
                f"--cluster-policy {cluster_policy}: this replay starts one node, and a cluster policy decides "
                "across nodes; give --nodes 2 or more"
            )
        result = run_replay(trace, settings, address, not json_out, runtime_name=name, notify=console.print)
    if result.wrong_pages:
        console.print(f"[red]{result.wrong_pages} pages came back with wrong KV[/]")
        raise typer.Exit(2)
    if json_out:
        print(json.dumps(result.as_dict()))
    else:
        print_run(result, settings, Console(), console)


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
    host_pages: int | None = typer.Option(
        None, "--host-pages", callback=NON_NEGATIVE, help="host-tier pages per node (default 256)"
    ),
    disk_pages: int | None = typer.Option(
        None, "--disk-pages", callback=NON_NEGATIVE, help="disk-tier pages per node (needs --disk-root)"
    ),
    disk_root: str | None = typer.Option(None, "--disk-root", help="directory for the nodes' disk tiers"),
    controller_shards: int | None = typer.Option(
        None,
        "--controller-shards",
        callback=in_range(1, MAX_CONTROLLER_SHARDS),
        help="controller actors sharing the metadata (default 1; README: sizing shards)",
    ),
) -> None:
    """Start a kvray runtime on a Ray cluster that stays up after this command (until kvray down)."""
    from kvray.apps.replay import settings_from
    from kvray.apps.service import describe_up
    from kvray.apps.service import up as start

    with reported_errors():
        config = settings_from(
            scenario,
            runtime={"name": name, "policy": policy, "disk_root": disk_root, "controller_shards": controller_shards},
            tiers={"host": host_pages, "disk": disk_pages},
            replay={},
        ).runtime
        nodes = start(address, config)
    console.print(describe_up(config, nodes))


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
    policy: str | None = typer.Option(
        None,
        "--policy",
        help="each node's policy (kvray.policy.POLICIES), rl:PATH; default lru (belady under --cluster-policy oracle)",
    ),
    cluster_policy: str | None = typer.Option(
        None,
        "--cluster-policy",
        help="on a cluster scenario: local-first (the default), cost-router, always-prefetch, replicate-hot, "
        "or oracle (Belady on every node, searched prefetch/replication)",
    ),
    scenario: Path | None = typer.Option(None, "--scenario", help="scenario YAML (default simulations/h100-llama8b.yaml)"),
    warmup_requests: int = typer.Option(
        0, "--warmup-requests", callback=NON_NEGATIVE, help="requests that fill the cache unmeasured"
    ),
    capacity_fraction: float | None = typer.Option(
        None, "--capacity-fraction", callback=CAPACITY_FRACTION, help="device+host = F x unique pages"
    ),
    capacity: int | None = typer.Option(
        None, "--capacity", callback=COUNT, help="device+host pages (other tiers keep their ratio)"
    ),
    limit: int | None = typer.Option(None, "--limit", callback=COUNT, help="replay only the first N requests"),
    load: float | None = typer.Option(None, "--load", help=LOAD_HELP, callback=LOAD),
    json_out: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Replay a trace through the real cache manager and policy with modeled time."""
    from kvray.apps.sim import print_sim, run_sim

    with reported_errors():
        result = run_sim(
            trace, policy, cluster_policy, scenario, warmup_requests, capacity_fraction, capacity, limit, not json_out, load
        )
    if load is not None:
        from kvray.sim.load import describe

        console.print(describe(result.extra["load"]), soft_wrap=True)
    if json_out:
        print(result.as_json())
    else:
        print_sim(result, cluster_policy, warmup_requests, Console())


@app.command(name="cluster-eval")
def cluster_eval(
    scenario: list[Path] = typer.Option(..., "--scenario", help="cluster scenario YAML (repeat for several)"),
    trace: list[Path] = typer.Option([], "--trace", help="trace file (repeat for several)"),
    generated: int = typer.Option(
        0, "--generated", callback=NON_NEGATIVE, help="also a generated chat workload of about N requests"
    ),
    limit: int | None = typer.Option(None, "--limit", callback=COUNT, help="replay only the first N requests of each trace"),
    capacity_fraction: float = typer.Option(
        0.05, "--capacity-fraction", callback=CAPACITY_FRACTION, help="cluster device+host = F x unique pages"
    ),
    out: Path = typer.Option(Path("results/cluster"), "--out", help="folder for cluster.md, cluster.json, cluster.png"),
    policy: list[str] = typer.Option(
        [], "--policy", help="also NODE_POLICY+CLUSTER_POLICY (e.g. rl+cost-router), reported against the best heuristic"
    ),
    load: float = typer.Option(None, "--load", help=LOAD_HELP + ", per scenario and trace", callback=LOAD),
    bandwidth_scale: list[float] = typer.Option(
        [1.0], "--bandwidth-scale", callback=POSITIVE, help="each scenario with every link this many times as fast (repeat)"
    ),
    shared_disk: bool = typer.Option(
        False, "--shared-disk", help="every drive's reads and writes on one channel (writes delay the loads that read it)"
    ),
    compare: bool = typer.Option(
        False,
        "--compare",
        help="only the --policy pairs beside lru+cost-router (no other heuristic, no oracle): compare.md with each "
        "pair's ratio to it per cell and the pairs' spread (e.g. the seeds of one training)",
    ),
    noise: int = typer.Option(
        0,
        "--noise",
        callback=NON_NEGATIVE,
        help="also replay each cell's best heuristic under each --policy pair's cluster policy, and the pairs, on N "
        "(>= 2) copies of its trace less one request: noise.md with the band and each pair within it",
    ),
) -> None:
    """Every heuristic and the oracle on cluster scenarios: one table per scenario and trace."""
    import shlex
    import sys

    from kvray.apps.cluster_eval import run_cluster_eval

    command = "kvray " + " ".join(shlex.quote(a) for a in sys.argv[1:])

    def notify(line: str) -> None:
        console.print(line, soft_wrap=True)

    with reported_errors(), console.status("replaying") as status:
        tables, paths = run_cluster_eval(
            scenario,
            trace,
            generated,
            limit,
            capacity_fraction,
            out,
            policy,
            command,
            status.update,
            load,
            notify,
            bandwidth_scale,
            compare,
            shared_disk,
            noise,
        )
    console.print(f"{tables} tables; wrote {', '.join(str(p) for p in paths)}")


# the training commands' flags live in kvray/cli/training.py; registered here, in help's order
app.command()(train)
app.command(name="train-reuse")(train_reuse)


@app.command(name="eval")
def eval_(
    trace: list[str] = typer.Option(..., "--trace", help="PATH or PATH@F (only requests after fraction F of its time)"),
    policy: list[str] = typer.Option(
        ["lru", "lfu", "arc", "wfq", "threshold", "lecar", "s3fifo", "sieve", "belady", "experts", "rl"],
        "--policy",
        help="policies to compare (rl: the shipped one, rl:PATH: a trained one; several rl:PATH are seeds)",
    ),
    fraction: list[float] = typer.Option(
        [0.02, 0.05, 0.10, 0.25],
        "--capacity-fraction",
        callback=CAPACITY_FRACTION,
        help="device+host = F x unique pages; one value draws bars",
    ),
    scenario: Path | None = typer.Option(None, "--scenario", help="scenario YAML (default simulations/h100-llama8b.yaml)"),
    bandwidth_scale: float = typer.Option(
        1.0, "--bandwidth-scale", callback=POSITIVE, help="every link of the scenario this many times as fast"
    ),
    out: Path = typer.Option(Path("results/eval"), "--out", help="folder for eval.json and plots"),
    card: Path | None = typer.Option(None, "--card", help="model card whose training curve to plot (default: the rl policy's)"),
    jobs: int = typer.Option(1, "--jobs", callback=COUNT, help="replays run at once (worker processes)"),
    noise: int = typer.Option(
        0,
        "--noise",
        callback=NON_NEGATIVE,
        help="also replay each cell's best heuristic and rl on N copies less one request (noise.md)",
    ),
    load: float = typer.Option(None, "--load", help=LOAD_HELP + ", per trace and capacity", callback=LOAD),
) -> None:
    """Compare policies over traces and capacities; writes eval.json and plots.
    A trace is PATH, PATH@F (after fraction F of its time) or gen:NAME:SEED (kvray generate's families);
    --bandwidth-scale evaluates at link bandwidths the policy was not trained at; --noise N
    says per cell how far one request left out moves the best heuristic, and rl's ratio then."""
    from kvray.apps.evaluate import run_eval

    with reported_errors():
        summary, (report, *plots) = run_eval(
            trace, policy, fraction, scenario, bandwidth_scale, out, card, jobs, noise, load, console.print
        )
    console.print(f"wrote {report} and {', '.join(p.name for p in plots)}")
    print(json.dumps(summary, indent=2))


@app.command()
def calibrate(
    out: Path = typer.Option(Path("simulations/this-machine.yaml"), "--out"),
    disk_dir: Path | None = typer.Option(None, "--disk-dir", help="where to measure the disk (default: the temp dir)"),
    repeats: int = typer.Option(3, "--repeats", callback=COUNT),
    size_mib: int = typer.Option(64, "--size-mib", callback=COUNT, help="bytes per copy, disk and socket run"),
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
    family: str | None = typer.Option(
        None, "--family", help="chat, document, agent, bursty, phase, or a held-out configuration (kvray.sim.workloads)"
    ),
    sessions: int | None = typer.Option(None, "--sessions", callback=COUNT, help="sessions (default: the family's or 500)"),
    seed: int = typer.Option(0, "--seed", callback=NON_NEGATIVE),
    spec: Path | None = typer.Option(None, "--spec", help="WorkloadSpec YAML (fields of kvray.sim.workloads)"),
) -> None:
    """Generate a seeded workload (a family, or a spec's sessions over shared prompts and documents) as a trace."""
    from kvray.apps.generate import generate_trace

    with reported_errors():
        requests = generate_trace(out, family, sessions, seed, spec)
    console.print(f"wrote {requests} requests to {out}")


@app.command("chat-demo")
def chat_demo(
    model: str = typer.Option("tiny-llama", help="model config under data/models/ (random weights)"),
    turns: int = typer.Option(6, callback=COUNT, help="conversation turns"),
    plot: Path | None = typer.Option(None, help="also save TTFT per turn as a chart (PNG) here"),
) -> None:
    """A multi-turn conversation on a real Llama: TTFT per turn, recomputing vs with kvray."""
    from kvray.apps.chat import conversation_demo

    conversation_demo(model_name=model, turns=turns, console=Console(), plot=plot)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
