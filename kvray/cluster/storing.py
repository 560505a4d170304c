"""The store verbs of :class:`~kvray.cluster.client.KvrayClient`: a request's new pages to
the stores the plan chose, then one commit to the controller shard its chain's lookups ask.

Split out of the client module (which keeps lookup, load and release) as
:mod:`kvray.cluster.answers` was: :class:`ChainStores` is a mixin the client inherits, so
``client.store(...)`` is unchanged; it reads the client's routes, paths and landing buffer
(:class:`~kvray.cluster.paths.PathContext`) and sends its reports through the client's
``_sent`` (kept for ``settle``).

A write is one chain per maximal run of pages bound for one node, in request order per
node (the node's placement policy sees the chain in order); the commit names the longest
unbroken prefix that landed (``Stored.landed``), so the index never names a page no store
holds.

Example::

    with client.request(keys) as r:     # KvrayClient is a ChainStores
        ...
        r.store()                       # on exit: ChainStores.store(keys, r.hit, plan, release=...)
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import ray

from kvray.cluster.paths import PathContext, StoreCallPath
from kvray.cluster.protocol import Loaded, Plan, Release, Run, Stored, runs_of
from kvray.cluster.shards import ControllerShards
from kvray.core.errors import RequestError


class ChainStores:
    """:meth:`store` and :meth:`replicate` for :class:`~kvray.cluster.client.KvrayClient` (which defines the
    attributes and helpers named below); see the module docstring."""

    shards: ControllerShards
    context: PathContext
    stores: dict[str, ray.actor.ActorHandle]
    paths: dict[str, StoreCallPath]
    node_id: str
    page_nbytes: int
    timeout_s: float
    _touched: ray.ObjectRef | None

    def store(
        self,
        keys: Sequence[int],
        start: int,
        plan: Plan,
        parent_key: int | None = None,
        route_key: int | None = None,
        release: Release | None = None,
    ) -> int:
        """Keep buffer rows ``start..len(keys)`` where the plan says; returns pages stored.

        ``parent_key``: the key of the page before ``keys[0]`` when ``keys`` continue a
        chain stored earlier (a prefix larger than the buffer, stored a buffer at a time).
        ``route_key``: the key the whole chain is routed by (:meth:`ControllerShards.route_key
        <kvray.cluster.shards.ControllerShards.route_key>` of it, root first), needed when
        ``keys`` do not start at the chain's root (a continuation, or an engine's keys after
        the part it loaded): the commit goes to the shard the chain's lookups ask, not to
        the one ``keys`` alone would route to. None: ``keys`` are the chain from its root.
        ``release``: the request's report for the shard holding ``plan``'s lease, not sent
        yet (:meth:`request` leaves it to this store): it goes with the commit when that is
        the same shard, otherwise (or when nothing is committed) on its own.

        Each maximal run of pages bound for one node goes as one chain (same-node by shared
        memory, others by direct TCP to their page server, or the object store with ``tcp``
        off); the controller then learns the longest chain that landed, continuing the
        cached prefix: up to the first page a store did not keep (it ran out of room, say),
        so the index never names a page no store holds. The stores' reports of pages they
        evicted meanwhile (from any chain) go with it, and to every other controller shard:
        which shard indexes an evicted page is not known here. With shards routed past the
        root (``controller_route_depth`` d >= 1), a chain stored from its root (no
        ``parent_key``) whose new pages reach into its first d pages is also committed, up
        to each such prefix, to the shard a lookup of just that prefix asks (it routes by
        its last page): :meth:`_commit_short_prefixes`. If a same-node write was given up
        on, ``buffer`` is a fresh one afterwards (see the module docstring).
        """
        self._check(keys)
        if parent_key is not None and route_key is None:
            raise RequestError(
                "store(parent_key=...) continues a chain stored earlier: pass route_key "
                "(client.shards.route_key of the whole chain), or its pages commit where its lookups never ask"
            )
        owner = self.shards.of(keys) if route_key is None else self.shards.owner(route_key)
        if release is not None and owner != plan.shard:
            self._send_release(plan.shard, release)
            release = None
        try:
            with self._transfers() as sent:
                stored = self._store(keys, start, plan, parent_key, owner, release, sent)
        except BaseException:
            if release is not None:
                self._send_release(owner, release)
            raise
        finally:
            self.context.hits = None  # hits no write here carried (it failed, or none went) are let go
        self._renew_if_stale(keep=0)
        return stored

    def _store(
        self,
        keys: Sequence[int],
        start: int,
        plan: Plan,
        parent_key: int | None,
        owner: int,
        release: Release | None,
        sent: list[tuple[StoreCallPath, object]],
    ) -> int:
        """Send the runs (each transfer added to ``sent``), then commit what the stores kept."""
        # Pages the plan promised but ``load`` did not deliver (lost meanwhile) go to this node.
        targets = [self.node_id] * max(plan.hit_pages - start, 0) + plan.targets[max(start - plan.hit_pages, 0) :]
        runs = runs_of(targets, start)
        if not runs:  # nothing to store (all cached, or the controller placed nothing): no commit
            if release is not None:
                self._send_release(owner, release)
            return 0
        if self._touched is not None and any(run.node == self.node_id for run in runs):
            ray.wait([self._touched], timeout=self.timeout_s)  # the policy sees the hits before the new pages
            self._touched = None
        # Runs to one node land in request order (the store's policy sees the chain in order):
        # a path that may run two calls at once waits for the node's previous run first.
        pending = sent  # (path, transfer) per run, in order
        results: dict[int, Stored | None] = {}
        unordered: dict[str, int] = {}  # node -> its latest run on such a path
        for j, run in enumerate(runs):
            store = self.stores.get(run.node)
            path = self.paths[self.path_for(run.node, (run.stop - run.start) * self.page_nbytes)]
            if not path.in_order and run.node in unordered:
                k = unordered[run.node]
                results[k] = _finished(*pending[k])
            sub = list(keys[run.start : run.stop])
            parent = keys[run.start - 1] if run.start else parent_key
            pending.append((path, None if store is None else path.start_store(store, sub, run, parent, len(keys))))
            if not path.in_order:
                unordered[run.node] = j
        stored, landed, dropped, reports = 0, start, defaultdict(list), {}
        for j, run in enumerate(runs):
            result = results[j] if j in results else _finished(*pending[j])
            if result is not None:
                stored += result.stored
                dropped[run.node].extend(result.dropped)
                reports[run.node] = result.report
                if landed == run.start:  # the chain is unbroken up to this run: it goes on as far as the store kept
                    landed = run.start + result.landed
        parent = keys[start - 1] if start else parent_key
        evicted = {node: gone for node, gone in dropped.items() if gone}
        args = (parent, list(keys[start:landed]), targets[: landed - start], start, evicted, reports, release)
        self._sent(self.shards.handles[owner].commit.remote(*args))
        if parent_key is None and start <= plan.hit_pages:
            self._commit_short_prefixes(keys[:landed], start, [*plan.hit_nodes[:start], *targets[: landed - start]], owner)
        if evicted:  # pages evicted from any chain: every other shard forgets those it indexes
            for shard, controller in enumerate(self.shards.handles):
                if shard != owner:
                    self._sent(controller.commit.remote(None, [], [], 0, evicted, reports))
        return stored

    def _commit_short_prefixes(self, chain: Sequence[int], start: int, nodes: Sequence[str], owner: int) -> None:
        """Commit each prefix of ``chain`` (from its root, on ``nodes``) that has pages new
        from ``start`` on and whose own lookup asks another shard than ``owner``: there the
        prefix is looked up alone (a prompt that short), and without it the lookup missed
        pages the cluster holds. A prefix with no new page was committed there by the store
        that added it. Nothing at ``controller_route_depth`` 0."""
        for shard, length in self.shards.short_prefix_owners(chain).items():
            if shard != owner and length > start:
                self._sent(self.shards.handles[shard].commit.remote(None, list(chain[:length]), list(nodes[:length]), 0, {}))

    def replicate(
        self,
        keys: Sequence[int],
        plan: Plan,
        loaded: Loaded,
        nodes: Sequence[str] | None = None,
        pages: int | None = None,
    ) -> dict[str, int]:
        """Copy the request's cached prefix to each of ``nodes`` (the cluster policy's
        ``replicate`` verb; default: this node); returns the pages each node's store added.

        The copy goes from buffer rows ``0..pages`` (default ``loaded.pages``: the pages just
        loaded; a caller that computed the rest of the cached prefix into the buffer, as the
        replay's engine does, passes ``plan.hit_pages``), so the bytes leave the node that now
        holds them all, over the paths a store takes (:meth:`path_for`: shared memory here,
        a peer's page server or the object store elsewhere). Each peer's store hears of the
        request with the copy, if first (``PathContext.tell_peer``), as the simulator tells
        every node a request writes to, and the controller indexes the pages it held
        elsewhere as further locations (``commit(..., replica=True)``). A node whose index
        locations already hold every page gets nothing. Call right after the request,
        before the next load; nothing is copied once the buffer was replaced (a call given
        up on may have written it) or when no node named is a live store."""
        upto = min(loaded.pages if pages is None else pages, plan.hit_pages)
        if not upto or self.context.stale or loaded.buffer != self.context.buffer.name:
            return {}
        held = plan.hit_nodes[:upto]
        targets = [n for n in dict.fromkeys(nodes or [self.node_id]) if n in self.stores and any(h != n for h in held)]
        if not targets:
            return {}
        if self._touched is not None and self.node_id in targets:
            ray.wait([self._touched], timeout=self.timeout_s)  # the policy sees the hits before the copies
            self._touched = None
        sub = list(keys[:upto])
        owner = self.shards.of(sub)
        copied, evicted, reports = {}, {}, {}
        with self._transfers() as sent:
            for node in targets:  # the copies move concurrently, one chain per node
                path = self.paths[self.path_for(node, upto * self.page_nbytes)]
                sent.append((path, path.start_store(self.stores[node], sub, Run(node, 0, upto), None, len(keys))))
            for node, (path, transfer) in zip(targets, sent):
                result = _finished(path, transfer)
                if result is None:
                    continue
                copied[node], reports[node] = result.stored, result.report
                dropped = {node: result.dropped} if result.dropped else {}
                evicted.update(dropped)
                landed = sub[: result.landed]
                commit = self.shards.handles[owner].commit
                self._sent(commit.remote(None, landed, [node] * len(landed), 0, dropped, {node: result.report}, None, True))
        if evicted:  # pages evicted from any chain: every other shard forgets those it indexes
            for shard, controller in enumerate(self.shards.handles):
                if shard != owner:
                    self._sent(controller.commit.remote(None, [], [], 0, evicted, reports))
        self._renew_if_stale(keep=0)
        return copied


def _finished(path: StoreCallPath, transfer) -> Stored | None:
    """A store transfer's answer (None: never started, or failed)."""
    return None if transfer is None else path.finish_store(transfer)
