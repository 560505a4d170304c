"""kvray on Ray: per-node store actors, a metadata-only controller, and a client API.

The only part of kvray that imports Ray. The pieces, from the bottom:

- :mod:`~kvray.cluster.node_store`: one actor per node owning that node's tiers
  (a :class:`kvray.core.store.PageStore`), placed with node affinity.
- :mod:`~kvray.cluster.controller`: the global prefix index, page locations, heat, pins
  and the placement of new pages (local node, or a consistent-hash ring when a request is
  larger than a node keeps). No page byte passes through it.
- :mod:`~kvray.cluster.shards`: the controller split into ``controller_shards`` actors,
  each owning the chains whose root page hashes to it; routing and merged snapshots.
- :mod:`~kvray.cluster.protocol`: the request protocol's types (plans, leases, what a
  load delivered, the handle of one request).
- :mod:`~kvray.cluster.client`: what engines and jobs call, one round trip per request:
  ``with client.request(keys) as r:`` (lookup + pin and load on entry, release and store
  on exit), or those verbs one by one (the loads in :mod:`~kvray.cluster.loading`, the
  stores and copies in :mod:`~kvray.cluster.storing`). Same-node bytes move through shared
  memory (:mod:`~kvray.cluster.shm`), cross-node bytes through Ray's object store or a
  collective (gloo on CPU, NCCL on GPU), chosen by size.
- :mod:`~kvray.cluster.runtime`: starting or joining Ray and placing the actors.
- :mod:`~kvray.apps.replay`: ``kvray run`` and ``kvray demo``, trace replay on all of it.

Example::

    from kvray.cluster import KvrayClient, RayConnection, Runtime, RuntimeConfig

    with RayConnection(nodes=2):
        runtime = Runtime.start(RuntimeConfig())
        client = KvrayClient.connect(runtime.config.name)
"""

from typing import TYPE_CHECKING

from kvray.cluster.config import RuntimeConfig
from kvray.cluster.protocol import Loaded, Plan, Request
from kvray.lazy import lazy_attributes

if TYPE_CHECKING:  # what type checkers and IDEs see
    from kvray.cluster.client import KvrayClient
    from kvray.cluster.runtime import RayConnection, Runtime

# The client and the runtime (which places the store actors) load torch: imported on first
# use, so a controller actor, which needs neither, starts seconds sooner (kvray.lazy)
__getattr__ = lazy_attributes(
    __name__,
    {
        "KvrayClient": "kvray.cluster.client",
        "RayConnection": "kvray.cluster.runtime",
        "Runtime": "kvray.cluster.runtime",
    },
)

__all__ = ["KvrayClient", "Loaded", "Plan", "RayConnection", "Request", "Runtime", "RuntimeConfig"]
