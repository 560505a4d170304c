"""The Ray cluster launcher config (``cluster.yaml``): validation and a local fake of it.

``cluster.yaml`` names kvray's node types (GPU, memory-heavy, disk-heavy), the custom
resources their store actors ask for, and the autoscaler's limits. :func:`validate_cluster`
checks it against Ray's own schema; :func:`fake_autoscaler_config` turns the same node
types into a config for Ray's fake multi-node provider, so the autoscaling behaviour can
be shown on one machine (nodes become local raylets instead of cloud instances).

Example::

    config = kvray.core.config.read_yaml("cluster.yaml")
    validate_cluster(config)
    fake = fake_autoscaler_config(config, gcs_address="10.0.0.1:6379", idle_timeout_minutes=0.1)
"""

from __future__ import annotations

import json
from pathlib import Path

from kvray.core.errors import ConfigError

TIER_RESOURCES = ("kvray_device_tier", "kvray_host_tier", "kvray_disk_tier")


def validate_cluster(config: dict, source: str = "cluster.yaml") -> None:
    """Check ``config`` against ``ray/autoscaler/ray-schema.json``; ConfigError names the field."""
    import jsonschema
    import ray

    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    try:
        jsonschema.validate(config, schema)
    except jsonschema.ValidationError as exc:
        where = ".".join(str(p) for p in exc.absolute_path) or "<root>"
        raise ConfigError(f"{source}: {where}: {exc.message}") from None


def fake_autoscaler_config(
    config: dict, gcs_address: str, idle_timeout_minutes: float, object_store_bytes: int = 100 << 20, head_cpus: int = 1
) -> dict:
    """A fake multi-node config with ``config``'s worker node types and autoscaler settings.

    Node configs (instance types) mean nothing locally and become empty; every node gets a
    small object store so that several fit on one machine.
    """
    workers = {
        name: {
            "resources": {**node["resources"], "object_store_memory": object_store_bytes},
            "node_config": {},
            "min_workers": node.get("min_workers", 0),
            "max_workers": node.get("max_workers", config["max_workers"]),
        }
        for name, node in config["available_node_types"].items()
        if name != config["head_node_type"]
    }
    return {
        "cluster_name": f"{config['cluster_name']}-fake",
        "max_workers": config["max_workers"],
        "upscaling_speed": config["upscaling_speed"],
        "idle_timeout_minutes": idle_timeout_minutes,
        "provider": {
            "type": "fake_multinode",
            "gcs_address": gcs_address,
            "disable_launch_config_check": True,
            "disable_node_updaters": True,  # the provider starts each raylet itself: no SSH setup
            "use_node_id_as_ip": True,  # local nodes share one IP; the autoscaler tells them apart by id
        },
        "auth": {},
        "docker": {},
        "head_node_type": "ray.head.default",
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": head_cpus}, "node_config": {}, "max_workers": 0},
            **workers,
        },
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }
