"""Starting kvray on Ray: the connection, the controller and one store actor per node.

:class:`RayConnection` decides which Ray to use: an existing cluster (``address`` or
``RAY_ADDRESS``), ``nodes`` local nodes through ``ray.cluster_utils.Cluster`` (separate
raylets and object stores on one machine), or an embedded single-node Ray.
:class:`Runtime` then places the controller (``controller_shards`` actors, see
:mod:`kvray.cluster.shards`) and a :class:`~kvray.cluster.node_store.NodeStore` on every
live node (node affinity, so a store never wanders off the node whose tiers it owns) and,
with ``collective`` on, joins the stores in one collective group for the collective
transfer path.

All kvray actors live in the Ray namespace ``kvray`` under names derived from
``RuntimeConfig.name``, so a job, an engine or ``kvray status`` finds them by name. A
runtime started ``detached`` (``kvray up``) outlives the process that started it;
:meth:`Runtime.attach` finds it again by name (``kvray run --name``, ``kvray down``).

Example::

    with RayConnection(nodes=3) as ray_conn:
        runtime = Runtime.start(RuntimeConfig(tiers=TierSizes(host=64)))
        client = KvrayClient.connect(runtime.config.name)
        ...
        runtime.close()
"""

from __future__ import annotations

import itertools
import os
import secrets
import socket
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvray.cluster.config import NAME_CHARS, NAMESPACE, RuntimeConfig, controller_name, store_name
from kvray.cluster.controller import ControllerActor
from kvray.cluster.node_store import NodeStoreActor
from kvray.cluster.shards import ControllerShards
from kvray.cluster.wire import TOKEN_BYTES
from kvray.core.errors import ClusterError

CONNECT_TIMEOUT_S = 5.0  # Ray itself retries an address nobody answers at for about a minute
CALL_TIMEOUT_S = 60.0  # a controller that does not answer a metadata call within this is stuck


def on_node(node_id: str) -> NodeAffinitySchedulingStrategy:
    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)


