"""Cache manager: the control plane of one cache, with no page bytes in it.

Verbs (the shape of vLLM's offloading manager):

- ``lookup(keys)``: the longest cached prefix, with each page's tier, slot and checksum.
- ``pin`` / ``unpin``: protect pages being read; a pinned page is never evicted or moved.
- ``keep`` / ``release``: a lighter guard for pages that must not be *dropped* while a
  store or move builds on them; they may still be demoted.
- ``touch(handles)``: record a hit (heat, recency) and tell the policy.
- ``reserve(tier, mover)``: a free slot in ``tier``, evicting by the policy if needed.
  Eviction demotes the victim to the tier the policy names, as a two-phase move
  (:meth:`relocate`), or drops it.
- ``store_chain(keys, mover, write)``: store a request's pages that are not cached yet,
  each admitted, given a slot and published under the page before it; the one writer
  of chains, used by the PageStore, the simulator and the training environment.
- ``complete_store`` / ``abort_store``: publish a page written into a reserved slot, or
  give the slot back. A page is published under its parent (the previous page of its
  request), which keeps the index prefix-closed; ``drop`` removes a page's descendants
  with it.
- ``relocate(handle, tier, mover)``: reserve at the destination, let ``mover`` copy and
  verify, then publish the new location and only then free the source. If the copy
  fails the page stays where it was.

The data plane supplies ``mover(handle, src_tier, src_slot, dst_tier, dst_slot)``: the
:class:`~kvray.core.store.PageStore` copies bytes, the simulator adds modeled time. Both run the
same manager, index, slot accounting and policy (docs/design.md, "One policy, two worlds").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kvray.core.errors import KvrayError
from kvray.core.index import ROOT, PrefixIndex
from kvray.core.metrics import CacheMetrics
from kvray.core.placement import PageContext, PlacementPolicy
from kvray.core.tiers import TIER_LABELS, SlotAllocator, Tier
from kvray.core.write_budget import WriteBudget, checked_rate

Mover = Callable[[int, Tier, int, Tier, int], int | None]  # returns a checksum it computed, if any
# (depth, key, tier, slot, parent handle) -> the checksum of the page it wrote into the slot
Writer = Callable[[int, int, Tier, int, int], int]
TIERS = tuple(Tier)  # tier number -> Tier, without the enum's slow constructor
REFUSALS_PER_RESERVE = 32  # victims that may refuse to leave before a reserve gives up (see reserve)


@dataclass(frozen=True)
class Match:
    """The cached prefix of a request: one entry per page, root first."""

    handles: np.ndarray
    tiers: np.ndarray
    slots: np.ndarray
    checksums: np.ndarray

    def __len__(self) -> int:
        return len(self.handles)


class CacheManager:
    """Index + slot accounting + placement policy for a set of tiers.

    Example::

        from kvray.core.index import ROOT
        manager = CacheManager({Tier.HOST: 2, Tier.DISK: 8}, LRUPolicy())
        slot = manager.reserve(Tier.HOST, mover=lambda *move: None)
        manager.complete_store(key=1, tier=Tier.HOST, slot=slot, checksum=0, parent=ROOT)
        manager.lookup([1, 2]).tiers        # array([1]): page 1 is on the host tier
    """

    def __init__(
        self,
        capacities: Mapping[Tier, int],
        policy: PlacementPolicy,
        page_nbytes: int = 0,
        used_slots: Mapping[Tier, Sequence[int]] | None = None,
    ) -> None:
        used_slots = used_slots or {}
        self.capacities = {Tier(t): c for t, c in capacities.items() if c > 0}
        self.slots = {t: SlotAllocator.with_used(c, list(used_slots.get(t, []))) for t, c in self.capacities.items()}
        self.index = PrefixIndex()
        self.policy = policy
        self.policy.bind(self.index, self.capacities)
        self.metrics = CacheMetrics(page_nbytes=page_nbytes)
        # Listeners of the data plane; None (the simulator's case) saves building their arguments.
        self.slot_freed: Callable[[Tier, int], None] | None = None
        # a page was published in a slot: (key, tier, slot, checksum); the slot's bytes are complete
        self.page_placed: Callable[[int, Tier, int, int], None] | None = None
        self.page_dropped: Callable[[int], None] | None = None  # a key left this cache
        # the NVMe write budget (kvray.core.write_budget): a page the disk tier cannot pay for is not written
        self.disk_budget: WriteBudget | None = None
        self._kept: dict[int, int] = {}  # handle -> keep count
        # kept handle -> itself and its ancestors: stable while it is kept (they cannot be
        # dropped), so repeated eviction refusals along one chain walk it once
        self._lineage: dict[int, set[int]] = {}

    @property
    def tiers(self) -> list[Tier]:
        return sorted(self.capacities)

    # -- reads ---------------------------------------------------------------------------
    def lookup(self, keys: Sequence[int], count: bool = True) -> Match:
        handles = self.index.lookup(keys)
        # fancy indexing copies: the match stays as it was when the index moves on
        match = Match(handles, self.index.tier[handles], self.index.slot[handles], self.index.checksum[handles])
        if count:
            self.metrics.lookups += 1
            self.metrics.lookup_pages += len(keys)
            for tier, n in enumerate(np.bincount(match.tiers, minlength=len(TIERS)).tolist()):
                if n:
                    self.metrics.hit_pages[TIERS[tier].label] += n
        return match

    def pin(self, handles: np.ndarray) -> None:
        self.index.pin(handles)

    def unpin(self, handles: np.ndarray) -> None:
        self.index.unpin(handles)

    def keep(self, handle: int) -> None:
        self._kept[handle] = self._kept.get(handle, 0) + 1

    def release(self, handle: int) -> None:
        n = self._kept[handle] - 1
        if n:
            self._kept[handle] = n
        else:
            del self._kept[handle]
            self._lineage.pop(handle, None)

    @property
    def chain_compilable(self) -> bool:
        """Whether the simulator's compiled chain writer (kvray/sim/_chain.c) may run the next
        :meth:`store_chain` exactly as this Python does: nothing kept from outside the call, no
        disk write budget, and a policy whose hooks it may call in its order."""
        return not self._kept and self.disk_budget is None and self.policy.compiled_chain

    def touch(self, handles: np.ndarray) -> None:
        self.index.touch(handles)
        self.policy.on_access(handles)

    # -- placement -----------------------------------------------------------------------
    def admit(self, ctx: PageContext) -> Tier | None:
        tier = self.policy.admit(ctx)
        return tier if tier in self.slots else None

    def reserve(self, tier: Tier, mover: Mover) -> int | None:
        """A free slot of ``tier``; evicts by the policy until one frees. None if none can leave.

        At most :data:`REFUSALS_PER_RESERVE` victims may refuse to leave (a descendant kept or
        pinned) before it gives up: a chain longer than the cache refuses every victim
        (each is one of its own ancestors), and trying them all, each demotion trying every
        victim of the tier below, made one store of a 2,000-page chain take 26 s (16,000
        pages: over 10 minutes). Giving up early costs at most a page not cached, and it
        guards admission: when the policy's next victims are the ancestors of the chain
        being stored, the chain's tail is not stored at the cost of everyone else's pages.

        A victim that refuses because a kept page is it or sits below it (the chain being
        stored under, a page being moved) is refused together with every page of the tier
        that would refuse the same way (in a kept lineage, with no tier to move to or the one
        whose reserve just failed), each counting as a refusal, so that the policy is not
        asked for them one by one: policies whose victim order offers the chain being stored
        (LFU, WFQ: its oldest, unhit pages) spent their replays refusing it, each refusal in
        a middle tier first running the tier below's reserve to its limit (docs/sim-eval,
        "Replay time"). Passing over them without counting them was measured too: fast as
        well, but it stores the chain's tail at everyone else's cost (ARC's mean TTFT moved
        by -8% to +8% on held-out cells).
        """
        slot = self.slots[tier].alloc()
        return slot if slot is not None else self._make_room(tier, mover)

    def _make_room(self, tier: Tier, mover: Mover) -> int | None:
        """:meth:`reserve` of a ``tier`` whose allocator just had no free slot: evict until
        one frees. Callers that tried the allocator themselves (a move, a store) come here
        directly, so that an eviction cascade asks each tier's allocator once per level."""
        allocator = self.slots[tier]
        policy = self.policy
        refused: list[int] = []  # victims that could not leave; pinned so the policy skips them
        try:
            while True:
                victim = policy.victim(tier)
                if victim is None or len(refused) >= REFUSALS_PER_RESERVE:
                    return None
                target = self._demote_target(victim, tier)
                if self.evict(victim, mover, target):
                    slot = allocator.alloc()
                    if slot is not None:
                        return slot
                    continue
                held = self._held_with(victim, tier, target) or [victim]
                self.index.pin(np.array(held, dtype=np.int64))
                refused.extend(held)
        finally:
            if refused:  # a victim named again while refused was pinned again: each pin undone
                handles, times = np.unique(np.array(refused, dtype=np.int64), return_counts=True)
                for k in range(int(times.max())):
                    self.index.unpin(handles[times > k])

    def _demote_target(self, handle: int, tier: Tier) -> Tier | None:
        """Where the policy would demote ``handle`` from ``tier``, if that tier exists here."""
        dst = self.policy.demote_target(handle, tier)
        return dst if dst is not None and dst in self.slots else None

    def _held_with(self, victim: int, tier: Tier, target: Tier | None) -> list[int] | None:
        """When ``victim`` refused to leave ``tier`` because it is in the lineage of a kept
        page: it and the other unpinned pages of ``tier`` in kept lineages that would refuse
        the same way (their demotion ``target`` is the victim's, whose reserve failed, or
        none: kept lineages are not dropped). None when no kept page is below the victim."""
        lineages = [self._lineage_of(kept) for kept in self._kept]
        if not any(victim in lineage for lineage in lineages):
            return None
        index = self.index
        tiers, pins = index.tier, index.pins
        held = []
        for handle in set().union(*lineages):
            if tiers.item(handle) == tier and pins.item(handle) == 0:
                dst = self._demote_target(handle, tier) if handle != victim else target
                if dst is None or dst == target:
                    held.append(handle)
        return held

    def evict(self, handle: int, mover: Mover, dst: Tier | None) -> bool:
        """Demote ``handle`` to ``dst`` (None: nowhere), else drop it (with its descendants).

        False when neither is possible (a descendant is pinned or kept): the page stays.
        """
        if dst is not None and self.relocate(handle, dst, mover):
            return True
        return self.drop(handle) > 0

    def relocate(self, handle: int, dst: Tier, mover: Mover) -> bool:
        """Two-phase move of one page; False (page untouched at its source) on failure, or
        when the disk write budget refuses a move to disk."""
        if not self._budget_allows(dst):
            return False
        index = self.index
        src, src_slot = TIERS[index.tier.item(handle)], index.slot.item(handle)
        dst_slot = self.slots[dst].alloc()  # a free slot needs no room made, so no keep
        if dst_slot is None:
            self.keep(handle)  # the source must survive making room below
            try:
                dst_slot = self._make_room(dst, mover)
            finally:
                self.release(handle)
            if dst_slot is None:
                return False
        try:
            digest = mover(handle, src, src_slot, dst, dst_slot)
        except KvrayError:
            self.abort_store(dst, dst_slot)
            return False
        if digest is not None:
            index.checksum[handle] = digest
        self._budget_pay(dst)
        policy = self.policy
        policy.on_remove(handle, src)
        index.move(handle, dst, dst_slot)
        if self.page_placed is not None:
            self.page_placed(index.key_of(handle), dst, dst_slot, index.checksum.item(handle))
        policy.on_insert(handle, dst)
        self._free(src, src_slot)
        self.metrics.count_move(TIER_LABELS[src], TIER_LABELS[dst])
        return True

    def set_disk_budget(self, bytes_per_s: float | None, clock: Callable[[], float]) -> None:
        """Give the disk tier a write budget of ``bytes_per_s`` on ``clock`` (None: no budget),
        keeping what its bucket holds when it has one already: what a node's store and the
        simulator's node do with the cluster policy's ``disk_write_budget``."""
        rate = checked_rate(bytes_per_s)
        if rate is None:
            self.disk_budget = None
        elif self.disk_budget is None:
            self.disk_budget = WriteBudget(rate, self.metrics.page_nbytes, clock)
        else:
            self.disk_budget.set_rate(rate)

    def _budget_allows(self, tier: Tier) -> bool:
        """Whether the disk write budget (if any) pays for one more page written to ``tier``
        (checked before a slot is taken; paid once the page is written: :meth:`_budget_pay`)."""
        return tier != Tier.DISK or self.disk_budget is None or self.disk_budget.allows()

    def _budget_pay(self, tier: Tier) -> None:
        if tier == Tier.DISK and self.disk_budget is not None:
            self.disk_budget.pay()

    def promote(self, handles: np.ndarray, mover: Mover) -> None:
        """Move hit pages up where the policy asks (pinned pages stay put). Nothing to ask
        a policy that never promotes (the base class's ``promote_target``): this runs after
        every load, whose copies have just evicted the interpreter's data from cache."""
        if type(self.policy).promote_target is PlacementPolicy.promote_target:
            return
        index = self.index
        handles = handles.tolist()
        keys = [index.key_of(handle) for handle in handles]
        for handle, key in zip(handles, keys):
            if index.handle_of(key) != handle:  # dropped making room for an earlier one's move
                continue
            src = TIERS[self.index.tier[handle]]
            dst = self.policy.promote_target(handle, src)
            if dst is not None and dst in self.slots and dst != src and self.index.pins[handle] == 0:
                self.relocate(handle, dst, mover)

    # -- writes --------------------------------------------------------------------------
    def store_chain(
        self,
        keys: Sequence[int],
        mover: Mover,
        write: Writer | None = None,
        *,
        parent: int = ROOT,
        priority: int = 0,
        tenant: str = "",
        start: int = 0,
        stop: int | None = None,
        first_depth: int = 0,
        request_pages: int | None = None,
    ) -> int:
        """Store the pages of one chain of ``keys`` (below ``parent``) that are not cached
        yet, in order; returns how many were stored. With ``start``/``stop`` only
        ``keys[start:stop]`` are this cache's (a cluster spreads one chain over nodes): the
        first of them goes below ``parent`` and each keeps its depth in the whole chain.
        A caller given only its run of a request's chain (a cluster node's store) says where
        the run sits instead: ``keys[0]`` at depth ``first_depth`` of a request of
        ``request_pages`` pages (default ``len(keys)``), as the policy is told of each page.

        Each page is admitted by the policy, given a slot (evicting by the policy while the
        page it joins is kept, so making room never drops its own chain), written by
        ``write`` (the data plane; the simulator has none and stores checksum 0) and
        published under its parent. Storing stops at the first page not kept: its
        descendants could never be matched. If ``write`` raises, its slot is given back.
        """
        index = self.index
        stored = 0
        for depth in range(start, len(keys) if stop is None else stop):
            key = keys[depth]
            handle = index.handle_of(key)
            if handle is None:
                ctx = PageContext(
                    depth=first_depth + depth,
                    request_pages=request_pages or len(keys),
                    priority=priority,
                    tenant=tenant,
                    key=key,
                )
                tier = self.admit(ctx)
                if tier is None or not self._budget_allows(tier):
                    break
                slot = self._reserve_under(parent, tier, mover)
                if slot is None:
                    break
                checksum = 0
                if write is not None:
                    try:
                        checksum = write(depth, key, tier, slot, parent)
                    except BaseException:
                        self.abort_store(tier, slot)
                        raise
                handle = self.complete_store(key, tier, slot, checksum, parent=parent, depth=ctx.depth, ctx=ctx)
                self._budget_pay(tier)
                stored += 1
            parent = handle
        return stored

    def _reserve_under(self, parent: int, tier: Tier, mover: Mover) -> int | None:
        """A slot in ``tier`` for a child of ``parent``, which is kept while room is made."""
        slot = self.slots[tier].alloc()  # a free slot needs no room made, so no keep
        if slot is not None:
            return slot
        if parent == ROOT:
            return self._make_room(tier, mover)
        self.keep(parent)
        try:
            return self._make_room(tier, mover)
        finally:
            self.release(parent)

    def complete_store(
        self,
        key: int,
        tier: Tier,
        slot: int,
        checksum: int,
        *,
        parent: int,
        depth: int = 0,
        ctx: PageContext | None = None,
    ) -> int:
        """Publish a page written into a reserved slot, under its ``parent`` handle (or ``index.ROOT``)."""
        handle = self.restore(key, tier, slot, checksum, parent=parent, depth=depth)
        if ctx is not None:
            self.policy.on_admitted(handle, ctx)
        self.metrics.stored_pages += 1
        self.metrics.stored_by_tier[TIER_LABELS[tier]] += 1
        return handle

    def restore(self, key: int, tier: Tier, slot: int, checksum: int, *, parent: int, depth: int = 0) -> int:
        """Publish a page found already in place (a disk tier after a restart)."""
        handle = self.index.add(key, tier, slot, checksum, parent=parent, depth=depth)
        if self.page_placed is not None:
            self.page_placed(key, tier, slot, checksum)
        self.policy.on_insert(handle, tier)
        return handle

    def abort_store(self, tier: Tier, slot: int) -> None:
        self._free(tier, slot)

    def drop(self, *handles: int) -> int:
        """Forget pages and their descendants, freeing their slots (eviction, corruption,
        a lost node). Returns how many pages went; 0 if any of them is pinned or kept."""
        index = self.index
        if len(handles) == 1 and index.is_leaf(handles[0]):  # an eviction's victim: scalar checks only
            doomed = list(handles)
            if handles[0] in self._kept or index.pins.item(handles[0]) > 0:
                return 0
        else:
            if not index.has_children(handles).any():
                doomed = list(handles)
                if any(handle in self._kept for handle in doomed):
                    return 0
            elif self._keeps_descendant(handles):
                return 0  # cheap refusal before walking a possibly large subtree
            else:
                doomed = index.subtree(handles)
            if (index.pins[doomed] > 0).any():
                return 0
        tiers, slots, policy = index.tier, index.slot, self.policy
        for handle in doomed:
            tier, slot = TIERS[tiers.item(handle)], slots.item(handle)
            policy.on_remove(handle, tier)
            key = index.remove(handle)
            self._free(tier, slot)
            if self.page_dropped is not None:
                self.page_dropped(key)
        self.metrics.evicted_pages += len(doomed)
        return len(doomed)

    def _keeps_descendant(self, handles: Sequence[int]) -> bool:
        """Whether a kept page is one of ``handles`` or below them: look up the handles in
        the lineage of the few kept pages (a chain's depth) instead of walking down the
        handles' subtrees."""
        return any(not self._lineage_of(kept).isdisjoint(handles) for kept in self._kept)

    def _lineage_of(self, kept: int) -> set[int]:
        lineage = self._lineage.get(kept)
        if lineage is None:
            lineage = self._lineage[kept] = self._ancestry(kept)
        return lineage

    def _ancestry(self, handle: int) -> set[int]:
        up = self.index.parent.item  # a Python int per step, not a numpy scalar
        lineage = set()
        while handle != ROOT:
            lineage.add(handle)
            handle = up(handle)
        return lineage

    def _free(self, tier: Tier, slot: int) -> None:
        self.slots[tier].free(slot)
        if self.slot_freed is not None:
            self.slot_freed(tier, slot)

    # -- state ---------------------------------------------------------------------------
    def occupancy(self) -> dict[str, dict[str, float]]:
        return {
            t.label: {
                "capacity": a.capacity,
                "used": a.used,
                "occupancy": a.occupancy,
                "fragmentation": a.fragmentation(),
            }
            for t, a in sorted(self.slots.items())
        }
