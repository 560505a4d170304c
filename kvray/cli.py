"""The ``kvray`` command line: demo, bench, sim, train, eval, calibrate (run, status as they land)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import typer
from rich.console import Console

app = typer.Typer(add_completion=False, no_args_is_help=True, help="kvray: tiered KV-cache offload and reuse")
console = Console(stderr=True)


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
def demo() -> None:
    """The main job on an embedded default: the benchmarks, quick."""
    from benchmarks import run_benchmarks
    from benchmarks.report import print_table

    print_table(run_benchmarks(only=[], quick=True, progress=True))


@app.command()
def sim(
    trace: Path = typer.Option(..., "--trace", help="Mooncake JSONL or Parquet trace"),
    policy: str = typer.Option("lru", "--policy", help="lru, lfu, arc, wfq, threshold, belady, rl or rl:PATH"),
    scenario: Path = typer.Option(None, "--scenario", help="scenario YAML (default simulations/h100-llama8b.yaml)"),
    warmup_requests: int = typer.Option(0, "--warmup-requests", help="requests that fill the cache unmeasured"),
    capacity_fraction: float = typer.Option(None, "--capacity-fraction", help="device+host = F x unique pages"),
    capacity: int = typer.Option(None, "--capacity", help="device+host pages (other tiers keep their ratio)"),
    limit: int = typer.Option(None, "--limit", help="replay only the first N requests"),
    json_out: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """Replay a trace through the real cache manager and policy with modeled time."""
    from kvray.sim.cost import DEFAULT_SCENARIO, load_scenario
    from kvray.sim.simulator import simulate
    from kvray.traces import read_trace

    with _errors():
        requests = read_trace(trace, limit=limit)
        spec = load_scenario(scenario or DEFAULT_SCENARIO)
        with _progress(len(requests), f"sim {policy}", enabled=not json_out) as tick:
            result = simulate(requests, policy, spec, warmup_requests, capacity_fraction, capacity, tick)
    if json_out:
        print(result.as_json())
    else:
        _print_result(result.as_dict())


@contextmanager
def _errors() -> Iterator[None]:
    """Bad input ends the command with its message (exit code 2), not a traceback."""
    from kvray.errors import KvrayError

    try:
        yield
    except KvrayError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None


@contextmanager
def _progress(total: int, label: str, enabled: bool = True) -> Iterator[Callable[[int], None] | None]:
    """A rich progress bar on stderr; yields a callback taking the index of the item done."""
    if not enabled:
        yield None
        return
    from rich.progress import Progress

    with Progress(console=console, transient=True) as bar:
        task = bar.add_task(label, total=total)
        step = max(1, total // 200)
        yield lambda i: bar.update(task, completed=i + 1) if (i + 1) % step == 0 else None


def _print_result(result: dict) -> None:
    from rich.table import Table

    table = Table(show_header=False)
    for key, value in result.items():
        table.add_row(key, f"{value:.4g}" if isinstance(value, float) else str(value))
    Console().print(table)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
