"""Policies that write down what they are shown, for the feature-equality tests.

They run inside the runtime's actors (the controller builds the cluster policy, every
store its placement policy, by import path: ``tests.sim.recording:RecordingRing``), so
each process appends what its policy saw to a file of its own under :func:`records_dir`,
which the test reads back. In the test's own process (the simulator's side) ``sink`` is
None and the records stay in ``seen``.

The directory is the Ray cluster's own (named by its session), not one per checkout: two
test sessions in one checkout at once (two pytest runs, or pytest-xdist workers, each
starting its cluster) each cleared and read one shared directory, so one run deleted the
other's records mid-run and its views came out short (``test_two_nodes_...`` failed
whenever a second run of tests/sim/test_features_agree.py overlapped it).
"""

from __future__ import annotations

import os
import pickle
import shutil
from dataclasses import replace
from pathlib import Path

import ray

from kvray.core.placement import LRUPolicy, PageContext, RequestInfo
from kvray.policy.cluster import ClusterView, LocalFirstRing, NodeView, RequestView

RECORDS_ROOT = Path(__file__).resolve().parents[2] / ".pytest_cache" / "kvray-recorded-views"


def records_dir() -> Path:
    """Where the connected Ray cluster's recording policies write: one directory per
    cluster session, the same in the test's process and in the cluster's actors."""
    return RECORDS_ROOT / ray.get_runtime_context().get_session_name()


def clear_records() -> None:
    """Forget this cluster's records (before a run whose records the test reads)."""
    shutil.rmtree(records_dir(), ignore_errors=True)


def read_records(kind: str) -> list[list]:
    """What each process recorded of ``kind`` (one list per process, in call order)."""
    out = []
    for path in sorted(records_dir().glob(f"{kind}-*.pkl")):
        records = []
        with path.open("rb") as f:
            while True:
                try:
                    records.append(pickle.load(f))
                except EOFError:
                    break
        out.append(records)
    return out


class _Recorder:
    kind = ""
    sink: bool | None = True  # None: records stay in ``seen`` (the test's own process)

    def record(self, item) -> None:
        self.__dict__.setdefault("seen", []).append(item)
        if self.sink is not None:
            records = records_dir()
            records.mkdir(parents=True, exist_ok=True)
            with (records / f"{self.kind}-{os.getpid()}.pkl").open("ab") as f:
                pickle.dump(item, f)


class RecordingRing(_Recorder, LocalFirstRing):
    """Today's local-first + ring placement, writing down each (request, missing, cluster) it places."""

    name = "recording-local-first"
    kind = "place"

    def place(self, request: RequestView, missing: int, cluster: ClusterView) -> list[str]:
        self.record((request, missing, cluster))
        return super().place(request, missing, cluster)


class RecordingVerbs(_Recorder, LocalFirstRing):
    """Every cluster verb, decided from what both worlds show alike (the request's page
    count, its cached prefix's nodes, the nodes' order), writing down each (request,
    cluster) ``route`` is shown: requests of n pages are served by node n // 2 mod N, an even
    one loads half its cached prefix and recomputes the rest, every third prefetches,
    an odd one whose prefix lies partly elsewhere is copied to the node serving it, and the
    serving node's NVMe write budget is lifted at every fourth request, 1 GB/s otherwise."""

    name = "recording-verbs"
    kind = "route"
    budget_asks = 0

    def route(self, request: RequestView, cluster: ClusterView) -> str:
        self.record((request, cluster))
        return cluster.names[(len(request.keys) // 2) % len(cluster.nodes)]

    def load_pages(self, request: RequestView, cluster: ClusterView) -> int:
        hits = len(request.hit_nodes)
        return hits // 2 if len(request.keys) % 2 == 0 else hits

    def prefetch(self, request: RequestView, cluster: ClusterView) -> bool:
        return len(request.keys) % 3 == 0

    def replicate(self, request: RequestView, cluster: ClusterView) -> list[str]:
        elsewhere = any(node != request.requester for node in request.hit_nodes)
        return [request.requester] if elsewhere and len(request.keys) % 2 == 1 else []

    def disk_write_budget(self, node: NodeView, cluster: ClusterView) -> float | None:
        self.budget_asks += 1
        return None if self.budget_asks % 4 == 0 else 1e9


class RecordingVerbsElsewhere(RecordingVerbs):
    """:class:`RecordingVerbs`, but an odd request with a cached prefix is copied to every
    node that neither serves it nor holds a page of it (a third node, on three), the
    simulator's ``replicate`` to a node of the policy's choosing."""

    name = "recording-verbs-elsewhere"

    def replicate(self, request: RequestView, cluster: ClusterView) -> list[str]:
        if len(request.keys) % 2 == 0:
            return []
        return [n for n in cluster.names if n != request.requester and n not in request.hit_nodes]


class RecordingLRU(_Recorder, LRUPolicy):
    """LRU, writing down every request it is told of."""

    name = "recording-lru"
    kind = "on_request"

    def on_request(self, info: RequestInfo) -> None:
        self.record(replace(info, arrival_ms=0.0))  # the runtime's clock is the wall's, the simulator's the trace's


class RecordingPlaces(_Recorder, LRUPolicy):
    """LRU, writing down the arrival time of each request it is told of and each page it
    admits: its key, depth and request length, the chain position a per-page policy
    (``reuse``) reads as features."""

    name = "recording-places"
    kind = "placed"

    def on_request(self, info: RequestInfo) -> None:
        self.record(("request", info.arrival_ms))
        super().on_request(info)

    def on_admitted(self, handle: int, ctx: PageContext) -> None:
        self.record(("page", self.index.key_of(handle), ctx.depth, ctx.request_pages))
        super().on_admitted(handle, ctx)

    def stats(self) -> dict[str, int]:
        """What it was told, counted (a replay sums them over nodes as ``policy_stats``)."""
        seen = self.__dict__.get("seen", [])
        return {"requests_told": sum(r[0] == "request" for r in seen), "pages_admitted": sum(r[0] == "page" for r in seen)}
