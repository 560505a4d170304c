"""The ``kvray`` command line: demo, bench (and, as they land, sim, train, eval, run, status)."""

from __future__ import annotations

import json
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


@app.command("chat-demo")
def chat_demo(
    model: str = typer.Option("tiny-llama", help="model config under data/models/ (random weights)"),
    turns: int = typer.Option(6, min=1, help="conversation turns"),
    plot: Path | None = typer.Option(None, help="also save TTFT per turn as a chart (PNG) here"),
) -> None:
    """A multi-turn conversation on a real Llama: TTFT per turn, recomputing vs with kvray."""
    from kvray.engines.demo import conversation_demo

    conversation_demo(model_name=model, turns=turns, console=Console(), plot=plot)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
