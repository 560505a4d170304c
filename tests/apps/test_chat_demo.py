"""The conversation demo: later turns load their history from kvray and reply exactly as recompute does."""

from __future__ import annotations

import io

from rich.console import Console
from typer.testing import CliRunner

from kvray.apps.chat import conversation_demo, speed_up
from kvray.cli import app


def test_later_turns_reuse_history_and_agree_with_recompute():
    out = io.StringIO()
    rows = conversation_demo(
        turns=3, system_tokens=200, user_tokens=40, reply_tokens=8, page_tokens=16, console=Console(file=out, width=150)
    )
    assert [r["turn"] for r in rows] == [1, 2, 3]
    assert rows[0]["cached_tokens"] == 0
    for previous, row in zip(rows, rows[1:]):  # the whole previous prompt + reply, in full pages
        assert row["cached_tokens"] == (previous["prompt_tokens"] + 8 - 1) // 16 * 16
    assert all(r["same_reply"] for r in rows)
    assert "TTFT kvray" in out.getvalue() and "—" in out.getvalue()
    assert speed_up(rows[0]) == "—"  # kvray gave turn 1 nothing: no speed-up to claim
    assert all(speed_up(r).endswith("x") for r in rows[1:])


def test_chat_demo_command_prints_the_table_and_saves_the_chart(tmp_path):
    chart = tmp_path / "ttft.png"
    result = CliRunner().invoke(app, ["chat-demo", "--turns", "2", "--plot", str(chart)])
    assert result.exit_code == 0, result.output
    assert "time to first token per turn" in result.output
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
