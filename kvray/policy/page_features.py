"""Per-page access-history features, kept in O(1) per access, read as one matrix per decision.

A learned eviction decides per page (LRB, HALP, Parrot), so it needs what predicts a page's
next use from its own history: how long ago it was stored and last read, the last gaps
between its reads, how often it was read lately at several time scales, where it sits in its
chain (depth, share of its request, leaf or not), how hot its chain's root is, and whether
the same page was evicted a short while ago (a ghost). Keeping these by recomputation would
cost O(history); here every column is a numpy array indexed by the page's handle in the
:class:`~kvray.core.index.PrefixIndex`, updated in a few vectorised steps per request, and
the decayed counters are stored with the time they were last brought up to date, so that
decay costs nothing until a counter is read or bumped.

Time is counted in requests (:meth:`PageFeatures.tick` once per request) and in the
request's arrival time (ms), where the caller knows it.

Example::

    import numpy as np
    from kvray.policy.page_features import PageFeatures

    features = PageFeatures()
    features.tick(arrival_ms=0.0)
    features.insert(np.array([0, 1]), depth=np.array([0, 1]), request_pages=2, root=np.array([0, 0]))
    features.tick(arrival_ms=50.0)
    features.access(np.array([0]))
    features.matrix(np.array([0, 1]), leaf=np.array([False, True]), tier=1).shape   # (2, len(FEATURES))
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

try:  # the feature rows in C (kvray/policy/_pool.c); without it PageFeatures.matrix_python
    from kvray.policy import _pool
except ImportError:  # pragma: no cover - a checkout whose extensions were not built
    _pool = None

HALF_LIVES = (16.0, 256.0, 4096.0)  # decayed read counters, in requests
NEVER = 1e6  # a gap or ghost age that did not happen, in requests (log1p: ~13.8)
FEATURES = (
    "log_age_requests",
    "log_since_last_requests",
    "log_gap1_requests",
    "log_gap2_requests",
    "log_since_last_s",
    *(f"log_count_hl{int(h)}" for h in HALF_LIVES),
    "log_hits",
    "log_depth",
    "depth_share_of_request",
    "leaf",
    "log_root_count_hl256",
    "log_ghost_age_requests",
    "log_request_pages",
    "tier",
    "candidate_position",
)
SOURCES = ("from_lru_tail", "from_least_frequent", "from_never_read")  # which orderings offered a candidate
ROOT_HALF_LIFE = 1  # index into HALF_LIVES of the root's counter feature


class PageFeatures:
    """Feature columns of the pages of one cache, indexed by handle (handles are reused
    once freed: :meth:`insert` resets every column of the handle it is given)."""

    def __init__(self, capacity: int = 1024, ghost_capacity: int = 4096) -> None:
        self.now = 0.0  # requests seen
        self.now_ms = 0.0
        self._decay = np.log(2.0) / np.asarray(HALF_LIVES)
        self._ghosts: OrderedDict[int, float] = OrderedDict()  # page key -> request count when it left
        self.ghost_capacity = ghost_capacity
        self._alloc(capacity)

    def _alloc(self, n: int) -> None:
        self.inserted = np.zeros(n)
        self.last = np.zeros(n)
        self.last_ms = np.zeros(n)
        self.gap1 = np.full(n, NEVER)
        self.gap2 = np.full(n, NEVER)
        self.counts = np.zeros((n, len(HALF_LIVES)))
        self.hits = np.zeros(n)
        self.depth = np.zeros(n)
        self.request_pages = np.ones(n)
        self.root = np.zeros(n, dtype=np.int64)
        self.ghost_age = np.full(n, NEVER)

    def _grow(self, needed: int) -> None:
        old = {name: getattr(self, name) for name in self._columns()}
        n = len(self.inserted)
        self._alloc(max(needed + 1, 2 * n))
        for name, col in old.items():
            getattr(self, name)[:n] = col

    @staticmethod
    def _columns() -> tuple[str, ...]:
        return ("inserted", "last", "last_ms", "gap1", "gap2", "counts", "hits", "depth", "request_pages", "root", "ghost_age")

    def tick(self, arrival_ms: float = 0.0) -> None:
        """A request arrives: the clock moves on by one request (and to its arrival time)."""
        self.now += 1.0
        self.now_ms = max(self.now_ms, float(arrival_ms))

    def insert(
        self, handles: np.ndarray | int, depth: np.ndarray | int, request_pages: int, root: np.ndarray | int, keys=None
    ) -> None:
        """New pages (their handles may have held other pages before): fresh history; a
        page whose key left recently (``keys``) records how long ago (its ghost's age).
        One page may come as plain ints (a store inserts one page at a time: scalar writes
        cost a fifth of one-element arrays')."""
        one = isinstance(handles, int)
        top = handles if one else (int(handles.max()) if len(handles) else -1)
        if top >= len(self.inserted):
            self._grow(top)
        self.inserted[handles] = self.now
        self.last[handles] = self.now
        self.last_ms[handles] = self.now_ms
        self.gap1[handles] = NEVER
        self.gap2[handles] = NEVER
        self.counts[handles] = 0.0
        self.hits[handles] = 0.0
        self.depth[handles] = depth
        self.request_pages[handles] = max(request_pages, 1)
        self.root[handles] = root
        self.ghost_age[handles] = NEVER
        if keys is not None:
            for handle, key in zip([handles] if one else handles.tolist(), keys):
                left = self._ghosts.pop(key, None)
                if left is not None:
                    self.ghost_age[handle] = self.now - left

    def access(self, handles: np.ndarray) -> None:
        """Pages read by the current request: gaps shift, counters decay to now and count one."""
        gap = self.now - self.last[handles]
        self.gap2[handles] = self.gap1[handles]
        self.gap1[handles] = gap
        self.counts[handles] = self.counts[handles] * np.exp(-np.outer(gap, self._decay)) + 1.0
        self.last[handles] = self.now
        self.last_ms[handles] = self.now_ms
        self.hits[handles] += 1.0

    def left(self, key: int) -> None:
        """A page left the cache: its key is a ghost for a while (the oldest ghosts go first)."""
        self._ghosts[key] = self.now
        self._ghosts.move_to_end(key)
        if len(self._ghosts) > self.ghost_capacity:
            self._ghosts.popitem(last=False)

    def returned(self, key: int) -> None:
        """A page that seemed to leave came back at once (it moved between tiers): no ghost."""
        self._ghosts.pop(key, None)

    def decayed_counts(self, handles: np.ndarray) -> np.ndarray:
        """Each page's counters decayed to now, shape (n, len(HALF_LIVES))."""
        since = self.now - self.last[handles]
        return self.counts[handles] * np.exp(-np.outer(since, self._decay))

    def matrix(self, handles: np.ndarray, leaf: np.ndarray, tier: int) -> np.ndarray:
        """The feature rows (:data:`FEATURES`) of ``handles`` in ``tier``, float32; the
        handles come in a heuristic's eviction order (its first would leave first), and the
        last column is each one's position in it (0 first, 1 last), so that a model can
        start from the heuristic's choice and depart from it where the history says.
        In C where built (``kvray.policy._pool.rows``, one pass instead of ~30 numpy calls
        on a few dozen pages), else :meth:`matrix_python`, the reference it transcribes."""
        if _pool is None:
            return self.matrix_python(handles, leaf, tier)
        handles = np.ascontiguousarray(handles, dtype=np.int64)
        rows = _pool.rows(handles, np.ascontiguousarray(leaf, dtype=bool), int(tier), *self.row_inputs())
        return np.frombuffer(rows, dtype=np.float32).reshape(len(handles), len(FEATURES))

    def row_inputs(self) -> tuple:
        """What the rows in C read after the pages (``kvray.policy._pool.rows`` and ``scored``):
        the clocks, the counters' decay rates, the root's counter and every column."""
        columns = (self.inserted, self.last, self.last_ms, self.gap1, self.gap2, self.counts, self.hits, self.depth)
        return (self.now, self.now_ms, self._decay, ROOT_HALF_LIFE, *columns, self.request_pages, self.root, self.ghost_age)

    def matrix_python(self, handles: np.ndarray, leaf: np.ndarray, tier: int) -> np.ndarray:
        """:meth:`matrix` in numpy."""
        now = self.now
        since = now - self.last[handles]
        counts = self.decayed_counts(handles)
        root = self.root[handles]
        root_count = self.counts[root, ROOT_HALF_LIFE] * np.exp(-(now - self.last[root]) * self._decay[ROOT_HALF_LIFE])
        depth = self.depth[handles]
        out = np.empty((len(handles), len(FEATURES)), dtype=np.float32)
        out[:, 0] = np.log1p(now - self.inserted[handles])
        out[:, 1] = np.log1p(since)
        out[:, 2] = np.log1p(self.gap1[handles])
        out[:, 3] = np.log1p(self.gap2[handles])
        out[:, 4] = np.log1p(np.maximum(self.now_ms - self.last_ms[handles], 0.0) / 1e3)
        out[:, 5:8] = np.log1p(counts)
        out[:, 8] = np.log1p(self.hits[handles])
        out[:, 9] = np.log1p(depth)
        out[:, 10] = depth / self.request_pages[handles]
        out[:, 11] = leaf
        out[:, 12] = np.log1p(root_count)
        out[:, 13] = np.log1p(self.ghost_age[handles])
        out[:, 14] = np.log1p(self.request_pages[handles])
        out[:, 15] = tier
        out[:, 16] = np.arange(len(handles)) / max(len(handles) - 1, 1)
        return out
