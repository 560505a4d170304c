"""Comparing policies: every policy over every trace and tight capacity, in one table,
with the goals of the learned policy checked against the best heuristic and Belady, and
plots (hit rate and mean TTFT against capacity, the training curve) beside the JSON.

A trace is named ``PATH`` or ``PATH@F``: the latter keeps only the requests after
fraction ``F`` of its time span, the part :func:`kvray.rl.train.split_by_time` held out;
``gen:NAME:SEED`` is a generated workload (:mod:`kvray.sim.workloads`, a family or a
held-out configuration).

Per cell (trace x capacity) the summary names the best heuristic, each policy's mean TTFT
over it, and the share of the oracle's (Belady's) gain over the best heuristic that the
learned policy captures.

A ratio is only as meaningful as the cell is stable, and a cell whose prefill queue runs
near saturation is not: one request more or less moves a heuristic's own mean TTFT by more
than the 2% the learned policy's goal allows. :func:`noise_floor` measures that per cell,
by replaying the best heuristic and the learned policy on copies of the trace with one
request (a different one per copy) left out.

With ``load`` every cell's trace has its arrival gaps scaled so that LRU keeps the prefill
engines busy that share of the time at the cell's capacity (:mod:`kvray.sim.load`); every
policy of the cell replays that trace, and its rows record the factor (``load``).

Example::

    rows = compare({"conv": held_out}, ["lru", "arc", "belady", "rl"], [0.05, 0.1], scenario)
    goals(rows)["conv@0.05"]["rl_ttft_vs_best_heuristic"]
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kvray.core.errors import ConfigError
from kvray.scenario import Scenario
from kvray.sim.load import find_load, scaled
from kvray.sim.node import node_capacities
from kvray.sim.simulator import simulate
from kvray.traces import TraceRequest, read_trace

HEURISTICS = ("lru", "lfu", "arc", "wfq", "threshold", "lecar", "s3fifo", "sieve")
LEARNED = ("rl", "reuse", "reuse-session-end")  # the learned policies a summary scores (the first named, or NAME:PATH)
WITHIN = 1.02  # the learned policy's goal: mean TTFT at most this times the cell's best heuristic's


def cell_key(trace: str, fraction: float) -> str:
    """How a cell (trace x capacity fraction) is named in every summary: ``trace@fraction``."""
    return f"{trace}@{fraction:g}"


def load_trace_spec(spec: str) -> tuple[str, list[TraceRequest]]:
    """``PATH``, ``PATH@F`` (requests after fraction F of the time span) or ``gen:NAME:SEED``
    -> (name, requests)."""
    if spec.startswith("gen:"):
        from kvray.sim.workloads import generate, named_workload

        name, _, seed = spec[4:].partition(":")
        if not seed.isdigit():
            raise ConfigError(f"{spec}: expected gen:NAME:SEED with a non-negative integer seed")
        return spec[4:], generate(named_workload(name), int(seed))
    path, _, cut = spec.partition("@")
    trace = read_trace(path)
    name = Path(path).stem
    if not cut:
        return name, trace
    from kvray.rl.train import split_by_time

    try:
        fraction = float(cut)
    except ValueError:
        raise ConfigError(f"{spec}: expected PATH@FRACTION, got fraction {cut!r}") from None
    if not 0 <= fraction < 1:
        raise ConfigError(f"{spec}: held-out fraction must be in [0, 1)")
    return f"{name}@{cut}", split_by_time(trace, fraction)[1]  # never empty: the last request is at or after the cut


def _replay_row(job: tuple) -> dict:
    name, trace, fraction, policy, scenario, load = job
    started = time.perf_counter()
    result = simulate(trace, policy, scenario, capacity_fraction=fraction).as_dict()
    loaded = {"load": load} if load is not None else {}
    return {"trace": name, "capacity_fraction": fraction, **result, **loaded, "replay_s": time.perf_counter() - started}


def compare(
    traces: dict[str, Sequence[TraceRequest]],
    policies: Sequence[str],
    fractions: Sequence[float],
    scenario: Scenario,
    progress: Callable[[str], None] | None = None,
    jobs: int = 1,
    load: float | None = None,
) -> list[dict]:
    """One row per (trace, capacity fraction, policy): the replay's JSON plus its wall time;
    ``jobs`` replays run at once in worker processes (every replay is independent). With
    ``load``, each cell's trace is first scaled to it (the row's ``load`` says how)."""
    work = []
    for name, trace in traces.items():
        for f in fractions:
            record = None
            if load is not None:
                found = find_load(trace, scenario, load, node_capacities(scenario, trace, f))
                trace_at, record = found.trace, found.as_dict()
            work += [(name, trace_at if record else trace, f, p, scenario, record) for p in policies]
    return _replay_all(work, progress, jobs)


def loads(rows: Sequence[dict]) -> dict[str, dict]:
    """Per cell of ``rows`` (:func:`compare` with a load): how its trace was scaled."""
    return {cell_key(r["trace"], r["capacity_fraction"]): r["load"] for r in rows if "load" in r}


def _replay_all(work: list[tuple], progress: Callable[[str], None] | None, jobs: int) -> list[dict]:
    if jobs <= 1:
        rows = []
        for job in work:
            if progress is not None:
                progress(f"{job[0]} {job[2]:g} {job[3]}")
            rows.append(_replay_row(job))
        return rows
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(jobs) as pool:
        rows = []
        for job, row in zip(work, pool.map(_replay_row, work)):
            if progress is not None:
                progress(f"{job[0]} {job[2]:g} {job[3]}")
            rows.append(row)
        return rows


def goals(rows: list[dict], learned: str = "rl") -> dict:
    """Per trace and capacity: the best heuristic, every policy's mean TTFT over it (the
    learned policy's goal: <= 1.02), the learned policy's token hit rate over Belady's and
    the share of Belady's TTFT gain over the best heuristic that it captures."""
    out: dict[str, dict] = {}
    for key in sorted({(r["trace"], r["capacity_fraction"]) for r in rows}):
        at = {r["policy"]: r for r in rows if (r["trace"], r["capacity_fraction"]) == key}
        heuristics = [at[p] for p in HEURISTICS if p in at]
        if not heuristics:
            continue
        best = min(heuristics, key=lambda r: r["mean_ttft_ms"])
        entry: dict = {
            "best_heuristic": best["policy"],
            "best_heuristic_ttft_ms": best["mean_ttft_ms"],
            "ttft_vs_best_heuristic": {p: r["mean_ttft_ms"] / best["mean_ttft_ms"] for p, r in at.items()},
        }
        if learned in at:
            entry["rl_ttft_vs_best_heuristic"] = at[learned]["mean_ttft_ms"] / best["mean_ttft_ms"]
        if learned in at and "belady" in at:
            entry["rl_hit_rate_vs_belady"] = at[learned]["token_hit_rate"] / max(at["belady"]["token_hit_rate"], 1e-12)
            gain = best["mean_ttft_ms"] - at["belady"]["mean_ttft_ms"]
            entry["rl_share_of_oracle_gain"] = (best["mean_ttft_ms"] - at[learned]["mean_ttft_ms"]) / gain if gain > 0 else None
        out[cell_key(*key)] = entry
    return out


