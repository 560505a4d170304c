"""``kvray up`` and ``kvray down``: a kvray runtime that outlives the command starting it.

``kvray run`` and ``kvray demo`` start a runtime for one replay and stop it when the
replay ends, so there is nothing left for ``kvray status`` to read. ``kvray up`` starts
one detached on an existing Ray cluster (``ray start --head`` is the user's part): its
controller and store actors stay, by name, in Ray's ``kvray`` namespace until
``kvray down`` stops them. In between, ``kvray status`` reads it and
``kvray run --name`` replays on it.

Example::

    nodes = up("auto", RuntimeConfig(name="shared", tiers=TierSizes(host=512)))  # detached stores
    down("auto", "shared")               # their memory released, the actors stopped
"""

from __future__ import annotations

from kvray.cluster.config import RuntimeConfig
from kvray.cluster.runtime import RayConnection, Runtime


def up(address: str | None, config: RuntimeConfig) -> list[str]:
    """Start ``config``'s runtime detached on the cluster at ``address``; returns the ids
    of the nodes that got a store."""
    with RayConnection(address=address or "auto"):
        return list(Runtime.start(config, detached=True).stores)


def down(address: str | None, name: str) -> int:
    """Stop the runtime ``name`` (stores first: they release their shared memory);
    returns how many stores it had."""
    with RayConnection(address=address or "auto"):
        runtime = Runtime.attach(name)
        stores = len(runtime.stores)
        runtime.close()
        return stores


def describe_up(config: RuntimeConfig, nodes: list[str]) -> str:
    """What ``kvray up`` says once the runtime is up, and how to read and stop it."""
    name = config.name
    return (
        f"kvray runtime {name!r} is up: {config.policy} over {config.tiers.host} host pages per node on "
        f"{len(nodes)} node{'' if len(nodes) == 1 else 's'}, {config.controller_shards} controller shard"
        f"{'' if config.controller_shards == 1 else 's'}; `kvray status --name {name}` reads it, "
        f"`kvray down --name {name}` stops it"
    )
