"""Trace replay on the runtime (``kvray run``), on the session's three real Ray nodes."""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import pytest
import ray

from kvray.apps import replay as replay_module
from kvray.apps.replay import Replay, ReplaySettings, replay_on_runtime
from kvray.cluster import Runtime, RuntimeConfig
from kvray.cluster.runtime import name_taken
from kvray.core.config import PageLayout, TierSizes
from kvray.core.errors import ClusterError
from kvray.traces import read_trace
from tests.cluster.test_transfer import eventually
from tests.conftest import REPLAY_KEYS, RESULT_KEYS, RUNTIME_KEYS, kvray_command

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "data" / "traces" / "conversation_trace_first30min.jsonl"
LAYOUT = PageLayout(layers=2, kv_heads=2, head_dim=16, page_tokens=512, dtype="float16")
_names = itertools.count()


def trace_slice(start: int = 1000, n: int = 40):
    """A slice of the real conversation trace where returning conversations hit."""
    return read_trace(TRACE)[start : start + n]


def settings(**runtime) -> ReplaySettings:
    config = RuntimeConfig(name=f"r{next(_names)}", layout=LAYOUT, **runtime)
    return ReplaySettings(name="test", nodes=3, runtime=config, prefill_us_per_token=1.0)


def test_replay_reports_the_sim_keys_from_measured_hits(ray_cluster):
    trace = trace_slice()
    result = replay_on_runtime(trace, settings(tiers=TierSizes(host=400)), progress=False)
    out = result.as_dict()
    assert set(out) == RESULT_KEYS | RUNTIME_KEYS | REPLAY_KEYS
    assert out["requests"] == len(trace)
    assert out["tokens"] == sum(r.input_length for r in trace)
    assert 0 < out["hit_tokens"] == sum(out["hit_tokens_by_tier"].values())
    assert out["hit_tokens"] % 512 == 0 and out["token_hit_rate"] == out["hit_tokens"] / out["tokens"]
    assert "remote" in out["hit_tokens_by_tier"]  # round-robin engines fetch each other's pages
    assert 0 < out["mean_ttft_ms"] <= out["p99_ttft_ms"]
    assert out["bytes_moved"] > 0 and out["policy"] == "lru" and out["scenario"] == "test"
    assert result.wrong_pages == 0


def test_more_host_tier_never_hits_less(ray_cluster):
    trace = trace_slice(n=30)
    small = replay_on_runtime(trace, settings(tiers=TierSizes(host=4)), progress=False).as_dict()
    large = replay_on_runtime(trace, settings(tiers=TierSizes(host=400)), progress=False).as_dict()
    assert small["hit_tokens"] < large["hit_tokens"]


def test_kvray_run_joins_a_running_cluster_and_prints_json(ray_cluster, tmp_path):
    """The real CLI in its own process, joining the session cluster with --address."""
    trace = tmp_path / "slice.jsonl"
    trace.write_text("".join(TRACE.read_text().splitlines(keepends=True)[1000:1015]))
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text(
        "name: cli\nprefill_us_per_token: 1.0\n"
        "runtime:\n  name: cli-run\n  layout: {layers: 2, kv_heads: 2, head_dim: 16, page_tokens: 512}\n"
    )
    proc = kvray_command(
        "run",
        "--trace",
        str(trace),
        "--policy",
        "lru",
        "--scenario",
        str(scenario),
        "--address",
        ray_cluster.address,
        "--host-pages",
        "300",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(out) == RESULT_KEYS | RUNTIME_KEYS | REPLAY_KEYS and out["requests"] == 15 and out["scenario"] == "cli"
    assert ray.get_actor  # the session connection is untouched by the CLI's own driver


def test_kvray_run_takes_a_free_name_beside_a_runtime_kept_up(ray_cluster, tmp_path):
    """A plain ``kvray run`` on a cluster where ``kvray up`` keeps its default runtime
    (``kvray``): the replay starts its own beside it under a free name, says which, and
    leaves the other one up."""
    kept = Runtime.start(RuntimeConfig(tiers=TierSizes(host=16)))  # named kvray, as `kvray up` names it
    try:
        trace = tmp_path / "slice.jsonl"
        trace.write_text("".join(TRACE.read_text().splitlines(keepends=True)[1000:1006]))
        proc = kvray_command(
            "run",
            "--trace",
            trace,
            "--address",
            ray_cluster.address,
            "--host-pages",
            "32",
            "--prefill-us-per-token",
            "1",
            "--json",
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert json.loads(proc.stdout.strip().splitlines()[-1])["requests"] == 6
        assert "this replay starts its own as 'kvray-2'" in " ".join(proc.stderr.split()), proc.stderr[-3000:]
        deadline = time.monotonic() + 30  # the replay's own runtime is gone (its names freed a moment after it exits)
        while name_taken("kvray-2"):
            assert time.monotonic() < deadline, "the replay left its runtime 'kvray-2' up"
            time.sleep(0.5)
        assert name_taken("kvray")
    finally:
        kept.close()


def _engines_not_dead() -> set[str]:
    """Replay engines starting or alive on the cluster, by actor id (Ray's GCS table: the state API needs a dashboard)."""
    actors = ray._private.state.actors()
    return {i for i, a in actors.items() if a["ActorClassName"] == "ReplayEngine" and a["State"] != "DEAD"}


def _await_no_engines_beyond(before: set[str]) -> None:
    """Wait until every engine not in ``before`` is dead; one still starting or alive after 30 s fails."""
    assert eventually(lambda: not _engines_not_dead() - before, timeout_s=30), (
        "an engine outlived the replay that failed to start it"
    )


def test_engines_that_do_not_start_are_named_and_none_is_left_behind(ray_cluster, monkeypatch):
    """Engines that miss their start bound, or die starting (their runtime's controller is
    gone), end the replay with a ClusterError saying so, and every engine it started is
    stopped: none starts behind the error, on a runtime that is still up."""
    before = _engines_not_dead()
    runtime = Runtime.start(settings(tiers=TierSizes(host=4)).runtime)
    try:
        with monkeypatch.context() as patch:
            patch.setattr(replay_module, "ENGINE_START_TIMEOUT_S", 0.0)  # no engine answers before it starts
            with pytest.raises(
                ClusterError, match=r"engines starting: the engine on node\(s\) .+ did not answer within 0 s"
            ) as late:
                Replay(runtime, ReplaySettings(name="late", nodes=3, runtime=runtime.config))
        # while the error (its traceback holds the engines' handles) is kept, as a caller's report keeps it
        _await_no_engines_beyond(before)
        del late
        for shard in runtime.shards.handles:
            ray.kill(shard, no_restart=True)
        # a killed controller's name goes with it
        assert eventually(lambda: not name_taken(runtime.config.name), timeout_s=30), "a killed controller's name stayed taken"
        with pytest.raises(ClusterError, match="engines starting: the engine on node .+ died starting: .*no kvray runtime named"):
            Replay(runtime, ReplaySettings(name="orphan", nodes=3, runtime=runtime.config))
    finally:
        runtime.close()
    _await_no_engines_beyond(before)
