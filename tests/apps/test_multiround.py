"""The demo's multi-round QA (kvray.apps.multiround): each round reuses the user's whole
history from kvray whichever engine computed it, replies agree with recompute, and the
output names what was measured."""

from __future__ import annotations

import io
import json

from rich.console import Console

from kvray.apps.multiround import multiround_qa, per_round, plot_rounds, run_multiround, summary_line

PAGE, SYSTEM, QUESTION, ANSWER = 16, 128, 16, 4
ROWS = [
    {"round": r, "user": 0, "prompt_tokens": 10, "cached_tokens": 8, "ttft_no_cache_ms": 30.0, "ttft_kvray_ms": 10.0, "same_reply": True}
    for r in (1, 2)
]  # fmt: skip


def test_each_round_loads_the_history_the_other_engine_computed_and_replies_agree():
    rows = multiround_qa(
        users=2, rounds=3, system_tokens=SYSTEM, question_tokens=QUESTION, answer_tokens=ANSWER, page_tokens=PAGE
    )
    assert [(r["round"], r["user"]) for r in rows] == [(1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1)]
    assert [r["engine"] for r in rows] == [1, 0, 0, 1, 1, 0]  # no affinity: a user changes engine every round
    assert rows[0]["cached_tokens"] == 0  # the very first request: nothing cached
    assert rows[1]["cached_tokens"] == SYSTEM  # the shared system prompt, computed by the other engine
    by_user = {u: [r for r in rows if r["user"] == u] for u in (0, 1)}
    for history in by_user.values():
        for previous, row in zip(history, history[1:]):  # the whole previous prompt + answer, in full pages
            assert row["cached_tokens"] == (previous["prompt_tokens"] + ANSWER - 1) // PAGE * PAGE
            assert row["engine"] != previous["engine"]
    assert all(r["same_reply"] for r in rows)
    means = per_round(rows)
    assert [m["round"] for m in means] == [1, 2, 3] and means[1]["cached_tokens"] > means[0]["cached_tokens"]
    line = summary_line(rows)
    assert line.startswith("kvray bought: mean time to first token ") and " ms -> " in line
    assert "with the same replies" in line and "2 users x 3 rounds of multi-round QA (6 requests), closed loop" in line


def test_the_demo_part_prints_the_rounds_and_names_its_files(tmp_path, monkeypatch):
    import kvray.apps.multiround as multiround

    small = dict(system_tokens=SYSTEM, question_tokens=QUESTION, answer_tokens=ANSWER, page_tokens=PAGE)
    monkeypatch.setattr(multiround, "multiround_qa", lambda users, rounds: multiround_qa(users, rounds, **small))
    out = io.StringIO()
    rows = run_multiround(2, 2, tmp_path, Console(file=out, width=200))
    text = out.getvalue()
    assert "mean time to first token per round" in text and "TTFT kvray" in text
    for name in ("multiround.json", "multiround_ttft.png"):
        assert str(tmp_path / name) in text
    assert json.loads((tmp_path / "multiround.json").read_text())["requests"] == rows
    assert (tmp_path / "multiround_ttft.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_plot_starts_both_axes_at_zero(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    limits = []
    monkeypatch.setattr(
        plt.Figure, "savefig", lambda fig, *a, **k: limits.append((fig.axes[0].get_xlim(), fig.axes[0].get_ylim()))
    )
    plot_rounds(ROWS, tmp_path / "p.png")
    (xlim, ylim) = limits[0]
    assert xlim[0] == 0 and ylim[0] == 0


def test_the_summary_says_slower_when_kvray_was_slower():
    assert "(3.0x faster)" in summary_line(ROWS)
    assert "(3.0x SLOWER: was the machine busy?)" in summary_line([dict(r, ttft_kvray_ms=90.0) for r in ROWS])
