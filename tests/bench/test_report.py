"""``kvray bench --out``: the JSON holds every row as printed, and a plot lies beside it."""

import json

from kvray.bench import BenchResult
from kvray.bench.report import save


def test_save_writes_every_row_and_a_plot(tmp_path):
    results = [
        BenchResult("fast", kvray=3.0, baseline=2.0, unit="GB/s", goal=">= 1.0", params={"n": 1}),
        BenchResult("slow", kvray=30.0, baseline=20.0, unit="ms", goal="<= 1.0"),
        BenchResult("plain", kvray=1.0, baseline=4.0, unit="us"),
    ]
    plot = save(results, tmp_path / "out" / "bench.json")
    rows = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert [(r["name"], r["ratio"], r["meets_goal"]) for r in rows] == [
        ("fast", 1.5, True),
        ("slow", 1.5, False),
        ("plain", 0.25, None),
    ]
    assert rows[0]["params"] == {"n": 1}
    assert plot == tmp_path / "out" / "bench.png" and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