def without_one_request(trace: Sequence[TraceRequest], seed: int) -> list[TraceRequest]:
    """``trace`` less one request drawn by ``seed``: the smallest change to a workload, for
    telling a policy's effect from the chaos of a saturated prefill queue."""
    import random

    if len(trace) < 2:
        raise ConfigError(f"a noise copy leaves one request out; the trace has {len(trace)}")
    dropped = random.Random(seed).randrange(len(trace))
    return [r for i, r in enumerate(trace) if i != dropped]


def noise_floor(
    traces: dict[str, Sequence[TraceRequest]],
    fractions: Sequence[float],
    summary: dict,
    scenario: Scenario,
    copies: int,
    learned: str = "rl",
    progress: Callable[[str], None] | None = None,
    jobs: int = 1,
    loads: dict[str, dict] | None = None,
) -> dict:
    """Per cell of ``summary`` (:func:`goals` over ``traces`` x ``fractions``): the cell's
    best heuristic and ``learned`` replayed on ``copies`` copies of its trace, each less one
    request (seeds 0..copies-1); with ``loads`` (per cell, how :func:`compare` scaled its
    trace to a load: :func:`loads`) the copies are of the scaled trace.

    ``best_heuristic_moves``: the best heuristic's mean TTFT on each copy over its own on
    the whole trace (how far the reference moves when nothing but one request changes);
    ``rl_ttft_vs_best_heuristic``: the learned policy's over the best heuristic's on the
    same copy, one per copy. A cell where the first spreads wider than WITHIN cannot tell a
    policy within it from one outside it."""
    cells = [(name, f, cell_key(name, f)) for name in traces for f in fractions if cell_key(name, f) in summary]
    trace_copies: dict[tuple[str, float], list[list[TraceRequest]]] = {}  # each built once
    labels, work = [], []  # a replay's (cell, policy), and the replay
    for name, f, cell in cells:
        factor = loads[cell]["arrival_scale"] if loads else 1.0
        if (name, factor) not in trace_copies:
            trace = scaled(traces[name], factor) if factor != 1.0 else traces[name]
            trace_copies[name, factor] = [without_one_request(trace, k) for k in range(copies)]
        for k, copy in enumerate(trace_copies[name, factor]):
            for policy in (summary[cell]["best_heuristic"], learned):
                labels.append((cell, policy))
                work.append((f"{cell}#{k}", copy, f, policy, scenario, None))
    ttft: dict[tuple[str, str], list[float]] = {}
    for label, row in zip(labels, _replay_all(work, progress, jobs)):
        ttft.setdefault(label, []).append(row["mean_ttft_ms"])
    out = {}
    for _, _, cell in cells:
        entry = summary[cell]
        best, rl = ttft[cell, entry["best_heuristic"]], ttft[cell, learned]
        out[cell] = {
            "best_heuristic": entry["best_heuristic"],
            "best_heuristic_moves": [b / entry["best_heuristic_ttft_ms"] for b in best],
            "rl_ttft_vs_best_heuristic": [a / b for a, b in zip(rl, best)],
        }
    return out


