"""The load verbs of :class:`~kvray.cluster.client.KvrayClient`: a plan's cached pages into
the client's landing buffer, run by run, each run by the path one rule picks.

Split out of the client module as :mod:`kvray.cluster.storing` was: :class:`ChainLoads` is a
mixin the client inherits, so ``client.load(...)`` is unchanged. This node's host pages are
copied out of the mapped host tier (path ``mapped``), the rest of a same-node run comes
through the node's store actor (``local``), a peer's by its page server, NIXL, the
collective path or the object store (:mod:`kvray.cluster.paths`); runs on different nodes
move concurrently, and a run that fails or comes late ends the prefix there (a miss, never
wrong KV). :meth:`ChainLoads.path_for` is the one rule that picks a path, for stores too.

Example::

    plan = client.lookup(keys)
    loaded = client.load(keys, plan)       # KvrayClient is a ChainLoads
    client.buffer.pages[: loaded.pages]    # the cached prefix, exact
    client.release(plan, loaded)
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import ray

from kvray.cluster.config import RuntimeConfig
from kvray.cluster.paths import PathContext, PathSpeeds, StoreCallPath, nixl_wanted
from kvray.cluster.protocol import Loaded, Plan, Run, runs_of
from kvray.cluster.shm import LandingBuffer
from kvray.cluster.transfer import PeerLinks
from kvray.core.errors import RequestError
from kvray.core.tiers import Tier
from kvray.core.tiers.directory import SharedHostTier

HOST = Tier.HOST.label


class ChainLoads:
    """:meth:`load`, :meth:`load_chunks` and :meth:`path_for` for
    :class:`~kvray.cluster.client.KvrayClient` (which defines the attributes and helpers
    named below); see the module docstring."""

    config: RuntimeConfig
    context: PathContext
    stores: dict[str, ray.actor.ActorHandle]
    paths: dict[str, StoreCallPath]
    node_id: str
    page_nbytes: int
    mapped_reads: bool
    buffer: LandingBuffer
    links: PeerLinks | None
    servers: dict[str, tuple[str, int]]
    speeds: PathSpeeds

    def load(self, keys: Sequence[int], plan: Plan) -> Loaded:
        """Bring the plan's cached pages into buffer rows ``0..``; stops at the first page missing.

        If a store call was given up on, ``buffer`` is a fresh one afterwards, holding the
        rows loaded (see the module docstring).
        """
        self._check(keys)
        with self._transfers() as sent:
            loaded = self._load(keys, plan, sent)
        self._renew_if_stale(keep=loaded.pages)
        loaded.buffer = self.buffer.name
        return loaded

    def load_chunks(self, keys: Sequence[int], plan: Plan, chunk_pages: int | None = None) -> Iterator[tuple[int, Loaded]]:
        """The plan's cached pages ``chunk_pages`` at a time (default: the buffer's rows), for
        a prefix larger than the landing buffer: yields ``(first page, Loaded)`` with the
        chunk in buffer rows ``0..loaded.pages``, valid until the next chunk is asked for.
        The whole prefix stays pinned under the plan's lease; the stream ends at the first
        chunk that comes back short (a page lost meanwhile). ``release`` the plan with the
        chunks' ``Loaded`` merged (:meth:`Loaded.merge`) or any one of them.
        """
        step = chunk_pages or self.buffer.capacity
        if not 0 < step <= self.buffer.capacity:
            raise RequestError(f"chunk_pages={chunk_pages} must lie in [1, {self.buffer.capacity}] (the landing buffer's rows)")
        for start in range(0, plan.hit_pages, step):
            chunk = Plan(plan.lease, plan.hit_nodes[start : start + step], [])
            loaded = self.load(keys[start : start + chunk.hit_pages], chunk)
            if loaded.pages:
                yield start, loaded
            if loaded.pages < chunk.hit_pages:
                return

    def _load(self, keys: Sequence[int], plan: Plan, sent: list[tuple[StoreCallPath, object]]) -> Loaded:
        """The runs' pages into the buffer; each run's transfer is added to ``sent`` as it starts
        (the rest of a run read through this node's store after a mapped copy is not: no peer
        link carries it, and the fresh buffer an error brings covers it)."""
        runs = runs_of(plan.hit_nodes, 0)
        host = self._mapped_host() if self.mapped_reads else None
        # Transfers from the store actors first, so they move while this thread copies mapped pages.
        started = {}
        for run in runs:
            if not (host and run.node == self.node_id):
                started[run] = self._start_run(keys, run)
                sent.append(started[run][:2])
        loaded = Loaded(0)
        for run in runs:
            if run in started:
                path, pending, t0 = started[run]
                parts = [(path.name, *self._finish_run(run, path, pending, t0))]
            else:
                parts, seconds = self._read_mapped(host, keys, run)
                loaded.mapped_s += seconds
            got = 0
            for name, n, by_tier in parts:
                if loaded.pages == run.start + got:  # the prefix is unbroken so far
                    between = n * self.page_nbytes if name != "mapped" and self.paths[name].between_nodes else 0
                    loaded.add(name, n, by_tier, between)
                    if name == "mapped":
                        loaded.mapped.extend(keys[run.start + got : run.start + got + n])
                got += n
            if got < run.stop - run.start:
                loaded.lost.setdefault(run.node, []).extend(keys[run.start + got : run.stop])
        return loaded

    def _read_mapped(
        self, host: SharedHostTier, keys: Sequence[int], run: Run
    ) -> tuple[list[tuple[str, int, dict[str, int]]], float]:
        """Copy a same-node run out of the mapped host tier; the rest of it (pages on the
        local disk tier, or freed meanwhile) through the store actor. Also returns how long
        the mapped copy took (the store times its own)."""
        sub = list(keys[run.start : run.stop])
        t0 = time.perf_counter()
        got = host.read(sub, self.buffer.pages[run.start : run.stop], verify=self.config.checksum_memory)
        seconds = time.perf_counter() - t0
        parts = [("mapped", got, {HOST: got} if got else {})]
        if got < len(sub):
            rest = Run(run.node, run.start + got, run.stop)
            path, pending, t0 = self._start_run(keys, rest)
            parts.append((path.name, *self._finish_run(rest, path, pending, t0)))
        return parts, seconds

    def path_for(self, node: str, nbytes: int, config: RuntimeConfig | None = None) -> str:
        """The one rule that picks a transfer path (:mod:`kvray.cluster.paths`) for
        ``nbytes`` of pages held by ``node`` under ``config`` (default: this client's):
        the node's own store for its pages; for a peer, of the direct paths on (its page
        server by TCP, NIXL where :func:`~kvray.cluster.paths.nixl_wanted`) the one that has moved pages fastest from it
        (:class:`~kvray.cluster.paths.PathSpeeds`); else the collective path for large
        runs and the object store for small ones."""
        config = config or self.config
        if node == self.node_id:
            return "local"
        direct = self.direct_paths(node, config)
        if direct:
            return self.speeds.pick(node, direct, nbytes)
        ranks = self.context.ranks
        collective_ok = config.collective and node in ranks and self.node_id in ranks
        return "collective" if collective_ok and nbytes >= config.collective_min_bytes else "object_store"

    def direct_paths(self, node: str, config: RuntimeConfig | None = None) -> list[str]:
        """The direct paths (no store actor in between on this side) on for ``node``, in order of preference."""
        config = config or self.config
        direct = ["tcp"] if config.tcp and self.links is not None and node in self.servers else []
        return direct + (["nixl"] if nixl_wanted(config.nixl) else [])

    def _start_run(self, keys: Sequence[int], run: Run) -> tuple[StoreCallPath, object, float]:
        """Launch one run's load on its path; returns (path, pending transfer or None, start time)."""
        path = self.paths[self.path_for(run.node, (run.stop - run.start) * self.page_nbytes)]
        store = self.stores.get(run.node)
        t0 = time.perf_counter()
        return path, None if store is None else path.start_load(store, list(keys[run.start : run.stop]), run), t0

    def _finish_run(self, run: Run, path: StoreCallPath, pending, t0: float) -> tuple[int, dict[str, int]]:
        """A run's pages in the buffer (count, by tier); 0 on any failure (the peer died
        mid-transfer, its store raised or is gone, or it took too long): misses. How fast
        it came is what :class:`~kvray.cluster.paths.PathSpeeds` chooses by."""
        if pending is None:
            return 0, {}
        got, by_tier = path.finish_load(run, pending)
        if path.between_nodes:
            self.speeds.record(run.node, path.name, got * self.page_nbytes, time.perf_counter() - t0)
        return got, by_tier
