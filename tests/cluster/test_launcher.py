"""cluster.yaml: Ray's schema accepts it, and Ray's fake multi-node autoscaler, given the
same node types, launches a tier node for a kvray store actor and retires it when idle."""

from __future__ import annotations

import copy
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import ray
from ray.autoscaler._private.fake_multi_node.node_provider import FAKE_HEAD_NODE_ID

from kvray.cluster.launcher import TIER_RESOURCES, fake_autoscaler_config, validate_cluster
from kvray.core.config import read_yaml
from kvray.core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_YAML = ROOT / "cluster.yaml"


def test_cluster_yaml_passes_rays_own_schema():
    validate_cluster(read_yaml(CLUSTER_YAML))


def test_every_tier_has_a_node_type_offering_its_resource():
    config = read_yaml(CLUSTER_YAML)
    offered = {r for node in config["available_node_types"].values() for r in node["resources"]}
    assert set(TIER_RESOURCES) <= offered
    assert config["idle_timeout_minutes"] > 0 and config["upscaling_speed"] > 0
    assert any("pip install" in c and "kvray" in c for c in config["setup_commands"])


def test_a_broken_config_is_named_by_field():
    config = copy.deepcopy(read_yaml(CLUSTER_YAML))
    config["available_node_types"]["kvray.memory"]["resources"]["kvray_host_tier"] = -1
    with pytest.raises(ConfigError, match="available_node_types.kvray.memory.resources.kvray_host_tier"):
        validate_cluster(config)


DRIVER = textwrap.dedent(
    """
    import json, sys, time, ray
    from kvray.cluster.config import RuntimeConfig
    from kvray.cluster.node_store import NodeStoreActor
    from kvray.core.config import TierSizes

    ray.init(address=sys.argv[1], log_to_driver=False)
    print(json.dumps({"session": ray._private.worker._global_node.get_session_dir_path()}), flush=True)
    config = RuntimeConfig(name="autoscale", tiers=TierSizes(host=4), store_resources={"kvray_host_tier": 1})
    before = len([n for n in ray.nodes() if n["Alive"]])
    store = NodeStoreActor.options(num_cpus=0, resources=dict(config.store_resources)).remote(config, None, "none")
    node = ray.get(store.ping.remote(), timeout=240)
    alive = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    print(json.dumps({"before": before, "alive": len(alive), "store_node_resources": alive[node]}), flush=True)
    ray.get(store.close.remote(), timeout=60)  # its shared host tier goes with it
    ray.kill(store)
    t0 = time.time()
    while time.time() - t0 < 240:
        if len([n for n in ray.nodes() if n["Alive"]]) == before:
            print(json.dumps({"retired_after_s": time.time() - t0}), flush=True)
            break
        time.sleep(1)
    """
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@pytest.mark.ray
@pytest.mark.slow
def test_fake_autoscaler_launches_a_tier_node_for_a_store_and_retires_it(tmp_path):
    """Runs its own Ray head (separate from the session cluster): the autoscaler needs a
    head started with ``--autoscaling-config``. Ray's ``AutoscalingCluster`` helper calls
    ``ray stop --force``, which would kill every Ray on the machine, so the head is started
    here directly and only its own processes are stopped afterwards."""
    ip = ray.util.get_node_ip_address()
    port = free_port()
    fake = fake_autoscaler_config(read_yaml(CLUSTER_YAML), f"{ip}:{port}", idle_timeout_minutes=0.25)
    config_path = tmp_path / "autoscaler.json"
    config_path.write_text(json.dumps(fake))
    ray_bin = Path(sys.executable).parent / "ray"
    # Token auth off, explicitly: this head listens on loopback only for this test, and with
    # RAY_AUTH_MODE unset `ray start` and `ray.init` disagree once ~/.ray/auth_token exists.
    env = {
        **os.environ,
        "RAY_FAKE_CLUSTER": "1",
        "AUTOSCALER_UPDATE_INTERVAL_S": "1",
        "PYTHONPATH": str(ROOT),
        "RAY_AUTH_MODE": "disabled",
    }
    head = subprocess.Popen(
        [
            str(ray_bin),
            "start",
            "--head",
            "--block",
            f"--port={port}",
            "--num-cpus=1",
            "--include-dashboard=false",
            "--object-store-memory=100000000",
            f"--autoscaling-config={config_path}",
        ],
        env={**env, "RAY_OVERRIDE_NODE_ID_FOR_TESTING": FAKE_HEAD_NODE_ID},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    lines: list[dict] = []
    try:
        driver = subprocess.run(
            [sys.executable, "-c", DRIVER, f"{ip}:{port}"], env=env, capture_output=True, text=True, timeout=420, cwd=ROOT
        )
        lines = [json.loads(line) for line in driver.stdout.splitlines() if line.startswith("{")]
        assert driver.returncode == 0, driver.stderr[-3000:]
    finally:
        stop_own_ray(head, lines[0]["session"] if lines else None)
    _, launched, retired = lines
    assert launched["alive"] == launched["before"] + 1  # the autoscaler added a node for the store
    assert launched["store_node_resources"]["kvray_host_tier"] == 1
    assert "GPU" not in launched["store_node_resources"]  # a memory node, not a GPU node, for a host tier
    assert retired["retired_after_s"] < 240  # idle, so it was terminated


def stop_own_ray(head: subprocess.Popen, session_dir: str | None) -> None:
    """Stop the head this test started and the fake nodes its autoscaler started (found by
    their session directory), by process id."""
    os.killpg(head.pid, signal.SIGTERM)
    try:
        head.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(head.pid, signal.SIGKILL)
    if session_dir is None:
        return
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if session_dir.encode() in cmdline.read_bytes():
                os.kill(int(cmdline.parent.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            continue  # already gone
