"""Transfer paths: how one run of pages moves between a store and a client's landing buffer.

Each path is a handler with the same four verbs: ``start_load`` / ``finish_load`` bring a
run of pages into the buffer rows ``run.start..``, ``start_store`` / ``finish_store`` send
buffer rows to a store. Starting returns a pending transfer without waiting, so runs on
different nodes move concurrently; finishing waits for it and turns every failure (the
store raised, died, or did not answer in time) into a miss. The client picks a path for a
run with one rule (:meth:`KvrayClient.path_for`) and calls the handler registered under
that name; adding a transport (NIXL, say) is a handler and a line in that rule.

- ``local``: the node's own store actor copies between its tiers and the buffer (shared
  memory it maps); used for what the mapped host tier cannot serve (disk pages) and for
  same-node stores.
- ``tcp``: the peer's page server, no Ray call on the way (:mod:`kvray.cluster.transfer`).
- ``collective``: the peer store sends into this node's store, which writes the buffer
  (gloo on CPU, NCCL on GPU); loads only, stores go by the object store.
- ``object_store``: pages as Ray objects, returned or passed to the peer store's method.

Same-node host pages bypass all of these: the client copies them out of its mapped host
tier itself (path ``mapped`` in :class:`~kvray.cluster.client.Loaded`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import ray

from kvray.cluster.observe import NodeReport
from kvray.cluster.transfer import PendingLoad, PendingStore
from kvray.core.tiers import Tier

if TYPE_CHECKING:
    from kvray.cluster.client import KvrayClient, _Run

REMOTE = Tier.REMOTE.label
ACTOR_ERRORS = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError)
# A store's call that raised (disk full, an OSError of its disk tier) is a miss too.
STORE_ERRORS = (*ACTOR_ERRORS, ray.exceptions.RayTaskError)
# A call that ended (it raised, or its process died) can no longer touch the landing buffer;
# one given up on (timeout) or unanswered (the actor unavailable) may still.
ENDED = (ray.exceptions.RayTaskError, ray.exceptions.ActorDiedError)


class StoreCallPath(ABC):
    """A path served by a method of a store actor, answered through ``ray.get``.

    ``between_nodes``: its bytes cross the network (counted in ``bytes_between_nodes``).
    ``load_maps_buffer`` / ``store_maps_buffer``: a store actor writes or reads the client's
    landing buffer itself in a load / a store, so a call given up on may still do so later:
    the client then moves to a fresh buffer (see :mod:`kvray.cluster.client`).
    ``in_order``: two transfers to one store run in the order sent (not so for calls of a
    store actor, which runs several at once).
    """

    name = ""
    in_order = False
    between_nodes = True
    load_maps_buffer = False
    store_maps_buffer = False

    def __init__(self, client: KvrayClient) -> None:
        self.client = client

    @abstractmethod
    def start_load(self, store, keys: list[int], run: _Run) -> Any:
        """Ask for ``keys`` (run ``run`` of a request) without waiting; a pending transfer."""

    @abstractmethod
    def loaded(self, run: _Run, answer: Any) -> tuple[int, dict[str, int]]:
        """A finished load's answer as (pages now in the buffer, pages by tier)."""

    def start_store(self, store, keys: list[int], run: _Run, parent: int | None) -> Any:
        return store.put_pages.remote(keys, self.client.buffer.pages[run.start : run.stop], parent)

    def finish_load(self, run: _Run, pending: Any) -> tuple[int, dict[str, int]]:
        answer = self._answer(pending, self.load_maps_buffer)
        return (0, {}) if answer is None else self.loaded(run, answer)

    def finish_store(self, pending: Any) -> tuple[int, list[int], NodeReport] | None:
        """(pages stored, keys the store dropped meanwhile, its report), or None if it was not kept."""
        return self._answer(pending, self.store_maps_buffer)

    def _answer(self, ref, maps_buffer: bool) -> Any:
        try:
            return ray.get(ref, timeout=self.client.timeout_s)
        except STORE_ERRORS as exc:
            self.client.count_fault(exc)
            if maps_buffer and not isinstance(exc, ENDED):
                self.client.buffer_may_be_in_use()
            return None


class LocalPath(StoreCallPath):
    name = "local"
    between_nodes = False
    load_maps_buffer = store_maps_buffer = True

    def start_load(self, store, keys, run):
        buffer = self.client.buffer
        return store.read_into.remote(keys, buffer.name, buffer.capacity, run.start, self.client.take_arrival())

    def loaded(self, run, answer):
        return answer  # the store copied the pages and says how many, by tier

    def start_store(self, store, keys, run, parent):
        buffer = self.client.buffer
        return store.write_from.remote(keys, buffer.name, buffer.capacity, run.start, parent, self.client.take_arrival())


class ObjectStorePath(StoreCallPath):
    name = "object_store"

    def start_load(self, store, keys, run):
        return store.get_pages.remote(keys)

    def loaded(self, run, answer):
        self.client.buffer.pages[run.start : run.start + len(answer)] = answer
        return len(answer), {REMOTE: len(answer)}


class CollectivePath(StoreCallPath):
    """Loads by collective send/recv between the stores; stores by the object store."""

    name = "collective"
    load_maps_buffer = True  # this node's store writes the received pages into the buffer

    def start_load(self, store, keys, run):
        client = self.client
        return client.local_store.pull.remote(
            keys, store, client.ranks[run.node], client.buffer.name, client.buffer.capacity, run.start, client.take_arrival()
        )

    def loaded(self, run, answer):
        return answer, {REMOTE: answer}


class TcpPath(StoreCallPath):
    """The peer's page server: the client's own socket, no actor call and no ray.get."""

    name = "tcp"
    in_order = True  # one connection per peer, answered in order

    def loaded(self, run, answer):
        return answer  # finish_load receives straight into the buffer

    def start_load(self, store, keys, run) -> PendingLoad:
        return self.client.links.load(self.client.servers[run.node], keys)

    def finish_load(self, run, pending: PendingLoad):
        got = pending.receive(self.client.buffer.pages[run.start : run.stop])
        return got, {REMOTE: got}

    def start_store(self, store, keys, run, parent) -> PendingStore:
        client = self.client
        return client.links.store(client.servers[run.node], keys, client.buffer.pages[run.start : run.stop], parent)

    def finish_store(self, pending: PendingStore):
        return pending.receive()


PATHS: tuple[type[StoreCallPath], ...] = (LocalPath, TcpPath, CollectivePath, ObjectStorePath)
