"""Shared fixtures: small page layouts and a deterministic 'model' whose KV for a token
depends on the whole prefix before it, so any KV returned for the wrong prefix shows."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import settings

from kvray.core.config import PageLayout
from kvray.core.pages import torch_dtype
from tests.properties import CI_EXAMPLES

# Hypothesis: CI draws the counts the tests name (``make test`` passes --hypothesis-profile=ci),
# the inner loop a fifth of them (tests/properties.py scales each count by this profile).
settings.register_profile("ci", max_examples=CI_EXAMPLES, deadline=None)
settings.register_profile("dev", max_examples=CI_EXAMPLES // 5, deadline=None)
settings.load_profile("dev")

TINY = PageLayout(layers=2, kv_heads=2, head_dim=4, page_tokens=4, dtype="float32")
# What `kvray sim --json` and `kvray run --json` print at least (the interface other tools rely on)
RESULT_KEYS = {
    "requests",
    "tokens",
    "hit_tokens",
    "token_hit_rate",
    "hit_tokens_by_tier",
    "mean_ttft_ms",
    "p99_ttft_ms",
    "bytes_moved",
    "policy",
    "policy_stats",
    "scenario",
}
RUNTIME_KEYS = {"wrong_pages", "prefill_us_per_token_measured"}  # only a replay on the runtime has these
REPLAY_KEYS = {"cluster_policy", "cluster_verbs"}  # what `kvray run` adds: its cluster policy and what each verb did


def prefix_kv(layout: PageLayout, tokens) -> torch.Tensor:
    """KV of ``tokens`` where every value depends on the token's whole prefix."""
    tokens = np.asarray(tokens, dtype=np.int64)
    state = np.cumsum((tokens + 1) * 1_000_003 % 65_521) % 2**20  # rolling prefix digest
    per_token = layout.layers * 2 * layout.kv_heads * layout.head_dim
    grid = (state[:, None] * 7 + np.arange(per_token)[None, :]) % 1_000
    kv = torch.from_numpy(grid.astype(np.float32) / 8.0)  # exact in float16 and bfloat16 too
    kv = kv.view(len(tokens), layout.layers, 2, layout.kv_heads, layout.head_dim).permute(1, 2, 0, 3, 4)
    return kv.contiguous().to(torch_dtype(layout))


SHM = Path("/dev/shm")


def mapped_shared_memory() -> set[str]:
    """Names of the /dev/shm segments some process on this machine still maps."""
    names = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:
            continue  # the process exited, or is not ours to read
        names.update(line.split("/dev/shm/", 1)[1].split(" ")[0] for line in text.splitlines() if "/dev/shm/" in line)
    return names


@pytest.fixture(scope="session", autouse=True)
def shared_memory_left_behind():
    """Unlink the kvray segments this session created that no process maps any more.

    Fault tests SIGKILL store actors and remove whole nodes; on a real cluster a removed
    node's /dev/shm goes with the machine, here it would stay. Segments still mapped (by
    another test session, say) are left alone.
    """
    before = set(os.listdir(SHM)) if SHM.is_dir() else set()
    yield
    if not SHM.is_dir():
        return
    created = {name for name in os.listdir(SHM) if name.startswith("kvray_")} - before
    for name in created - mapped_shared_memory():
        (SHM / name).unlink(missing_ok=True)


ROOT = Path(__file__).resolve().parents[1]


def kvray_command(*args: str, timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    """``kvray ARGS`` in a process of its own, from the checkout, as a user runs it."""
    command = [sys.executable, "-m", "kvray", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


@pytest.fixture
def tiny_layout() -> PageLayout:
    return TINY


# -- Ray: one real multi-node cluster per test session (tests marked ``ray``) -----------------
RAY_NODES = 3
RAY_OBJECT_STORE_BYTES = 150 << 20


@pytest.fixture(scope="session")
def ray_cluster():
    """Three local Ray nodes (separate raylets and object stores), shared by every test that asks for it.

    No dashboard (it costs ~1 GB) and no log monitor (no driver here reads workers' logs;
    it took ~6% of a core all session); metrics are reported every 5 s, so Prometheus
    exports can be checked without long waits (every second cost each node's agent ~5% of
    a core). Tests that need to lose a node add their own and remove it, so the three stay.
    """
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "object_store_memory": RAY_OBJECT_STORE_BYTES,
            "include_dashboard": False,
            "include_log_monitor": False,
            "_system_config": {"metrics_report_interval_ms": 5000},
        },
    )
    for _ in range(RAY_NODES - 1):
        cluster.add_node(num_cpus=1, object_store_memory=RAY_OBJECT_STORE_BYTES)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="kvray", log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@contextmanager
def extra_nodes(cluster, *resources: dict[str, float]) -> Iterator[None]:
    """One more one-CPU Ray node per entry of ``resources`` (its custom resources, which
    tests pin store actors to), removed again on exit so the session's three stay."""
    added = [cluster.add_node(num_cpus=1, object_store_memory=RAY_OBJECT_STORE_BYTES, resources=dict(r)) for r in resources]
    cluster.wait_for_nodes()
    try:
        yield
    finally:
        for node in added:
            cluster.remove_node(node)


# -- Tiers (tests/README.md) ---------------------------------------------------------------------
TRAINING_FIXTURES = {"tiny_policy"}  # fixtures that train a policy when first used


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups into node ids
def pytest_collection_modifyitems(config, items):
    """A test that uses the session's Ray cluster is in the ``ray`` tier, and one that uses a
    trained policy fixture in the ``train`` tier, whether or not its module says so, so the
    fast tier (``make check``: not ray, not slow, not train) never starts or trains one."""
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if TRAINING_FIXTURES & set(fixtures):
            item.add_marker(pytest.mark.train)
        if "ray_cluster" in fixtures:
            item.add_marker(pytest.mark.ray)
            # with pytest-xdist (`make test` runs two workers), every test on the session's cluster
            # runs on one worker, so the machine holds one test cluster; the rest, Ray tests with
            # a Ray of their own included, run wherever a worker is free (tests/README.md)
            item.add_marker(pytest.mark.xdist_group("ray"))
