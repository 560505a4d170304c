"""``kvray cluster-eval --compare``: candidates against the cost router alone, per cell, and how
far apart they land: the seeds of one training recipe, or two recipes.

The full ``cluster-eval`` replays a dozen heuristics and the oracle per cell; comparing the
seeds of a learned router needs none of them, only :data:`REFERENCE` (LRU under the cost
router, the pair the PPO part must beat) on the same cells (same trace, same ``--load``
search). Per cell the table gives each candidate's mean and p99 TTFT, its mean's ratio to
the reference's, and the candidates' spread (max / min mean TTFT - 1); below it, per
candidate, the mean ratio over the cells and the cells it beats the reference on by
:data:`BEATS` or more, and the cells where every candidate is within :data:`WITHIN` of the others.

Example::

    rows = evaluate(scenarios, traces, 0.05, heuristics=(REFERENCE,), candidates=pairs, oracle=False)
    write_comparison(rows, Path("results/seeds"), command="kvray cluster-eval --compare ...")
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

REFERENCE = ("lru", "cost-router")
BEATS = 0.05  # the target: mean TTFT at most 0.95x the reference's
WITHIN = 0.02  # the target: the seeds' mean TTFTs within 2% of each other


def comparison(rows: Sequence[dict]) -> dict:
    """Per cell (scenario, trace) the reference's row, the candidates' rows and their spread;
    per candidate its ratios; the counts the targets are read from."""
    cells = []
    for key in dict.fromkeys((r["scenario"], r["trace"]) for r in rows):
        cell = [r for r in rows if (r["scenario"], r["trace"]) == key]
        reference = next(r for r in cell if (r["policy"], r["cluster_policy"]) == REFERENCE)
        candidates = [r for r in cell if r["candidate"]]
        means = [r["mean_ttft_ms"] for r in candidates]
        cells.append(
            {
                "scenario": key[0],
                "trace": key[1],
                "load": reference.get("load"),
                "reference": reference,
                "candidates": candidates,
                "ratios": [m / reference["mean_ttft_ms"] for m in means],
                "spread": max(means) / min(means) - 1.0,
            }
        )
    names = [f"{r['policy']}+{r['cluster_policy']}" for r in cells[0]["candidates"]] if cells else []
    per_candidate = {
        name: {
            "mean_ratio": sum(c["ratios"][i] for c in cells) / len(cells),
            "cells_beaten_by_5pct": sum(c["ratios"][i] <= 1.0 - BEATS for c in cells),
        }
        for i, name in enumerate(names)
    }
    return {
        "reference": "+".join(REFERENCE),
        "candidates": names,
        "cells": cells,
        "per_candidate": per_candidate,
        "cells_within_2pct": sum(c["spread"] <= WITHIN for c in cells),
    }


def write_comparison(rows: Sequence[dict], out: Path, command: str) -> list[Path]:
    """compare.json (the rows and :func:`comparison`'s summary) and compare.md (the table)."""
    summary = comparison(rows)
    out.mkdir(parents=True, exist_ok=True)
    data = out / "compare.json"
    data.write_text(json.dumps({"command": command, "rows": list(rows), "summary": summary}, indent=2))
    names = summary["candidates"]
    lines = [
        f"# Candidates against {' + '.join(REFERENCE)} (modeled)",
        "",
        f"Reproduce: `{command}`",
        "",
        "Mean / p99 TTFT ms per cell; each candidate's mean as a ratio of the reference's; spread: the",
        "candidates' largest mean TTFT over their least, minus 1.",
        "",
        "| scenario | trace | load | " + " | ".join([" + ".join(REFERENCE), *names]) + " | spread |",
        "|---|---|---|" + "---:|" * (len(names) + 2),
    ]
    for c in summary["cells"]:
        ref, load = c["reference"], c["load"]
        loaded = f"{load['target']:g} (x{load['arrival_scale']:.4g})" if load else ""
        shown = [f"{ref['mean_ttft_ms']:.1f} / {ref['p99_ttft_ms']:.1f}"] + [
            f"{r['mean_ttft_ms']:.1f} ({ratio:.3f}x) / {r['p99_ttft_ms']:.1f}" for r, ratio in zip(c["candidates"], c["ratios"])
        ]
        lines.append(f"| {c['scenario']} | {c['trace']} | {loaded} | " + " | ".join(shown) + f" | {c['spread']:.1%} |")
    n = len(summary["cells"])
    lines += [""]
    for name, s in summary["per_candidate"].items():
        lines.append(
            f"- {name}: mean ratio {s['mean_ratio']:.3f}x over {n} cells; "
            f"{s['cells_beaten_by_5pct']} of {n} cells at <= {1 - BEATS:.2f}x."
        )
    lines += [f"- Cells with every candidate within {WITHIN:.0%} of the others: {summary['cells_within_2pct']} of {n}.", ""]
    table = out / "compare.md"
    table.write_text("\n".join(lines))
    return [data, table]
