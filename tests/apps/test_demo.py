"""`kvray demo` (what `make demo` runs), end to end in its own process on a short slice."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


@pytest.mark.slow
def test_demo_replays_without_and_with_kvray_and_serves_a_real_model(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "kvray", "demo", "--requests", "40", "--chat-turns", "2", "--out", str(tmp_path)],
        capture_output=True, text=True, cwd=ROOT, timeout=420,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads((tmp_path / "demo.json").read_text())
    assert set(results) == {"no cache", "kvray (lru)"}
    plain, kvray = results["no cache"], results["kvray (lru)"]
    for result in results.values():
        assert result["requests"] == 40 and result["wrong_pages"] == 0
    assert plain["tokens"] == kvray["tokens"] > 0  # the same requests both ways
    assert plain["hit_tokens"] == 0 and plain["bytes_moved"] == 0 and plain["policy"] == "none"
    assert kvray["hit_tokens"] > 0 and kvray["hit_tokens"] == sum(kvray["hit_tokens_by_tier"].values())
    assert (tmp_path / "demo.png").stat().st_size > 0 and (tmp_path / "chat_ttft.png").stat().st_size > 0
    assert "turn" in out.stdout and "TTFT" in out.stdout
