"""The client API engines and jobs call: a request (lookup + pin, load, release, store).

A request is ``with client.request(keys) as r:`` (:meth:`KvrayClient.request`): lookup
and load on entry, release and store on exit, the landing buffer's rows readable only
inside the block. It runs four verbs, which callers that split a request (vLLM's
scheduler looks up, its worker loads) call themselves. Each covers a whole request with
one controller round trip at most, and none when this node's host tier holds the whole
request. With several controller shards, a request's calls all go to the shard owning
its chain (:mod:`kvray.cluster.shards`), so that is still one round trip:

- ``lookup(keys, backlog_ms)``: if every page is published in this node's shared host tier (its
  :class:`~kvray.core.tiers.directory.SlotDirectory`, mapped into this process), the answer is
  a local plan (lease ``LOCAL_LEASE``) made without any Ray call: nothing is pinned, the
  load validates each page itself. Otherwise the controller pins the cached prefix under
  a lease and says where each cached page is and where each missing page should go
  (:class:`~kvray.cluster.protocol.Plan`, by the cluster policy, which also hears the
  engine's ``backlog_ms``). The client names the lease, so when the
  answer does not come in time it still ends the pins the call may have taken; a lease
  never released (the client died) expires.
- ``load(keys, plan)``: pages arrive in the client's :class:`LandingBuffer` rows ``0..n``.
  This node's host pages are copied straight out of the mapped host tier (path
  ``mapped``: an optimistic, seqlock-validated copy; a page freed or rewritten meanwhile is
  not taken). The rest of a same-node run (pages on the local disk tier) comes from the
  store actor, which copies into the buffer (path ``local``); pages on other nodes by
  direct TCP from the peer's page server (:mod:`kvray.cluster.transfer`; no Ray call) or,
  with ``tcp`` off, by Ray's object store or, for transfers of at least
  ``collective_min_bytes``, by the collective path (the peer store sends straight into
  this node's store, which writes into the buffer). Runs of pages on different nodes move
  concurrently. Each path is a handler in :mod:`kvray.cluster.paths`, picked by :meth:`KvrayClient.path_for`
  (:mod:`kvray.cluster.loading`).
- ``store(keys, start, plan)``: rows ``start..`` of the buffer go to the nodes the plan
  chose (same-node by shared memory, others by direct TCP or, with ``tcp`` off, the
  object store), then the controller is told, without waiting, of the pages the stores
  hold: each store answers how much of its run it kept (``Stored.landed``), and a run
  kept in part ends the chain the controller learns there (:mod:`kvray.cluster.storing`).
- ``release(plan, loaded)``: unpins, reports hits per tier and any page the index promised
  that a store no longer had (that page is a miss, never wrong KV: every store verifies
  its checksums and ends the prefix at the first bad page), without waiting. The store
  hears of the hits on pages copied from its mapped host tier (``touch``), and a local
  plan's report reaches the controller through it, so a fully local request costs one
  Ray call, sent and not waited for.

This node's store hears of every request once, with the first call the request makes to
it (``read_into``, ``pull``, ``touch`` or ``write_from``, whichever comes first; ``touch``
is sent for it when no other would be): the request's keys and the engine's backlog, for
its placement policy's ``on_request``, before that policy sees any of the request's hits
or pages. A request's writes to this node wait until its ``touch`` is done, so the policy
sees the hits before the new pages, as the simulator shows them to it; a request that
writes here anyway sends no ``touch``: its first write carries the hits, counted before
its pages. An engine whose lookups and loads are made by different clients (vLLM's
scheduler and worker) tells the store itself after the lookup, with ``announce``. Likewise
a request that stores sends its controller release with the commit. ``settle`` waits
until everything a request sent without waiting has landed: a replay calls it between
requests (off the measured time), so the next request, on whichever node, finds the
cache exactly as the last one left it.

The mapped host tier belongs to one incarnation of the node's store (a fresh segment
each): the client asks the store every ``HOST_CHECK_S`` which segment it serves, without
waiting, and a closed segment says so in its header, so a client drops a dead or
restarted store's memory and maps the new one when the store answers again. Until it
notices, a dead store's segment is frozen: a page that validates there still holds
exactly its key's KV. Likewise the client re-reads the stores and their page servers from
the controller every ``MEMBERS_CHECK_S`` (without waiting), so a restarted store's new
page server is found.

While the controller is down (Ray restarts it and it rebuilds its index from the stores),
``lookup`` answers a miss with nothing to store (lease ``NO_LEASE``) instead of failing:
the engine computes the KV itself, as on any miss. A store call that fails (the store
raised, say its disk is full, or it died) or does not answer in ``timeout_s`` is a miss
too. A call given up on may still be running in the store, copying into or out of the
landing buffer; so the client never uses that buffer again: at the end of that ``load``
or ``store`` it moves to a fresh one (the rows loaded so far copied over), and the late
copy touches memory no request reads. Hence ``client.buffer`` is read anew after each
``load`` and ``store``, never kept across them; ``request`` enforces it (``r.rows`` raise
after the block).

Example::

    client = KvrayClient.connect("kvray")
    keys = client.keys_for_trace(request.hash_ids)
    with client.request(keys) as r:             # lookup + load
        ... use the KV in r.rows[:r.hit], compute the rest into r.rows[r.hit:] ...
        r.store()                               # on exit: release, then store rows r.hit..
    r.stored                                    # pages stored
    client.settle()                             # optional: wait until the reports have landed
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent import futures
from concurrent.futures import Future

import ray

from kvray.cluster.answers import SharedAnswers
from kvray.cluster.config import RuntimeConfig
from kvray.cluster.inflight import IN_FLIGHT, Claim
from kvray.cluster.loading import ChainLoads
from kvray.cluster.paths import (
    ACTOR_ERRORS,
    PATHS,
    STORE_ERRORS,
    PathContext,
    PathSpeeds,
    StoreCallPath,
    abandon_all,
    checked_hint,
)
from kvray.cluster.protocol import LOCAL_LEASE, NO_LEASE, Loaded, Plan, Release, Request, new_lease, runs_of
from kvray.cluster.shards import ControllerShards
from kvray.cluster.shm import LandingBuffer
from kvray.cluster.storing import ChainStores
from kvray.cluster.transfer import PeerLinks
from kvray.core.errors import ClusterError, RequestError, StorageError
from kvray.core.keys import pack_keys, trace_page_keys
from kvray.core.tiers.directory import SharedHostTier

HOST_CHECK_S = 1.0  # how often a client asks its node's store which host segment it serves
DEFAULT_TIMEOUT_S = 60.0  # how long a client waits for any one Ray call
MEMBERS_CHECK_S = 5.0  # how often a client re-reads the stores and their page servers
UNSETTLED_KEPT = 64  # calls sent without waiting kept for ``settle`` before the finished ones are let go


HOST_ANSWERS = SharedAnswers(HOST_CHECK_S)
MEMBERS_ANSWERS = SharedAnswers(MEMBERS_CHECK_S)


class KvrayClient(ChainLoads, ChainStores):
    """Per-process handle on a kvray runtime; see the module docstring.

    ``mapped_reads`` False sends every same-node page through the store actor (``read_into``),
    as before the host tier was mapped; benchmarks compare the two. ``faults`` counts the
    calls that became misses: ``timeout`` (no answer in ``timeout_s``), ``unavailable``
    (the actor died or is restarting), ``store_error`` (the store raised).

    What the transfer paths see of the client (the landing buffer, the routes to the
    stores, where faults are counted) lives in ``context`` (:class:`~kvray.cluster.paths.PathContext`);
    the properties below read it.
    """

    def __init__(
        self,
        config: RuntimeConfig,
        shards: ControllerShards,
        node_id: str | None = None,
        buffer_pages: int | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        mapped_reads: bool = True,
    ) -> None:
        self.config = config
        self.shards = shards
        self._members_from = itertools.cycle(shards.handles)  # any shard knows the members; ask them in turn
        self.node_id = node_id or ray.get_runtime_context().get_node_id()
        self.fingerprint = config.fingerprint()
        self.page_nbytes = config.layout.page_nbytes
        self.timeout_s = timeout_s
        self.context = PathContext(LandingBuffer.create(buffer_pages or config.max_request_pages, self.page_nbytes), timeout_s)
        self.mapped_reads = mapped_reads
        self.renewed_buffers = 0
        self._retired: list[LandingBuffer] = []  # old buffers a caller still held a view of
        self._host: SharedHostTier | None = None  # this node's store's host tier, mapped
        self._host_info: Future | None = None  # the local store's ``host_tier`` answer, while awaited
        self._next_check = 0.0  # when to ask the store again which segment it serves
        self._members: Future | None = None  # the controller's ``members`` answer, while awaited
        self._next_members = time.monotonic() + MEMBERS_CHECK_S
        self._touched = None  # ref: the latest ``touch``, which the next write here waits for
        self._unsettled: list = []  # refs of the calls sent without waiting, since the last ``settle``
        self.paths: dict[str, StoreCallPath] = {path.name: path(self.context) for path in PATHS}
        self.refresh()

    @classmethod
    def connect(cls, name: str = "kvray", **kwargs) -> KvrayClient:
        """Find the runtime ``name`` (all its controller shards) on the connected Ray cluster."""
        shards = ControllerShards.find(name, kwargs.get("timeout_s", DEFAULT_TIMEOUT_S))
        config = _answer(shards.handles[0].runtime_config.remote(), kwargs.get("timeout_s", DEFAULT_TIMEOUT_S), "runtime_config")
        return cls(config, shards, **kwargs)

    def refresh(self) -> None:
        """Re-read the live stores, their collective ranks and page servers from the controller."""
        self._route(_answer(next(self._members_from).members.remote(), self.timeout_s, "members"))
        self._detach()
        self._host_info, self._next_check = None, 0.0
        self._mapped_host(fresh=True)  # asks the local store which host segment it serves
        if self._host_info is not None:
            futures.wait([self._host_info], timeout=self.timeout_s)
            self._mapped_host()

    def _route(self, members: dict) -> None:
        self.stores: dict[str, ray.actor.ActorHandle] = members["stores"]
        context = self.context
        context.local_store = self.stores.get(self.node_id)
        context.ranks, context.servers = members["ranks"], members["servers"]
        if context.links is None and members["token"] is not None:
            context.links = PeerLinks(members["token"], self.page_nbytes, self.timeout_s, self.config.keepalive)

    # -- what the transfer paths see, read here too -------------------------------------------
    @property
    def buffer(self) -> LandingBuffer:
        """The landing buffer: read it anew after each ``load`` and ``store`` (it may be a fresh one)."""
        return self.context.buffer

    @property
    def local_store(self) -> ray.actor.ActorHandle | None:
        return self.context.local_store

    @property
    def servers(self) -> dict[str, tuple[str, int]]:
        return self.context.servers

    @property
    def links(self) -> PeerLinks | None:
        return self.context.links

    @property
    def speeds(self) -> PathSpeeds:
        return self.context.speeds

    @property
    def faults(self) -> Counter[str]:
        return self.context.faults

    def _poll_members(self) -> None:
        """Every ``MEMBERS_CHECK_S`` ask the controller (without waiting) who serves where,
        and route by the answer once it is in: a store that restarted serves pages from a
        new page server port, which a client that never asked would not find."""
        now = time.monotonic()
        if self._members is None and now >= self._next_members:
            ask = next(self._members_from).members.remote
            self._members = MEMBERS_ANSWERS.ask(self.config.name, ask)
            self._next_members = now + MEMBERS_CHECK_S
        if self._members is not None and self._members.done():
            with contextlib.suppress(ray.exceptions.RayError):  # the controller is restarting: asked again later
                self._route(self._members.result())
            self._members = None

    # -- this node's host tier, mapped ------------------------------------------------------
    def _mapped_host(self, fresh: bool = False) -> SharedHostTier | None:
        """The local store's host tier if mapped and current; never blocks on Ray.

        Every ``HOST_CHECK_S`` the store is asked (without waiting, once for all the
        process's clients, :class:`SharedAnswers`; ``fresh``: now) which segment it serves;
        an answer naming another segment (the store restarted), none, or an error (it is
        gone) drops the mapping, and a new segment is mapped. A segment its store closed
        says so in its header and is dropped at once.
        """
        if self._host is not None and not self._host.open:
            self._detach()
        now = time.monotonic()
        if self._host_info is None and now >= self._next_check and self.local_store is not None:
            store = self.local_store
            self._host_info = HOST_ANSWERS.ask((self.config.name, self.node_id), store.host_tier.remote, fresh)
            self._next_check = now + HOST_CHECK_S
        if self._host_info is not None and self._host_info.done():
            try:
                info = self._host_info.result()
            except ray.exceptions.RayError:
                info = None  # the store is gone or restarting; the actor path serves meanwhile
            self._host_info = None
            if self._host is None or info is None or info["name"] != self._host.name:
                self._detach()
                with contextlib.suppress(StorageError):  # unlinked since it answered (it stopped): asked again next check
                    self._host = SharedHostTier.attach(**info) if info else None
        return self._host

    def _detach(self) -> None:
        if self._host is not None:
            self._host.close()
        self._host = None

    def keys_for_trace(self, hash_ids: Sequence[int], salt: str = "") -> list[int]:
        """Page keys of a trace request: its prefix-chained block ids bound to this model."""
        return trace_page_keys(self.fingerprint, hash_ids, salt)

    def _check(self, keys: Sequence[int], limit: int | None = None) -> None:
        """Keys of one request that fit ``limit`` pages (default: the landing buffer's rows)."""
        if not keys:
            raise RequestError("empty request: no page keys")
        limit = self.buffer.capacity if limit is None else limit
        if len(keys) > limit:
            raise RequestError(f"request of {len(keys)} pages exceeds max_request_pages={limit}")

    # -- a whole request ------------------------------------------------------------------------
    @contextlib.contextmanager
    def request(
        self,
        keys: Sequence[int],
        backlog_ms: float = 0.0,
        load_pages: int | None = None,
        arrival_ms: float | None = None,
        ends_session_from: int = -1,
    ) -> Iterator[Request]:
        """``with client.request(keys) as r:``: look up and load the cached prefix of ``keys``
        on entry; the block reads ``r.rows[:r.hit]``, computes the rest into ``r.rows[r.hit:]``
        and calls ``r.store()`` to have it stored; on exit the lease is released (whether
        the block raised or not) and then, if asked and nothing raised, the rows stored
        (``r.stored`` pages). A request that stores pages sends its release with the
        store's commit (:class:`~kvray.cluster.protocol.Release`): one controller call
        fewer per request that missed. ``r.rows`` are valid inside the block only
        (:class:`~kvray.cluster.protocol.Request`), so no caller keeps the landing buffer
        across calls that may replace it. Before its lookup a request claims the pages it
        may compute; one whose first such page another request of this process claimed
        waits for that request first (:mod:`kvray.cluster.inflight`), so the page is
        computed and stored once. The verbs below stay for callers that split a request
        (vLLM's scheduler looks up, its worker loads) or test one step of it.

        ``load_pages``: load only that many pages of the cached prefix (the cluster policy's
        load-or-recompute split); the caller recomputes the rest (``r.hit`` is what was
        loaded), their holders count them as hits (recency, as in the simulator), and they
        are not stored again: the pages after the whole cached prefix are.

        ``arrival_ms``: when the request arrived, as the stores' policies are told (None: now,
        on each store's clock; a trace replay gives the trace's time, as the simulator does).
        ``ends_session_from``: the client's hint that this request is its session's last and
        that its pages from that index on are its own, shared with no other session
        (:class:`~kvray.core.placement.RequestInfo`; -1, the default: no hint), for the
        stores' policies (``lru-session-end`` and ``reuse-session-end`` store none of them and
        let them go first).
        """
        self._check(keys)  # before anything is pinned: the rows must fit the landing buffer
        checked_hint(ends_session_from, len(keys))  # and before waiting on another request's claim
        claim = self._claim_computing(keys)
        try:
            plan = self.lookup(keys, backlog_ms, arrival_ms=arrival_ms, ends_session_from=ends_session_from)
            if claim is not None:
                claim = claim.narrow(keys[plan.hit_pages :])
            cut = plan.hit_pages if load_pages is None else min(max(load_pages, 0), plan.hit_pages)
            loaded, request, finished, skipped = Loaded(0), None, False, 0
            try:
                to_load = plan if cut == plan.hit_pages else dataclasses.replace(plan, hit_nodes=plan.hit_nodes[:cut])
                loaded = self.load(keys, to_load)
                if loaded.pages == cut < plan.hit_pages:  # the split as decided (a load cut short stores from where it stopped)
                    skipped = plan.hit_pages - cut
                    self.touch_unloaded(keys, plan, cut)
                request = Request(keys, plan, loaded, self.buffer.pages[: len(keys)], recomputed=skipped)
                yield request
                finished = True
            finally:  # a lease never released would pin its pages until it expires
                if request is not None:
                    request.close()
                start = loaded.pages + skipped
                storing = finished and request.store_wanted and start < len(keys)
                held = self._release(plan, loaded, to_controller=not storing, unloaded=skipped)
            if request.store_wanted:
                request.stored = self.store(keys, start, plan, release=held)
        finally:
            if claim is not None:
                claim.end()

    def _claim_computing(self, keys: Sequence[int]) -> Claim | None:
        """Claim the pages of ``keys`` from the first this node's host tier does not hold,
        or, if another request of this process claimed that page, wait for it (at most
        ``timeout_s``) rather than compute and store it a second time
        (:mod:`kvray.cluster.inflight`). None: nothing to claim, waited, or no mapped host
        tier (a client that does not read it does not know what this node holds)."""
        host = self._mapped_host() if self.mapped_reads else None
        if host is None:  # what this node holds is not known here: no claim
            return None
        held = host.held(keys)
        return IN_FLIGHT.claim(self.config.name, keys[held:], self.timeout_s) if held < len(keys) else None

    @property
    def last_touch(self) -> ray.ObjectRef | None:
        """The latest ``touch`` this client sent to its node's store that no write of its own
        waited for yet: what another client storing the same request's pages
        :meth:`follows <follow>`."""
        return self._touched

    def follow(self, touch: ray.ObjectRef | None) -> None:
        """Make this client's next write to its node wait for ``touch`` (another client's
        :attr:`last_touch`) first: when one client loads a request's pages and another
        stores its new ones, the node's policy still sees the hits before the new pages."""
        if touch is not None:
            self._touched = touch

    def touch_unloaded(self, keys: Sequence[int], plan: Plan, cut: int) -> None:
        """The cached pages ``cut..`` a split request recomputes instead of loading: each
        holder counts them as read (the simulator touches a request's whole cached prefix),
        without sending a byte. Each store hears of the request with it, if first."""
        for run in runs_of(plan.hit_nodes[cut:], cut):
            here = run.node == self.node_id
            told = self.context.take_arrival() if here else self.context.tell_peer(run.node)
            if (store := self.stores.get(run.node)) is not None:
                ref = self._sent(store.touch.remote(pack_keys(keys[run.start : run.stop]), None, told, 0, None))
                self._touched = ref if here else self._touched

    # -- lookup + pin ---------------------------------------------------------------------------
    def lookup(
        self,
        keys: Sequence[int],
        backlog_ms: float = 0.0,
        route_key: int | None = None,
        arrival_ms: float | None = None,
        ends_session_from: int = -1,
        tell: bool = True,
    ) -> Plan:
        """Where the cached prefix of ``keys`` is (pinned) and where the rest goes; a request
        larger than the landing buffer (up to ``max_request_pages``) is loaded with
        :meth:`load_chunks`. ``backlog_ms``: the engine's work queued ahead of it, which the
        controller's and this node's policies are told. ``route_key``: the key of the chain
        the request will store (:meth:`ControllerShards.route_key
        <kvray.cluster.shards.ControllerShards.route_key>`) when that chain is longer than
        ``keys`` (an engine looks up all but the page holding the prompt's last token, and
        stores that page too): the lookup asks the shard the store commits to. None: ``keys``.
        ``arrival_ms``, ``ends_session_from``: as :meth:`request` takes them. ``tell`` False:
        this client's calls tell no store of the request (a retried lookup of a request its
        stores heard of already)."""
        self._check(keys, max(self.buffer.capacity, self.config.max_request_pages))
        self._poll_members()
        packed = pack_keys(keys)  # for the controller too: a list of 128-bit ints is serialized int by int
        if tell:
            self.context.arrive(packed, backlog_ms, arrival_ms, ends_session_from)
        else:
            self.context.quiet()
        shard = self.shards.of(keys) if route_key is None else self.shards.owner(route_key)
        host = self._mapped_host() if self.mapped_reads else None
        if host is not None and host.held(keys) == len(keys):
            return Plan(LOCAL_LEASE, [self.node_id] * len(keys), [], shard)
        lease = new_lease()
        controller = self.shards.handles[shard]
        try:
            ref = controller.lookup_pin.remote(packed, self.node_id, lease, float(backlog_ms))
            plan = ray.get(ref, timeout=self.timeout_s)
        except ACTOR_ERRORS as exc:
            self.context.count_fault(exc)
            # The pin may still happen (or have happened) after we stopped waiting: end it by
            # its id. The controller runs one caller's calls in order, so this comes after it.
            controller.release.remote(lease, {}, {})
            return Plan(NO_LEASE, [], [], shard)  # the controller is restarting or slow: a miss, nothing placed
        return dataclasses.replace(plan, shard=shard)

    def announce(self, keys: Sequence[int], ends_session_from: int = -1) -> None:
        """Tell this node's store now of the request this client looked up last, as a request of
        ``keys`` (root first: every page it may store, which can be more than it looked up) with
        its client's end-of-session hint over them, the lookup's backlog and arrival kept; and
        wait until the store has heard (at most ``timeout_s``; a store that does not answer is
        counted in ``faults``). In place of the lookup's own telling, so the store hears of the
        request once. For an engine whose lookups and loads are made by different clients (the
        vLLM connector's scheduler looks up; its worker loads and stores with clients of its
        own, whose calls carry no arrival). A bad hint is refused by name; no store here: no call."""
        looked_up = self.context.take_arrival()
        backlog_ms, arrival_ms = (looked_up[1], looked_up[2]) if looked_up is not None else (0.0, None)
        arrival = (pack_keys(keys), backlog_ms, arrival_ms, checked_hint(ends_session_from, len(keys)))
        if self.local_store is None:
            return
        try:
            ray.get(self.local_store.touch.remote(b"", None, arrival, 0, None), timeout=self.timeout_s)
        except STORE_ERRORS as exc:
            self.context.count_fault(exc)

    def settle(self) -> None:
        """Wait (at most ``timeout_s``) until what was sent without waiting has run (reports to the
        controller and stores, peers' policy work after their answers): what comes next sees it."""
        if self.links is not None:
            self.links.settle()
        if self._unsettled:
            ray.wait(self._unsettled, num_returns=len(self._unsettled), timeout=self.timeout_s)
            self._unsettled = []

    def _sent(self, ref):
        """Keep a call sent without waiting until ``settle``; a client that never settles
        keeps only the ones still running (checked without waiting every ``UNSETTLED_KEPT``)."""
        self._unsettled.append(ref)
        if len(self._unsettled) >= UNSETTLED_KEPT:
            _, self._unsettled = ray.wait(self._unsettled, num_returns=len(self._unsettled), timeout=0)
        return ref

    @contextlib.contextmanager
    def _transfers(self) -> Iterator[list[tuple[StoreCallPath, object]]]:
        """The transfers a verb starts, appended as ``(path, pending)``. If the verb raises,
        those it never finished must not outlive it: each is abandoned (a peer link whose
        answer was left unread is dropped, or the next request's read would take that answer,
        whose pages pass their checksums, for its own), and the client moves to a fresh landing
        buffer, keeping no rows (a store actor's call may still use the old one), before the
        error goes on."""
        started: list[tuple[StoreCallPath, object]] = []
        try:
            yield started
        except BaseException as error:
            abandon_all(started)
            self.context.buffer_may_be_in_use()
            try:
                self._renew_if_stale(keep=0)
            except RequestError as kept:  # raised once renewed: the verb's error is the one to raise, this its note
                error.add_note(str(kept))
            raise

    def _renew_if_stale(self, keep: int) -> None:
        """Move to a fresh landing buffer if a call given up on may still use this one;
        rows ``0..keep`` (loaded, and out of every late call's reach) come along.

        The old buffer is unmapped and unlinked here, before its store hears of it, so a
        late call that has not mapped it yet cannot. A caller still holding a view of it
        would compute into memory no store call reads: that fails loudly (RequestError),
        and that buffer stays mapped until ``close``.
        """
        context = self.context
        if not context.stale:
            return
        old, name = context.buffer, context.buffer.name
        context.buffer = LandingBuffer.create(old.capacity, self.page_nbytes)
        context.buffer.pages[:keep] = old.pages[:keep]
        context.stale = False
        self.renewed_buffers += 1
        held = old.views_out > 0
        if held:
            self._retired.append(old)
        else:
            old.close()
        if self.local_store is not None:
            self.local_store.release_buffer.remote(name)  # unmapped there once its late call returns
        if held:
            raise RequestError("a view of client.buffer.pages was kept across load/store; read client.buffer anew after each")

    # -- release ----------------------------------------------------------------------------------
    def release(self, plan: Plan, loaded: Loaded) -> None:
        """Report the request's hits and losses; nothing waits for an answer.

        Pages copied from the mapped host tier are hits the store has not seen: it is
        told (``touch``), and for a local plan (nothing pinned at the controller) that one
        call also carries the report, which the store forwards to the controller. A
        controller lease is always released directly, so a dying store cannot leave its
        pages pinned.
        """
        self._release(plan, loaded, to_controller=True)

    def _release(self, plan: Plan, loaded: Loaded, to_controller: bool, unloaded: int = 0) -> Release | None:
        """:meth:`release`; with ``to_controller`` False (the request stores next) the
        controller's part (a plan it pinned) is returned instead of sent, for the store's
        commit to carry, and the mapped hits wait for the write to this node, if any, to
        carry them (``PathContext.hits``) instead of a ``touch`` of their own. ``unloaded``:
        cached pages the request chose to recompute (not lost, not stored again)."""
        local_pages = plan.hit_pages if plan.lease == LOCAL_LEASE else 0
        report = Release(plan.lease, loaded.by_tier, loaded.lost, loaded.bytes_between_nodes, local_pages)
        store = self.local_store
        # The request's arrival goes with this touch unless a write here will carry it.
        writes_here = plan.hit_pages - unloaded > loaded.pages or self.node_id in plan.targets
        if store is not None and plan.lease == LOCAL_LEASE:
            self._touched = self._sent(
                store.touch.remote(pack_keys(loaded.mapped), report, self.context.take_arrival(), plan.shard, loaded.mapped_s)
            )
            return None
        if store is not None and not to_controller and writes_here:
            # The write here, next, tells the store of the mapped hits (and the arrival) first: one call, not two.
            self.context.hits = (pack_keys(loaded.mapped), loaded.mapped_s) if loaded.mapped else None
        elif store is not None and (loaded.mapped or (self.context.arrival is not None and not writes_here)):
            self._touched = self._sent(
                store.touch.remote(pack_keys(loaded.mapped), None, self.context.take_arrival(), 0, loaded.mapped_s)
            )
        if not to_controller:
            return report
        self._send_release(plan.shard, report)
        return None

    def _send_release(self, shard: int, report: Release) -> None:
        self._sent(self.shards.handles[shard].release.remote(*report))

    def close(self) -> None:
        if self.links is not None:
            self.links.close()
        self._detach()
        for store in self.stores.values():
            store.release_buffer.remote(self.buffer.name)
        for buf in (*self._retired, self.buffer):
            buf.close()


def _answer(ref, timeout_s: float, what: str):
    """``ray.get`` of a controller call the client cannot work without, or a ClusterError."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise ClusterError(f"the kvray controller did not answer {what} within {timeout_s:g} s") from None
    except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
        raise ClusterError(f"the kvray controller is unavailable ({type(exc).__name__})") from None
