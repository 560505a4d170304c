"""`kvray demo` (what `make demo` runs), end to end in its own process on a short slice."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


@pytest.mark.slow
def test_demo_leads_with_the_multiround_gain_then_replays_without_and_with_kvray(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "kvray", "demo", "--requests", "40", "--rounds", "2", "--out", str(tmp_path)],
        capture_output=True, text=True, cwd=ROOT, timeout=420,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    qa = json.loads((tmp_path / "multiround.json").read_text())
    assert [r["round"] for r in qa["rounds"]] == [1, 2] and len(qa["requests"]) == 4  # 2 users x 2 rounds
    assert {r["engine"] for r in qa["requests"]} == {0, 1}
    assert all(r["same_reply"] for r in qa["requests"])
    assert qa["rounds"][0]["cached_tokens"] < qa["rounds"][1]["cached_tokens"]  # round 2 reuses its whole history
    results = json.loads((tmp_path / "demo.json").read_text())
    assert set(results) == {"no cache", "kvray (lru)"}
    plain, kvray = results["no cache"], results["kvray (lru)"]
    for result in results.values():
        assert result["requests"] == 40 and result["wrong_pages"] == 0
    assert plain["tokens"] == kvray["tokens"] > 0  # the same requests both ways
    assert plain["hit_tokens"] == 0 and plain["bytes_moved"] == 0 and plain["policy"] == "none"
    assert kvray["hit_tokens"] > 0 and kvray["hit_tokens"] == sum(kvray["hit_tokens_by_tier"].values())
    stdout = out.stdout
    assert stdout.index("multi-round QA: 2 users x 2 rounds") < stdout.index("replaying requests")  # the gain first
    for plot in ("multiround_ttft.png", "demo.png"):  # every plot saved and named
        assert (tmp_path / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and str(tmp_path / plot) in stdout
    last = stdout.strip().splitlines()[-1]
    assert last.startswith("kvray bought: mean time to first token") and "2 users x 2 rounds" in last
    assert " ms -> " in last and "with the same replies" in last  # faster or not: a busy machine decides
