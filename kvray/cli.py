"""The ``kvray`` command line: demo, bench (and, as they land, sim, train, eval, run, status)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

import typer
from rich.console import Console

from kvray.errors import KvrayError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="kvray: tiered KV-cache offload and reuse")
console = Console(stderr=True)


@contextmanager
def reported_errors() -> Iterator[None]:
    """Bad input ends the command with its one-line message (exit 1), not a traceback."""
    try:
        yield
    except KvrayError as exc:
        console.print(f"[red]kvray: {exc}[/]")
        raise typer.Exit(1) from None


@app.command()
def bench(
    json_out: bool = typer.Option(False, "--json", help="print a JSON list instead of a table"),
    only: list[str] = typer.Option([], "--only", help="run only benchmarks whose name contains this"),
    quick: bool = typer.Option(False, "--quick", help="fewer repetitions and smaller sizes"),
) -> None:
    """Run the side-by-side benchmarks: kvray's figure, a baseline's, and their ratio."""
    from benchmarks import run_benchmarks

    results = run_benchmarks(only=only, quick=quick, progress=not json_out)
    if json_out:
        print(json.dumps([r.as_dict() for r in results], indent=2))
    else:
        from benchmarks.report import print_table

        print_table(results)


@app.command()
def demo(
    requests: int = typer.Option(400, "--requests", help="requests of the bundled conversation trace to replay"),
    nodes: int = typer.Option(2, "--nodes", min=2, help="local Ray nodes to start"),
    out: str = typer.Option("results", "--out", help="directory for the JSON and the plot"),
) -> None:
    """Replay a slice of the real conversation trace on local Ray nodes; compare policies."""
    from kvray.cluster.demo import run_demo

    with reported_errors():
        run_demo(requests=requests, nodes=nodes, out_dir=out, console=console)


@app.command()
def run(
    trace: str = typer.Option(..., "--trace", help="Mooncake JSONL or Parquet trace"),
    policy: str | None = typer.Option(None, "--policy", help="placement policy of every node's tiers (default lru)"),
    nodes: int | None = typer.Option(None, "--nodes", help="local Ray nodes to start (ignored with --address)"),
    scenario: str | None = typer.Option(None, "--scenario", help="YAML file of replay settings"),
    address: str | None = typer.Option(None, "--address", help="existing Ray cluster (default: $RAY_ADDRESS)"),
    limit: int | None = typer.Option(None, "--limit", help="replay only the first N requests"),
    host_pages: int | None = typer.Option(None, "--host-pages", help="host-tier pages per node"),
    disk_pages: int | None = typer.Option(None, "--disk-pages", help="disk-tier pages per node (needs --disk-root)"),
    disk_root: str | None = typer.Option(None, "--disk-root", help="directory for the nodes' disk tiers"),
    prefill_us: float | None = typer.Option(None, "--prefill-us-per-token", help="calibrated prefill cost"),
    json_out: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Replay a trace on the Ray runtime with real page bytes; report measured TTFT and hits."""
    from kvray.cluster.replay import run_replay, settings_from

    with reported_errors():
        settings = settings_from(
            scenario,
            runtime={"policy": policy, "disk_root": disk_root},
            tiers={"host": host_pages, "disk": disk_pages},
            replay={"nodes": nodes, "limit": limit, "prefill_us_per_token": prefill_us},
        )
        result = run_replay(trace, settings, address=address, progress=not json_out)
    if result.wrong_pages:
        console.print(f"[red]{result.wrong_pages} pages came back with wrong KV[/]")
        raise typer.Exit(2)
    if json_out:
        print(json.dumps(result.as_dict()))
    else:
        from kvray.cluster.demo import print_results

        print_results({settings.runtime.policy: result}, console)


@app.command()
def status(
    address: str | None = typer.Option(None, "--address", help="Ray cluster (default: $RAY_ADDRESS or a local one)"),
    name: str = typer.Option("kvray", "--name", help="kvray runtime name"),
    json_out: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Metrics of a running kvray runtime: hit rate, hits per tier, occupancy, latency, bytes moved."""
    from kvray.cluster.status import fetch_status, print_status

    with reported_errors():
        snapshot = fetch_status(address, name)
    if json_out:
        print(json.dumps(snapshot, default=str))
    else:
        print_status(snapshot, console)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