def check_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Fail within ``timeout_s`` when nothing listens at a ``HOST:PORT`` Ray address, so a
    mistyped address is one clear error instead of a minute of Ray's own retries.

    ``auto`` (Ray finds a cluster on this machine itself) and client URLs (``ray://``)
    are left to Ray.
    """
    if address == "auto" or "://" in address:
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ClusterError(f"{address!r} is not a Ray address: expected HOST:PORT, auto or ray://HOST:PORT")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ClusterError(
            f"no Ray cluster answers at {address} ({exc.strerror or exc}); "
            "start one with `ray start --head`, or check --address / RAY_ADDRESS"
        ) from None


class RayConnection:
    """Connect to (or start) Ray; a context manager that shuts down what it started.

    ``address`` (or ``RAY_ADDRESS``, which wins over ``auto``) names an existing cluster;
    an address nobody answers at is a :class:`ClusterError` within ``CONNECT_TIMEOUT_S``.
    Without one, ``nodes`` > 1 starts that many local nodes (the head plus workers), each with
    ``cpus_per_node`` CPUs and an object store of ``object_store_mb``.
    """

    def __init__(self, address: str | None = None, nodes: int = 1, cpus_per_node: int = 1, object_store_mb: int = 200) -> None:
        from_env = os.environ.get("RAY_ADDRESS")
        self.address = from_env if from_env and address in (None, "auto") else address
        self.nodes = nodes
        self.cpus_per_node = cpus_per_node
        self.object_store_bytes = object_store_mb << 20
        self.cluster = None

    def __enter__(self) -> RayConnection:
        """Connect; Ray's own start-up failing (its GCS not up in time on a loaded machine,
        say) is a ClusterError with one line, and what was started is shut down again."""
        try:
            self._connect()
        except (RuntimeError, TimeoutError, ConnectionError) as exc:
            self.__exit__()
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ClusterError(f"Ray did not start: {first}") from None
        return self

    def _connect(self) -> None:
        if self.address:
            check_reachable(self.address)
            try:
                ray.init(address=self.address, namespace=NAMESPACE, log_to_driver=False)
            except ConnectionError as exc:  # none found, or it refused this driver (auth)
                raise ClusterError(
                    f"cannot connect to Ray at {self.address}: {exc} (`ray start --head` starts a cluster; "
                    "one with token authentication, Ray's default, needs RAY_AUTH_MODE=token and its token here too)"
                ) from None
        elif self.nodes > 1:
            from ray.cluster_utils import Cluster

            self.cluster = Cluster()  # kept before any node starts, so a failed start shuts down what did
            self.cluster.add_node(**self._node_args(), include_dashboard=False)  # the first node is the head
            for _ in range(self.nodes - 1):
                self.cluster.add_node(**self._node_args())
            self.cluster.wait_for_nodes()
            ray.init(address=self.cluster.address, namespace=NAMESPACE, log_to_driver=False)
        else:
            # address="local": a fresh instance even when another Ray runs on this machine
            ray.init(address="local", namespace=NAMESPACE, include_dashboard=False, log_to_driver=False, **self._node_args())

    def _node_args(self) -> dict:
        return {"num_cpus": self.cpus_per_node, "object_store_memory": self.object_store_bytes}

    def __exit__(self, *exc) -> None:
        ray.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None


def name_taken(name: str) -> bool:
    """Whether a kvray runtime named ``name`` runs on the connected cluster (its controller does)."""
    try:
        ray.get_actor(controller_name(name), namespace=NAMESPACE)
    except ValueError:
        return False
    return True


def free_name(name: str) -> str:
    """``name`` if no runtime on the connected cluster has it, else the first of ``name-2``,
    ``name-3``, ... that none has (shortened to fit the 40 characters a name may have)."""
    suffixes = (f"-{n}" for n in itertools.count(2))
    candidate = name
    while name_taken(candidate):
        suffix = next(suffixes)
        candidate = name[: NAME_CHARS - len(suffix)] + suffix
    return candidate


def alive_nodes(resources: dict[str, float] | None = None) -> list[str]:
    """Ids of live nodes that offer ``resources``."""
    needed = resources or {}
    return [n["NodeID"] for n in ray.nodes() if n["Alive"] and all(n["Resources"].get(r, 0) >= q for r, q in needed.items())]


class Runtime:
    """The controller and store actors of one kvray instance (see the module docstring).

    ``shards``: every controller shard (their merged ``snapshot``, routing);
    ``controller``: shard 0, the whole controller when there is one shard (the default).
    """

    def __init__(self, config: RuntimeConfig, shards: ControllerShards, stores: dict) -> None:
        self.config = config
        self.shards = shards
        self.controller = shards.handles[0]
        self.stores = stores

    @classmethod
    def start(cls, config: RuntimeConfig, detached: bool = False) -> Runtime:
        """Place the controller shards and the stores; ``detached`` ones outlive this driver
        (Ray's ``lifetime="detached"``) until :meth:`close`, otherwise they end with it.
        The controller shards all run beside the driver (on a cluster: the head node, whose
        loss ends the cluster anyway, never a worker node that may leave); every store is
        registered at every shard. All of it within ``config.start_timeout_s``, or a
        ClusterError names the stores that did not come up and every actor started is
        stopped again."""
        nodes = alive_nodes(config.store_resources)
        if not nodes:
            raise ClusterError(f"no live Ray node offers {config.store_resources or 'any resources'} for a store")
        if name_taken(config.name):
            raise ClusterError(
                f"a kvray runtime named {config.name!r} is already running on this Ray cluster "
                f"(stop it with `kvray down --name {config.name}`, or pick another --name)"
            )
        deadline = time.monotonic() + config.start_timeout_s
        here = ray.get_runtime_context().get_node_id()
        token = secrets.token_bytes(TOKEN_BYTES)
        home = here if here in alive_nodes() else nodes[0]
        shards = ControllerShards(
            [
                ControllerActor.options(
                    name=controller_name(config.name, shard),
                    namespace=NAMESPACE,
                    num_cpus=0,
                    scheduling_strategy=on_node(home),
                    lifetime="detached" if detached else None,
                ).remote(config, token, shard)
                for shard in range(config.controller_shards)
            ],
            route_depth=config.controller_route_depth,
        )
        stores: dict = {}
        try:
            stores = {node: spawn_store(config, node, token, detached) for node in nodes}
            servers = _started(config, deadline, "start", {node: s.server_address.remote() for node, s in stores.items()})
            ranks: dict[str, int | None] = dict.fromkeys(stores)
            if config.collective and len(stores) > 1:
                joins = {node: s.init_collective.remote(len(stores), r) for r, (node, s) in enumerate(stores.items())}
                ranks = _started(config, deadline, "join the collective group", joins)
            registered = [
                {
                    node: shard.register_store.remote(node, store, ranks[node], None, servers[node])
                    for node, store in stores.items()
                }
                for shard in shards.handles
            ]
            for shard, refs in enumerate(registered):
                _started(config, deadline, f"register with controller shard {shard}", refs)
        except BaseException:  # nothing of a runtime that did not start stays behind (nor holds its name)
            for store in stores.values():
                ray.kill(store, no_restart=True)
            shards.kill()
            raise
        return cls(config, shards, stores)

    @classmethod
    def attach(cls, name: str) -> Runtime:
        """The runtime ``name`` already running on the connected cluster (``kvray up``)."""
        shards = ControllerShards.find(name, CALL_TIMEOUT_S)
        config = ray.get(shards.handles[0].runtime_config.remote(), timeout=CALL_TIMEOUT_S)
        stores = ray.get(shards.handles[0].members.remote(), timeout=CALL_TIMEOUT_S)["stores"]
        return cls(config, shards, stores)

    def node_lost(self, node_id: str) -> int:
        """Tell every controller shard a node left; returns how many page locations they dropped."""
        self.stores.pop(node_id, None)
        return sum(ray.get(self.shards.broadcast("remove_node", node_id), timeout=120))

    def store_stats(self) -> dict[str, dict]:
        refs = {node: store.stats.remote() for node, store in self.stores.items()}
        stats = {}
        for node, ref in refs.items():
            try:
                stats[node] = ray.get(ref, timeout=30)
            except (ray.exceptions.RayError, TimeoutError):
                continue  # a store on a node that left has no stats to give
        return stats

    def close(self) -> None:
        """Release the stores' memory (shared segments, disk files stay) and stop the actors."""
        for store in self.stores.values():
            try:
                ray.get(store.close.remote(), timeout=30)
            except (ray.exceptions.RayError, TimeoutError):
                pass  # already gone with its node
            ray.kill(store, no_restart=True)
        self.shards.kill()
        self.stores = {}


def _started(config: RuntimeConfig, deadline: float, step: str, refs: dict[str, ray.ObjectRef]) -> dict:
    """The answers of one step of :meth:`Runtime.start`, by node, once all are in: a
    ClusterError at ``deadline`` names the stores that did not ``step`` by then (a store
    that cannot be placed waits for ever, its node's ``store_resources`` taken, say), and
    one names the store whose step failed."""
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=max(deadline - time.monotonic(), 0.0))
    ready = set(ready)
    late = [node for node, ref in refs.items() if ref not in ready]
    if late:
        stores = ", ".join(f"{store_name(config.name, node)} (node {node})" for node in late)
        raise ClusterError(
            f"kvray runtime {config.name!r} did not start: store {stores} did not {step} within "
            f"start_timeout_s={config.start_timeout_s:g} s (RuntimeConfig.start_timeout_s); a store Ray cannot place "
            f"waits for ever: is its node alive, with store_resources {dict(config.store_resources)} free?"
        )
    answers = {}
    for node, ref in refs.items():
        try:
            answers[node] = ray.get(ref)
        except ray.exceptions.RayError as exc:
            raise ClusterError(
                f"kvray runtime {config.name!r} did not start: store {store_name(config.name, node)} (node {node}) "
                f"failed to {step}: {type(exc).__name__}"
            ) from exc
    return answers


def spawn_store(config: RuntimeConfig, node_id: str, token: bytes, detached: bool = False):
    """A store actor pinned to ``node_id``, asking for the runtime's store resources
    (``token``: the runtime's transfer secret, see :mod:`kvray.cluster.transfer`;
    ``detached``: it outlives the driver, see :meth:`Runtime.start`)."""
    return NodeStoreActor.options(
        name=store_name(config.name, node_id),
        namespace=NAMESPACE,
        num_cpus=0,
        resources=dict(config.store_resources),
        scheduling_strategy=on_node(node_id),
        lifetime="detached" if detached else None,
    ).remote(config, node_id, controller_name(config.name), token)