def noise_counts(noise: dict) -> dict:
    """Over the cells of :func:`noise_floor`: where the reference itself moves more than 2%
    when one request is left out, and where the learned policy is within WITHIN on every
    copy, on some, and on none."""
    within = [[r <= WITHIN for r in e["rl_ttft_vs_best_heuristic"]] for e in noise.values()]
    return {
        "cells": len(noise),
        "best_heuristic_moves_over_2pct": sum(max(abs(m - 1) for m in e["best_heuristic_moves"]) > 0.02 for e in noise.values()),
        "rl_within_1.02_every_copy": sum(all(w) for w in within),
        "rl_within_1.02_some_copy": sum(any(w) for w in within),
        "rl_within_1.02_no_copy": sum(not any(w) for w in within),
    }


def noise_table(noise: dict) -> str:
    """One line per cell: how far the best heuristic moves over the copies, and the
    learned policy's ratio on each copy (docs/sim-eval)."""
    lines = [
        "| cell (trace@capacity) | best heuristic | its mean TTFT, copy / whole trace | rl x on each copy | copies rl within 1.02x |",
        "|---|---|---|---|---|",
    ]
    for cell, entry in noise.items():
        moves, ratios = entry["best_heuristic_moves"], entry["rl_ttft_vs_best_heuristic"]
        lines.append(
            f"| {cell} | {entry['best_heuristic']} | {min(moves):.3f}-{max(moves):.3f} | "
            f"{' '.join(f'{r:.3f}' for r in ratios)} | {sum(r <= WITHIN for r in ratios)}/{len(ratios)} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], out: Path, card: dict | None = None) -> list[Path]:
    """Hit rate and mean TTFT against capacity, one line per policy and one figure per
    trace (bars per policy when there is one capacity: a line of one point shows nothing);
    the training curve of ``card`` if given. Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for trace in sorted({r["trace"] for r in rows}):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        mine = [r for r in rows if r["trace"] == trace]
        for ax, key, label in zip(axes, ("token_hit_rate", "mean_ttft_ms"), ("token hit rate", "mean TTFT (ms, modeled)")):
            _draw(ax, mine, key)
            ax.set(ylabel=label, title=trace)
        fig.tight_layout()
        path = out / f"{trace.replace('@', '_at_').replace(':', '_')}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    curve = (card or {}).get("training", {}).get("curve")
    if curve:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([c["timesteps"] for c in curve], [c["mean_reward"] for c in curve])
        ax.set(
            xlabel="timesteps", ylabel="mean reward per rollout (-regret, page prefills)", title=f"training: {card.get('name')}"
        )
        fig.tight_layout()
        path = out / "training_curve.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def _draw(ax, rows: list[dict], key: str) -> None:
    """``key`` of one trace's rows: a line per policy over the capacities, or bars when
    every row has the same capacity."""
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    capacities = sorted({r["capacity_fraction"] for r in rows})
    if len(capacities) == 1:
        at = {r["policy"]: r[key] for r in rows}
        ax.bar(policies, [at[p] for p in policies], color="tab:blue")
        ax.set_xlabel(f"policy (device + host capacity {100 * capacities[0]:g}% of unique pages)")
        return
    for policy in policies:
        mine = sorted((r for r in rows if r["policy"] == policy), key=lambda r: r["capacity_fraction"])
        ax.plot([100 * r["capacity_fraction"] for r in mine], [r[key] for r in mine], marker="o", label=policy)
    ax.set_xlabel("device + host capacity (% of unique pages)")
    ax.legend()


def targets(summary: dict, learned: str = "rl") -> dict:
    """The adaptivity target over every cell of ``summary`` (:func:`goals`): the learned
    policy within 1.02x of the best heuristic everywhere, while every heuristic is at
    least 1.05x somewhere; each heuristic's worst cell is named."""
    worst: dict[str, tuple[float, str]] = {}
    for cell, entry in summary.items():
        for policy, ratio in entry["ttft_vs_best_heuristic"].items():
            if policy in HEURISTICS and ratio > worst.get(policy, (0.0, ""))[0]:
                worst[policy] = (ratio, cell)
    learned_ratios = [e["rl_ttft_vs_best_heuristic"] for e in summary.values() if "rl_ttft_vs_best_heuristic" in e]
    return {
        "cells": len(summary),
        "rl_within_1.02_cells": sum(r <= WITHIN for r in learned_ratios),
        "rl_worst_ratio": max(learned_ratios, default=None),
        "every_heuristic_1.05_somewhere": all(r >= 1.05 for r, _ in worst.values()),
        "heuristic_worst": {p: {"ratio": r, "cell": c} for p, (r, c) in worst.items()},
        "met": bool(learned_ratios) and max(learned_ratios) <= WITHIN and all(r >= 1.05 for r, _ in worst.values()),
    }


def markdown_table(summary: dict, policies: Sequence[str]) -> str:
    """One line per cell: the best heuristic's mean TTFT, then each policy's over it, and
    the learned policy's share of the oracle's gain (docs/sim-eval)."""
    head = ["cell (trace@capacity)", "best heuristic (ms)", *(f"{p} x" for p in policies), "rl share of oracle gain"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cell, entry in summary.items():
        ratios = entry["ttft_vs_best_heuristic"]
        share = entry.get("rl_share_of_oracle_gain")
        lines.append(
            "| "
            + " | ".join(
                [
                    cell,
                    f"{entry['best_heuristic']} {entry['best_heuristic_ttft_ms']:.1f}",
                    *(f"{ratios[p]:.3f}" if p in ratios else "-" for p in policies),
                    "-" if share is None else f"{share:.2f}",
                ]
            )
            + " |"
        )
    return "\n".join(lines) + "\n"


def write_report(out: Path, rows: list[dict], summary: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "eval.json"
    path.write_text(json.dumps({"goals": summary, "rows": rows}, indent=2) + "\n")
    return path


def run_eval(
    trace_specs: Sequence[str],
    policies: Sequence[str],
    fractions: Sequence[float],
    scenario: Path | None,
    bandwidth_scale: float,
    out: Path,
    card: Path | None = None,
    jobs: int = 1,
    noise: int = 0,
    load: float | None = None,
    notify: Callable[[str], None] | None = None,
) -> tuple[dict, list[Path]]:
    """What ``kvray eval`` does: every policy over every trace (:func:`load_trace_spec`) and
    capacity fraction on ``scenario`` at ``bandwidth_scale``; writes eval.json, table.md (and
    noise.md with ``noise`` copies per cell, :func:`noise_floor`) and the plots (with the
    training curve of ``card``, by default the learned policy's) into ``out``. With ``load``
    each cell's trace is replayed at that busy share (``notify`` hears the factors found).
    Returns the summary and the files written."""
    from kvray.policy.rl import CARD_FILE, DEFAULT_POLICY, decision_time_us, load_scorer
    from kvray.progress import progress_bar
    from kvray.resources import shipped_or_given
    from kvray.scenario import DEFAULT_SCENARIO, load_scenario

    learned = next((p for p in policies if p.partition(":")[0] in LEARNED), None)
    if noise and learned is None:
        raise ConfigError(
            "--noise compares a learned policy with the best heuristic: add --policy rl, reuse or reuse-session-end (or NAME:PATH)"
        )
    spec = load_scenario(scenario or DEFAULT_SCENARIO)
    if bandwidth_scale != 1.0:
        spec = spec.with_bandwidth(bandwidth_scale)
    traces = dict(load_trace_spec(t) for t in trace_specs)
    total = len(traces) * len(policies) * len(fractions)
    with progress_bar(total, "eval") as tick:
        done = iter(range(total))
        rows = compare(traces, policies, fractions, spec, progress=lambda what: tick(next(done)), jobs=jobs, load=load)
    cells = goals(rows, learned=learned or "rl")
    summary: dict = {"capacity": cells, "targets": targets(cells, learned=learned or "rl")}
    if load is not None:
        from kvray.sim.load import describe

        summary["load"] = loads(rows)
        for cell, record in summary["load"].items():
            if notify is not None:
                notify(f"{cell}: {describe(record)}")
    if noise:
        replays = len(cells) * noise * 2  # the best heuristic and rl on every copy
        with progress_bar(replays, "noise") as tick:
            done = iter(range(replays))
            floor = noise_floor(
                traces,
                fractions,
                cells,
                spec,
                noise,
                learned,
                progress=lambda what: tick(next(done)),
                jobs=jobs,
                loads=summary.get("load"),
            )
        summary["noise"] = {"copies": noise, "counts": noise_counts(floor), "cells": floor}
    if learned is not None and learned.partition(":")[0] == "reuse":
        from kvray.policy.reuse import DEFAULT_MODEL
        from kvray.policy.reuse_model import ReuseModel
        from kvray.policy.reuse_model import decision_time_us as page_decision_us

        folder = shipped_or_given(learned.partition(":")[2] or DEFAULT_MODEL, "policies")
        summary["reuse_decision_us_per_page_batched"] = page_decision_us(ReuseModel.load(folder))
    else:
        folder = shipped_or_given(learned[3:] if learned and learned.startswith("rl:") else DEFAULT_POLICY, "policies")
        if learned is not None:
            summary["rl_decision_us_batched"] = decision_time_us(load_scorer(folder)[0])
    card_path = card or folder / CARD_FILE
    model_card = json.loads(card_path.read_text()) if card_path.is_file() else None
    written = [write_report(out, rows, summary)]
    (out / "table.md").write_text(markdown_table(cells, policies))
    if noise:
        (out / "noise.md").write_text(noise_table(floor))
    return summary, written + plot(rows, out, model_card)
