"""The learned per-page policy: cheap orderings' tail candidates, re-ranked by a reuse model (HALP-style).

Each tier offers the pages at the tail of three cheap orderings: LRU (a cheap heuristic that
already puts the likely victims at its tail), the lowest decayed read frequency (LFU-like)
and the oldest pages never read since stored (S3-FIFO's one-hit pages). They are kept as
numpy columns by handle (the page's tier, a recency stamp, a frequency key), written in O(1)
per event and read with one partial sort per ordering when the pool is scored (a scoring
serves several evictions, so this costs less than keeping a heap and three linked orders
per event: docs/sim-eval, "Replay speed"). The LRU tail alone misses the victims LFU,
ARC or S3-FIFO would pick where those rules are far ahead of LRU; the pool
(:data:`POOL`: how many unpinned pages each ordering offers, deduplicated, with the
orderings that offered each as features) brings them in. To evict, the pool's pages are scored by
the reuse model (:mod:`kvray.policy.reuse_model`) on their access-history features
(:mod:`kvray.policy.page_features`), and the one predicted to be used furthest ahead leaves,
as Belady's would among them; the next :data:`TAKE` - 1 best-ranked go on the following
victim calls while nothing has been read since (a store evicts in bursts), so one scoring
pays for several evictions. A page read from disk moves up to host only where the same
scores say it pays (:meth:`ReusePolicy.promote_target`). Without a model the policy is LRU
with every disk read promoted.

The model is trained by imitating the oracle in the simulator (:mod:`kvray.rl.imitation`):
the same class runs as the *teacher's student* there (``teacher=True``: told the future like
Belady, it records every scored candidate with its true next use, and, with
``record_promotions``, each promotion it prices: the page read beside host's next victim;
it acts by the model, or by the oracle when it has no model yet: DAgger's rounds).

Example::

    from kvray.core.manager import CacheManager
    from kvray.core.tiers import Tier
    from kvray.policy.reuse import ReusePolicy

    policy = ReusePolicy.load()                # policies/reuse, the shipped model
    manager = CacheManager({Tier.HOST: 64, Tier.DISK: 1024}, policy)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from kvray.core.errors import PolicyError
from kvray.core.index import ROOT, PrefixIndex
from kvray.core.placement import LRUPolicy, PageContext, PlacementPolicy, RequestInfo
from kvray.core.tiers import Tier
from kvray.policy.page_features import FEATURES, SOURCES, PageFeatures
from kvray.policy.promote import promote_target, promoting
from kvray.policy.reuse_admission import DiskGate, disk_closed
from kvray.policy.reuse_model import ReuseModel, batch_groups, log_next_use
from kvray.policy.reuse_online import SAMPLE, DelayedLabels, RecencyLRU, ShadowTripwire
from kvray.policy.reuse_pool import gather, gather_python
from kvray.policy.reuse_pricing import PromotionPricing
from kvray.policy.reuse_weights import link_charged_miss, queue_weight
from kvray.policy.s3fifo import S3FIFOPolicy
from kvray.resources import shipped_or_given

try:  # the pool's gathering in C (kvray/policy/_pool.c); without it ReusePolicy.gather_python
    from kvray.policy import _pool
except ImportError:  # pragma: no cover - a checkout whose extensions were not built
    _pool = None

TRIPWIRE = 0.05  # follow a heuristic once its shadow costs 5% less than the model's (docs/sim-eval: worst held-out cell 1.18x, at 0.02 1.20x)
# the shadows and advisors: LRU and S3-FIFO with the promotion of disk reads, as the real cache
# runs them when it follows one (with plain LRU and S3-FIFO beside them, the cache followed plain
# LRU and stranded read pages on disk: agent-long@25% at --load 0.6 1.20x; docs/sim-eval,
# "Promotion decided per page")
TRIPWIRE_HEURISTICS: dict[str, Callable[[], PlacementPolicy]] = {
    "lru-promote": promoting(LRUPolicy),
    "s3fifo-promote": promoting(S3FIFOPolicy),
}
REFIT_BATCH = 64  # decisions per online refit step
POOL = (64, 32, 32)  # candidates per ordering: LRU's oldest, lowest decayed frequency, oldest never read (the shipped model's)
POOL_HALF_LIFE = 256.0  # requests: the frequency ordering's decayed counter (the insert counts one)
TAKE = 8  # evictions served from one scoring while no page is read in between
DEFAULT_MODEL = "reuse"  # policies/reuse
# which pages read from disk move up to host: those the model says pay (`reuse`), every one
# (`reuse-promote-every`, the rule before: the reference that tells what the per-page decision
# is worth; docs/sim-eval, "Promotion decided per page"), or none
PROMOTION = ("model", "every", "none")


class ReusePolicy(PromotionPricing, PlacementPolicy):
    """Evict, among each tier's least recently used unpinned pages, the one the model
    predicts is used furthest ahead; demote one tier down, except into a disk that would load
    the page slower than the engine recomputes it (``load_cost_admission``: dropped)."""

    name = "reuse"
    take = TAKE

    def __init__(
        self,
        model: ReuseModel | None = None,
        *,
        teacher: bool = False,
        record: float = 0.0,
        seed: int = 0,
        refit: bool = False,
        tripwire: float | None = None,
        pool: tuple[int, int, int] | None = None,
        shadow_sample: int = SAMPLE,
        depth_scale: int = 1,
        disk_gate: bool = False,
        promote: str = "model",
        promote_gate: float | None = None,
        link_charged: bool = False,
        next_use: Callable[[list[int], float], np.ndarray] | None = None,
        record_promotions: bool = False,
        pointwise_promotions: bool = False,
        queue_weighted: bool = True,
        libm_counts: bool = False,
        hand_over: bool = False,
        load_cost_admission: bool = True,
    ):
        self.pool = pool or (model.pool if model is not None else POOL)
        if model is not None and model.pool != self.pool:
            raise PolicyError(f"a reuse model fitted on the candidate pool {model.pool} cannot rank the pool {self.pool}")
        self.candidates = sum(self.pool)
        self.model = model
        self.refit = refit and model is not None  # online refit on delayed labels (reuse_online)
        self.tripwire_margin = tripwire  # follow a heuristic while the cache's cost runs this share above its shadow's
        self.hand_over = hand_over  # a heuristic the tripwire starts to follow gets the cache in recency order (_hand_over)
        self.refits = 0
        self._tripwire: ShadowTripwire | None = None  # made by bind, with a tripwire margin
        self.scored = 0  # candidates of the last scoring
        self.shadow_sample = shadow_sample  # the tripwire's shadows see one page in this many
        self.depth_scale = depth_scale  # pages per page seen: a sampled shadow's depths and request lengths scaled back
        self.teacher = teacher
        self.disk_gate = disk_gate and model is not None  # write to disk only what predicted reuse pays for (reuse_admission)
        self.needs_disk_util = self.disk_gate or tripwire is not None  # the gate's write cost; the tripwire's shadows' writes
        if promote not in PROMOTION:
            raise PolicyError(f"promote={promote!r}: expected one of {', '.join(PROMOTION)}")
        self.promote = promote  # which disk reads move up to host (PROMOTION)
        self.promote_gate = promote_gate  # ... only while the tier's load path is busy less than this share
        self.link_charged = link_charged and teacher  # a decision weighs its miss over the link it would be reloaded by
        # write to disk only while a page loads from it faster than the engine recomputes it
        # (reuse_admission.disk_pays); a teacher's replays demote as they were recorded
        self.load_cost_admission = load_cost_admission and not teacher
        self._closed_requests = 0  # requests whose demotions into disk were dropped (stats)
        self.needs_link_util = self.link_charged or promote_gate is not None or self.load_cost_admission
        self.next_use = next_use  # teacher: the trace's next use of keys after a request index (a cluster node's own is stale)
        self.needs_future = teacher  # the simulator tells a teacher the future, as it tells Belady
        self.queue_weighted = queue_weighted and teacher  # a decision weighs the requests queued behind its miss
        self.libm_counts = libm_counts and teacher  # the pool's counts as 5288765 kept them (_touch)
        self.record = record  # share of decisions whose candidates are kept as training rows
        # teacher: also keep the promotion decisions ({the page read, host's next victim}), the
        # same share of them (the eviction model prices a promotion on a page outside its pools)
        self.record_promotions = record_promotions and teacher
        self.promotions_recorded = 0
        # ... into the promotion head's rows (pairs, labels, weights; reuse_promotion), not the eviction model's
        self.head_rows: tuple[list, list, list] | None = ([], [], []) if pointwise_promotions and teacher else None
        self._head = model.promotion if model is not None else None  # decides promotion where the model has one
        self._rng = np.random.default_rng(seed)
        self.rows: list[np.ndarray] = []
        self.labels: list[np.ndarray] = []
        self.weights: list[float] = []

    @classmethod
    def load(
        cls,
        path: str | Path | None = None,
        refit: bool = False,
        tripwire: float | None = TRIPWIRE,
        disk_gate: bool = False,
        promote: str = "model",
        hand_over: bool = False,
    ) -> ReusePolicy:
        """The model in ``path`` (a folder or weights file), else the shipped one."""
        model = ReuseModel.load(shipped_or_given(path or DEFAULT_MODEL, "policies"))
        return cls(model, refit=refit, tripwire=tripwire, disk_gate=disk_gate, promote=promote, hand_over=hand_over)

    @classmethod
    def load_cluster(cls, path: str | Path) -> ReusePolicy:
        """A model trained on cluster replays (``kvray train-reuse --cluster``), promoting as
        it was rolled out in training (its card's ``node_policy``), with the tripwire."""
        import json

        folder = Path(path)
        card_path = folder / "card.json"
        if not card_path.exists():
            raise PolicyError(f"{folder}: no card.json here (`kvray train-reuse --cluster` writes one)")
        card = json.loads(card_path.read_text())
        if card.get("policy") != "reuse-cluster":
            raise PolicyError(f"{folder}: a {card.get('policy')!r} model, not one trained on cluster replays")
        gate = card["node_policy"]["promote_gate"]
        return cls(ReuseModel.load(folder), tripwire=TRIPWIRE, promote="none" if gate is None else "every", promote_gate=gate)

    def bind(self, index: PrefixIndex, capacities: Mapping[Tier, int]) -> None:
        super().bind(index, capacities)
        # the orderings, as columns by handle, read with one partial sort per scoring
        self._where = np.full(1024, -1, dtype=np.int8)  # the page's tier, -1: not cached
        self._recency = np.zeros(1024, dtype=np.int64)  # LRU: larger is more recent
        self._clock = 0
        self._count = np.zeros(1024)  # decayed read count as of _counted (the insert counts one)
        self._counted = np.zeros(1024)
        self._frequency = np.zeros(1024)  # log(count) + decay * _counted: orders pages as their counts decayed to any later time
        self._bits = np.zeros(1024, dtype=np.int8)  # scratch: which orderings offered a page to the pool
        self._first_at = np.zeros(1024, dtype=np.int64)  # scratch: where a page was first offered
        self._pool_decay = math.log(2.0) / POOL_HALF_LIFE
        self._key_of: dict[int, int] = {}
        self._leaving: tuple[int, int] | None = None  # the page on_remove was last told of (a move re-inserts it)
        self._pending: dict[Tier, list[int]] = {}
        self._pending_score: dict[Tier, Sequence[float]] = {}  # the scores of the last ranking's first TAKE, in order
        self._pending_rows: dict[Tier, np.ndarray] = {}  # teacher: their feature rows, in order (promotion decisions)
        self._held = [0] * (max(Tier) + 1)  # pages per tier: a promotion into a tier with a free slot displaces none
        self.features = PageFeatures(ghost_capacity=max(sum(capacities.values()), 1))
        self._request_pages = 1
        self._tier_cost: Mapping[Tier, float] = {}
        self._load_util: Mapping[Tier, float] = {}
        self._disk_closed = False  # this request's demotions into disk are dropped (load_cost_admission)
        self._label_now = 0.0  # teacher only: the trace's request index, the clock of the oracle's next uses
        self._queue_weight = 1.0  # teacher only: what a miss costs beyond its own request (queue_weight)
        self._next = np.full(1024, np.inf)  # teacher only: each page's next use (request index)
        self._upcoming = np.empty(0)
        self._labels = DelayedLabels() if self.refit else None
        self._ready_rows: list[np.ndarray] = []
        self._ready_labels: list[np.ndarray] = []
        self._tripwire = None
        self._advisors: list[PlacementPolicy] = []
        self._handed: PlacementPolicy | None = None  # the advisor the cache was last handed over to
        self._gate = None
        self._gate_rows: dict[int, np.ndarray] = {}  # feature rows of the next pages to leave for disk
        if self.disk_gate and capacities.get(Tier.DISK, 0) > 0:
            self._gate = DiskGate(self.model.mean, self.model.scale, capacities[Tier.DISK])
        if self.tripwire_margin is not None:
            # the model alone, in a shadow: it evicts and promotes by the model, as the real cache does
            # the disk rule is the real cache's whichever rule it follows, and the heuristics'
            # shadows write every page: the shadows compare rankings, all writing alike
            learned = ReusePolicy(
                self.model, pool=self.pool, depth_scale=self.shadow_sample, promote=self.promote, load_cost_admission=False
            )
            self._tripwire = ShadowTripwire(
                learned, TRIPWIRE_HEURISTICS, capacities, self.tripwire_margin, sample=self.shadow_sample
            )
            self._tripwire.bind(index, capacities)
            # an advisor that evicts as LRU does (lru-promote) reads this policy's own recency
            # column: nothing to tell it of each event
            wire = self._tripwire
            wire.advisors = [
                RecencyLRU(self, advisor)
                if isinstance(advisor, LRUPolicy) and type(advisor).victim is LRUPolicy.victim
                else advisor
                for advisor in wire.advisors
            ]
            self._advisors = [advisor for advisor in wire.advisors if not isinstance(advisor, RecencyLRU)]

    @property
    def compiled_chain(self) -> bool:  # type: ignore[override]
        """The disk gate's demotion keeps state (its rows, its budget): asked in the Python order only."""
        return self._gate is None

    @property
    def native_hooks(self) -> bool:  # type: ignore[override]
        """The compiled chain writer keeps this policy's per-page columns itself (kvray/sim/_chain_reuse.h,
        a transcription of on_insert, on_remove, on_admitted, admit, demote_target and the pending
        ranking's victims): not for a teacher, an online refit or a disk gate, whose hooks keep more."""
        return type(self) is ReusePolicy and not self.teacher and self._labels is None and self._gate is None

    # -- what the policy is told ---------------------------------------------------------
    def on_request(self, info: RequestInfo) -> None:
        self.features.tick(info.arrival_ms)
        self._request_pages = max(len(info.keys) * self.depth_scale, 1)
        self._tier_cost = info.tier_cost or {}
        self._load_util = info.load_util or {}
        if self.load_cost_admission:  # as LoadCostAdmission; the compiled hooks read _disk_closed
            self._disk_closed = disk_closed(info)
            self._closed_requests += self._disk_closed
        if self.queue_weighted:
            self._queue_weight = queue_weight(info.backlog_ms, info.page_prefill_ms * self._request_pages)
        self._pending.clear()
        self._leaving = None
        if self._tripwire is not None:
            self._tripwire.request(info)
        if self._gate is not None:
            self._gate_rows.clear()
            self._gate.request(self.features.now, self._tier_cost.get(Tier.DISK, 0.0), info.disk_write_util)
        for advisor in self._advisors:
            advisor.on_request(info)
        if self._labels is not None:
            self._refit()
        if self.teacher:
            if info.future is None:
                raise PolicyError("a teacher reuse policy needs the future of the trace: it runs only in the simulator")
            self._upcoming = np.asarray(info.future, dtype=np.float64)
            self._label_now = float(info.index) if info.index >= 0 else self.features.now - 1.0
            for key, nxt in zip(info.keys, self._upcoming.tolist()):
                handle = self.index.handle_of(key)
                if handle is not None:
                    self._next[handle] = nxt

    def _grow(self, handle: int) -> None:
        n = max(handle + 1, 2 * len(self._where))
        columns = ("_where", "_recency", "_count", "_counted", "_frequency", "_bits", "_first_at")
        for name, fill in zip(columns, (-1, 0, 0.0, 0.0, 0.0, 0, 0)):
            old = getattr(self, name)
            new = np.full(n, fill, dtype=old.dtype)
            new[: len(old)] = old
            setattr(self, name, new)

    def on_insert(self, handle: int, tier: Tier) -> None:
        for advisor in self._advisors:
            advisor.on_insert(handle, tier)
        if handle >= len(self._where):
            self._grow(handle)
        self._where[handle] = tier
        self._held[tier] += 1
        self._clock += 1
        self._recency[handle] = self._clock  # a page moved between tiers is the newest of its new tier
        key = self.index.key_of(handle)
        if self._leaving == (handle, key):  # moved between tiers: the same page, its history stays
            self.features.returned(key)
            if self.libm_counts:
                self._touch(handle, 0.0)
        else:
            now = self.features.now
            self._count[handle] = 1.0
            self._counted[handle] = now
            self._frequency[handle] = self._pool_decay * now
            self._key_of[handle] = key
            if self._gate is not None:
                self._gate.used([key], self.features.now)  # recomputed after it was dropped: reused
            if self._labels is not None:
                self._labels.used([key], self.features.now)  # stored again after it left: used
            parent = int(self.index.parent[handle])
            root = handle if parent == ROOT else int(self.features.root[parent])
            self.features.insert(handle, self.index.depth.item(handle) * self.depth_scale, self._request_pages, root, [key])
            if self.teacher:
                if handle >= len(self._next):
                    self._next = np.concatenate([self._next, np.full(len(self._next) + handle, np.inf)])
                depth = int(self.index.depth[handle])
                self._next[handle] = self._upcoming[depth] if depth < len(self._upcoming) else np.inf
        self._leaving = None

    def on_admitted(self, handle: int, ctx: PageContext) -> None:
        self.features.request_pages[handle] = max(ctx.request_pages * self.depth_scale, 1)
        for advisor in self._advisors:
            advisor.on_admitted(handle, ctx)

    def on_access(self, handles: np.ndarray) -> None:
        n = len(handles)
        self._recency[handles[::-1]] = np.arange(self._clock + 1, self._clock + n + 1)  # the first read is the newest
        self._clock += n
        now = self.features.now
        if self.libm_counts:
            for h in handles.tolist():
                self._touch(h, 1.0)
        else:
            count = self._count[handles] * np.exp(-self._pool_decay * (now - self._counted[handles])) + 1.0
            self._count[handles], self._counted[handles] = count, now
            self._frequency[handles] = np.log(count) + self._pool_decay * now
        self.features.access(handles)
        for advisor in self._advisors:
            advisor.on_access(handles)
        if self._gate is not None:
            key_of = self._key_of
            self._gate.used([key_of[h] for h in handles.tolist()], self.features.now)
        if self._labels is not None:
            key_of = self._key_of
            self._labels.used([key_of[h] for h in handles.tolist()], self.features.now)
        self._pending.clear()
        self._leaving = None

    def _touch(self, handle: int, reads: float) -> None:
        """``handle``'s count decayed to now plus ``reads`` in libm's exp and log, as 5288765's teacher
        kept it (``libm_counts``): numpy's vector exp differs in the last bit, reordering near ties."""
        now = self.features.now
        count = self._count.item(handle) * math.exp(-self._pool_decay * (now - self._counted.item(handle))) + reads
        self._count[handle], self._counted[handle] = count, now
        self._frequency[handle] = math.log(max(count, 1e-30)) + self._pool_decay * now

    def on_remove(self, handle: int, tier: Tier) -> None:
        for advisor in self._advisors:
            advisor.on_remove(handle, tier)
        self._where[handle] = -1
        self._held[tier] -= 1
        key = self._key_of[handle]
        self.features.left(key)
        self._leaving = (handle, key)

    # -- the decision --------------------------------------------------------------------
    def victim(self, tier: Tier) -> int | None:
        followed = self._tripwire.follow() if self._tripwire is not None else None
        if followed is not None:  # the tripwire: a heuristic's shadow is ahead of the model
            self._pending.clear()
            if self.hand_over and followed is not self._handed:
                self._hand_over(followed)
            return followed.victim(tier)
        self._handed = None
        pins = self.index.pins
        pending = self._pending.get(tier)
        while pending:
            handle = pending.pop()
            if self._where.item(handle) == tier and pins.item(handle) == 0:
                return handle
        ranked = self._pool_ranked(tier, 1)
        if len(ranked) <= 1:
            return ranked[0] if ranked else None
        self._pending[tier] = ranked[1 : self.take][::-1]  # popped from the end
        return ranked[0]

    def _hand_over(self, advisor: PlacementPolicy) -> None:
        """The cache handed to an advisor the tripwire starts to follow: each tier's pages in
        this policy's recency order, oldest first, and which were read since stored (what an
        S3-FIFO rebuilds its queues from: :meth:`~kvray.policy.s3fifo.S3FIFOPolicy.hand_over`;
        an LRU advisor reads the recency column itself)."""
        self._handed = advisor
        hand = getattr(advisor, "hand_over", None)
        if hand is None:
            return
        for tier in self.tiers:
            pages = np.flatnonzero(self._where == tier)
            pages = pages[np.argsort(self._recency[pages], kind="stable")]
            hand(tier, pages, self.features.hits[pages] > 0)

    def _pool_ranked(self, tier: Tier, least: int) -> list[int]:
        """``tier``'s pool, ranked (:meth:`_rank`) when it holds more than ``least`` pages. Where
        nothing keeps the rows (no teacher, refit, disk gate or promotion head) in one C call where built
        (``kvray.policy._pool.ranked_pool``: :meth:`_candidates`, ``ReuseModel.score`` and :meth:`_ranking`)."""
        model = self.model
        keeps_rows = self.teacher or self._labels is not None or self._gate is not None or self._head is not None
        if _pool is not None and model is not None and not keeps_rows:
            columns = (self._where, self.index.pins, self._recency, self._frequency, self.index.first_child, self.index.depth)
            weights = (model.mean, model.scale, model.w1, model.b1, model.w2, model.b2)
            ranked, scores = _pool.ranked_pool(int(tier), *self.pool, *columns, self.take, *weights, *self.features.row_inputs())
            if len(ranked) > least:
                self.scored, self._pending_score[tier] = len(ranked), scores
            return ranked
        candidates, rows = self._candidates(tier)
        return candidates.tolist() if len(candidates) <= least else self._rank(candidates, tier, rows)

    def oldest(self, tier: Tier) -> int | None:
        """The least recently used unpinned page of ``tier`` (LRU's victim: stamps are unique)."""
        if _pool is not None:
            columns = (self._where, self.index.pins, self._recency, self._frequency, self.features.hits)
            handles, _ = _pool.pool(int(tier), 1, 0, 0, *columns)
            return int(np.frombuffer(handles, dtype=np.int64)[0]) if handles else None
        pins = self.index.pins
        n = min(len(self._where), len(pins))
        pages = np.flatnonzero((self._where[:n] == tier) & (pins[:n] == 0))
        return int(pages[np.argmin(self._recency[pages])]) if len(pages) else None

    def _candidates(self, tier: Tier) -> tuple[np.ndarray, np.ndarray | None]:
        """The pool of ``tier`` and, where a ranking reads them, its rows (:meth:`_rank`'s): in
        one C call where built (``kvray.policy._pool.scored``, :meth:`_gather` and
        ``PageFeatures.matrix`` of the same pages), else through those two."""
        ranked = self.model is not None or self.teacher or self._labels is not None
        if _pool is not None and ranked:
            columns = (self._where, self.index.pins, self._recency, self._frequency, self.index.first_child)
            handles, rows = _pool.scored(int(tier), *self.pool, *columns, *self.features.row_inputs())
            width = len(FEATURES) + (len(SOURCES) if self.pool[1:] != (0, 0) else 0)
            return np.frombuffer(handles, dtype=np.int64), np.frombuffer(rows, dtype=np.float32).reshape(-1, width)
        candidates, source = self._gather(tier)
        if not ranked:
            return candidates, None
        rows = self.features.matrix(candidates, ~self.index.has_children(candidates), int(tier))
        return candidates, np.hstack([rows, source]) if len(source) else rows

    _gather = gather  # the pool in C where built, else gather_python (kvray/policy/reuse_pool.py)
    gather_python = gather_python  # the numpy reference of _gather (kvray/policy/reuse_pool.py)

    def _rank(self, handles: np.ndarray, tier: Tier, rows: np.ndarray | None) -> list[int]:
        """``handles`` in eviction order: furthest predicted next use first (``rows``: their
        features and the orderings that offered each, :meth:`_candidates`; None: LRU order)."""
        recording = self.teacher and self.record > 0 and self._rng.random() < self.record
        if rows is None:
            return handles.tolist()  # LRU order
        self.scored = len(handles)
        if recording:
            self._keep_rows(handles, rows, tier)
        if self._labels is not None:
            key_of = self._key_of
            self._labels.decided(rows, [key_of[h] for h in handles.tolist()], self.features.now)
        if self.model is not None:
            # in C (score) but for a teacher: the shipped model's rebuild replays predict (docs/sim-eval)
            score = (self.model.predict if self.teacher else self.model.score)(rows)
        else:  # a teacher without a model acts as the oracle among the candidates
            score = log_next_use(self._next_uses(handles) - self._label_now)
        ranked, order = self._ranking(handles, score)
        self._pending_score[tier] = score[order[: self.take]]
        if self.record_promotions or self._head is not None:
            self._pending_rows[tier] = rows[order[: self.take]]
        if self._gate is not None and self._below[tier] == Tier.DISK:
            self._gate_rows = dict(zip(handles[order[: self.take]].tolist(), rows[order[: self.take]]))
        return ranked

    def _ranking(self, handles: np.ndarray, score: np.ndarray) -> tuple[list[int], np.ndarray]:
        """``handles`` by score, highest first, then the deeper first (a leaf before its parent),
        and their positions in that order: in C where built (``kvray.policy._pool.ranking``),
        else ``np.lexsort``, the reference it transcribes."""
        if _pool is None or score.dtype != np.float32:
            order = np.lexsort((-self.index.depth[handles], -score))
            return handles[order].tolist(), order
        ranked, order = _pool.ranking(np.ascontiguousarray(score), handles, self.index.depth)
        return ranked, np.frombuffer(order, dtype=np.int64)

    def promote_target(self, handle: int, tier: Tier) -> Tier | None:
        """Whether a page read from disk moves up to host memory (:mod:`kvray.policy.promote`):
        without promotion a hot page, once demoted, stays on disk as long as it is read, each
        read a disk load held on the prefill engine; promoting every disk read displaces host
        pages worth more where pages are read from disk once. So only where the model says it
        pays (``promote="model"``, :meth:`_promotion_pays`), or every disk read (``"every"``;
        docs/sim-eval, "Promotion decided per page"). While the tripwire follows a heuristic,
        the heuristic decides. Without a model (and not a teacher) every disk read moves up,
        as ``lru-promote``. With a ``promote_gate``, none while the tier's load path is busy that
        share of the time or more (a cluster node's: the promotion queues on the links its loads need)."""
        up = promote_target(tier)
        if up is None or self.promote == "none":
            return None
        if self.promote_gate is not None and self._load_util.get(tier, 0.0) >= self.promote_gate:
            return None  # in a cluster the promotion would queue on the links the node's loads need
        followed = self._tripwire.follow() if self._tripwire is not None else None
        if followed is not None:
            return followed.promote_target(handle, tier)
        if self.promote == "every" or (self.model is None and not self.teacher):
            return up
        return up if self._promotion_pays(handle, tier, up) else None

    def demote_target(self, handle: int, tier: Tier) -> Tier | None:
        """One tier down; into disk, only while a disk hit would beat recomputing
        (``load_cost_admission``) and when the gate says the write pays (with a gate)."""
        below = self._below[tier]
        if below == Tier.DISK and self._disk_closed:
            return None
        if self._gate is None or below != Tier.DISK:
            return below
        row = self._gate_rows.pop(handle, None)
        if row is None:  # not from a scoring (a followed heuristic's victim): its row now
            row = self.features.matrix(np.array([handle]), ~self.index.has_children([handle]), int(tier))[0]
            if len(self.model.mean) > len(row):
                row = np.concatenate([row, np.zeros(len(self.model.mean) - len(row), dtype=np.float32)])
        return below if self._gate.admit(self._key_of[handle], row, self.features.now) else None

    def _refit(self) -> None:
        """Fit the model to the decisions whose labels are complete, a batch at a time."""
        rows, labels = self._labels.expire(self.features.now)
        self._ready_rows += rows
        self._ready_labels += labels
        if len(self._ready_rows) >= REFIT_BATCH:
            groups, targets, mask = batch_groups(self._ready_rows, self._ready_labels, self.candidates)
            self.model.refit(groups, targets, mask, np.ones(len(groups)), seed=self.refits)
            self.refits += 1
            self._ready_rows, self._ready_labels = [], []

    def stats(self) -> dict[str, int]:
        return {
            "refits": self.refits,
            "tripwire_trips": self._tripwire.trips if self._tripwire is not None else 0,
            "disk_closed_requests": self._closed_requests,  # requests whose demotions into disk were dropped
        }

    def _next_uses(self, handles: np.ndarray) -> np.ndarray:
        """Teacher: the request index at which each page is next used. A node hears only of the
        requests it serves or holds pages of, so in a cluster the next use it was told of may
        have passed on another node: there ``next_use`` reads the trace instead."""
        if self.next_use is None:
            return self._next[handles]
        key_of = self._key_of
        return self.next_use([key_of[h] for h in handles.tolist()], self._label_now)

    def _keep_rows(self, handles: np.ndarray, rows: np.ndarray, tier: Tier) -> None:
        """Training rows of one decision: each candidate's true requests to next use,
        weighted by what a miss costs from where the page would go (recompute when dropped),
        link-charged (:func:`link_charged_miss`) when the policy was built so."""
        below = self._below[tier]
        miss = self._tier_cost.get(below, 1.0) if below in self.capacities and self.capacities[below] > 0 else 1.0
        busy = self._load_util.get(below, 0.0) if self.link_charged and below is not None else 0.0
        self.rows.append(rows)
        self.labels.append(log_next_use(self._next_uses(handles) - self._label_now))
        self.weights.append(link_charged_miss(miss, busy) * self._queue_weight)
