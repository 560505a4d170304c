"""The reuse model: a page's feature row -> eviction score (higher: its next use is further off).

A tiny ReLU MLP in numpy (inputs standardised by the training rows' mean and spread), small
enough that scoring a batch of candidates costs about a microsecond per page, and fitted by
the same code offline (imitation of the oracle, :mod:`kvray.rl.imitation`) and online
(:meth:`ReuseModel.refit` on delayed labels, :mod:`kvray.policy.reuse_online`). A decision
is a group of candidates; the fit is a softmax cross-entropy over each group against the
oracle's distribution, ``softmax(log1p(requests to next use) / LABEL_TEMPERATURE)`` (a page
never used again counts as :data:`NEVER_REQUESTS`), so the model learns to rank within a
decision, where pointwise regression of the next use fitted the tiers' differences instead
(measured: its picks trailed LRU's first candidate). Adam over shuffled mini-batches;
everything random is drawn from the seed, so a fit is reproducible bit for bit on one machine.

Weights are stored as safetensors (no pickle) beside the feature names they were fitted on.

Example::

    import numpy as np
    from kvray.policy.page_features import FEATURES, SOURCES
    from kvray.policy.reuse_model import ReuseModel, log_next_use

    rng = np.random.default_rng(0)
    groups = rng.normal(size=(32, 8, len(FEATURES))).astype(np.float32)   # 32 decisions of 8 candidates
    labels = log_next_use(rng.integers(1, 100, (32, 8)))
    model = ReuseModel.fit(groups, labels, np.ones((32, 8), dtype=bool), np.ones(32), seed=0, epochs=1)
    model.predict(groups[0])      # 8 eviction scores
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from kvray.core.errors import PolicyError
from kvray.policy.page_features import FEATURES, SOURCES, PageFeatures
from kvray.policy.reuse_promotion import PromotionHead, adam

try:  # the forward pass in C (kvray/policy/_pool.c); without it ReuseModel.predict
    from kvray.policy import _pool
except ImportError:  # pragma: no cover - a checkout whose extensions were not built
    _pool = None

NEVER_REQUESTS = 1e5  # the label of a page never used again (log1p: ~11.5)
WEIGHTS_FILE = "reuse.safetensors"
LRU_POOL = (64, 0, 0)  # a model saved without a pool was fitted on LRU's 64 oldest pages
LABEL_TEMPERATURE = 1.0  # the oracle's target over candidates: softmax(log next use / this)
MAX_HIDDEN = 256  # hidden units the C scoring takes (MAX_WIDTH in _pool_forward.h): an ensemble's members' summed


def log_next_use(distance: np.ndarray) -> np.ndarray:
    """Training label of pages next used ``distance`` requests ahead (``inf``: never)."""
    return np.log1p(np.minimum(np.asarray(distance, dtype=np.float64), NEVER_REQUESTS)).astype(np.float32)


def batch_groups(rows: list[np.ndarray], labels: list[np.ndarray], width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Decisions of up to ``width`` candidates as padded arrays: rows (G, width, F), labels
    (G, width) and the mask of real candidates (G, width)."""
    groups = len(rows)
    features = rows[0].shape[1] if groups else len(FEATURES)
    x = np.zeros((groups, width, features), dtype=np.float32)
    y = np.zeros((groups, width), dtype=np.float32)
    mask = np.zeros((groups, width), dtype=bool)
    for g, (r, label) in enumerate(zip(rows, labels)):
        x[g, : len(r)], y[g, : len(r)], mask[g, : len(r)] = r, label, True
    return x, y, mask


class ReuseModel:
    """``predict(rows)``: standardise, one hidden ReLU layer, a linear output: the eviction
    score (higher leaves first), fitted so that a softmax over one decision's candidates
    puts its weight where the oracle's does."""

    pool: tuple[int, int, int] = LRU_POOL  # the candidates it ranks: how many from each ordering (reuse.POOL)
    promotion: PromotionHead | None = None  # decides promotion where trained with one (reuse_promotion)

    def __init__(self, mean: np.ndarray, scale: np.ndarray, w1: np.ndarray, b1: np.ndarray, w2: np.ndarray, b2: np.ndarray):
        self.mean, self.scale = mean.astype(np.float32), scale.astype(np.float32)
        self.w1, self.b1 = w1.astype(np.float32), b1.astype(np.float32)
        self.w2, self.b2 = w2.astype(np.float32), b2.astype(np.float32)
        self._adam: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._steps = 0

    @classmethod
    def initial(cls, rows: np.ndarray, hidden: int, rng: np.random.Generator) -> ReuseModel:
        """An untrained model whose standardisation is taken from ``rows`` (n, F)."""
        mean = rows.mean(axis=0)
        scale = rows.std(axis=0)
        scale[scale < 1e-6] = 1.0
        features = rows.shape[1]
        w1 = rng.normal(0.0, np.sqrt(2.0 / features), (features, hidden))
        w2 = rng.normal(0.0, np.sqrt(1.0 / hidden), (hidden,))
        return cls(mean, scale, w1, np.zeros(hidden), w2, np.zeros(1))

    def predict(self, rows: np.ndarray) -> np.ndarray:
        hidden = np.maximum((rows - self.mean) / self.scale @ self.w1 + self.b1, 0.0)
        return hidden @ self.w2 + self.b2[0]

    def score(self, rows: np.ndarray) -> np.ndarray:
        """:meth:`predict` in C where built (``kvray.policy._pool.forward``, half its time on a
        pool of ~100 rows), else predict itself. The C sums run in a fixed order where predict's
        product with ``w2`` is a BLAS gemv's, so a score may differ from predict's in its last
        bits (tests/policy/test_reuse_pool.py bounds it and checks replays' decisions equal)."""
        if _pool is None:
            return self.predict(rows)
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        return np.frombuffer(_pool.forward(rows, self.mean, self.scale, self.w1, self.b1, self.w2, self.b2), dtype=np.float32)

    @classmethod
    def fit(
        cls,
        groups: np.ndarray,
        labels: np.ndarray,
        mask: np.ndarray,
        weights: np.ndarray,
        seed: int,
        hidden: int = 16,
        epochs: int = 8,
        batch: int = 64,
        lr: float = 3e-3,
    ) -> ReuseModel:
        """A model fitted from scratch to decisions ``groups`` (G, K, F) whose candidates'
        true ``labels`` (G, K) are log requests to next use, ``mask`` marking real candidates."""
        rng = np.random.default_rng(seed)
        model = cls.initial(groups[mask], hidden, rng)
        model.train(groups, labels, mask, weights, rng, epochs, batch, lr)
        return model

    def refit(self, groups, labels, mask, weights, seed: int, lr: float = 1e-3) -> None:
        """One pass of Adam over new decisions (delayed labels): the model follows the workload it serves."""
        if len(groups):
            self.train(groups, labels, mask, weights, np.random.default_rng(seed), 1, 32, lr)

    def train(self, groups, labels, mask, weights, rng: np.random.Generator, epochs: int, batch: int, lr: float) -> None:
        x_all = ((groups - self.mean) / self.scale).astype(np.float32)
        target = np.where(mask, labels / LABEL_TEMPERATURE, -np.inf)
        target = np.exp(target - target.max(axis=1, keepdims=True))
        target = (target / target.sum(axis=1, keepdims=True)).astype(np.float32)
        w_all = (weights / max(float(weights.mean()), 1e-12)).astype(np.float32)
        for _ in range(epochs):
            order = rng.permutation(len(groups))
            for start in range(0, len(order), batch):
                take = order[start : start + batch]
                self._step(x_all[take], target[take], mask[take], w_all[take], lr)

    def _step(self, x: np.ndarray, target: np.ndarray, mask: np.ndarray, w: np.ndarray, lr: float) -> None:
        """Softmax cross-entropy over each decision's candidates against the oracle's distribution."""
        pre = x @ self.w1 + self.b1  # (B, K, H)
        hidden = np.maximum(pre, 0.0)
        score = np.where(mask, hidden @ self.w2 + self.b2[0], -np.inf)
        p = np.exp(score - score.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        err = (p - target) * w[:, None] / len(w)  # (B, K): d loss / d score
        grads = {"w2": np.einsum("bkh,bk->h", hidden, err), "b2": np.zeros(1, dtype=np.float32)}
        back = err[:, :, None] * self.w2 * (pre > 0)
        grads["w1"] = np.einsum("bkf,bkh->fh", x, back)
        grads["b1"] = back.sum(axis=(0, 1))
        self._steps += 1
        adam(self, self._adam, self._steps, grads, lr)

    @classmethod
    def mean_of(cls, members: list[ReuseModel]) -> ReuseModel:
        """One model whose score is the mean of the ``members``' scores: their hidden layers
        side by side. Each member's standardisation is folded into its first layer relative to
        the first member's, which the result keeps, so the scoring code (numpy's or C's) runs
        an ensemble unchanged, at the members' hidden units summed. Seeds of one recipe rank the
        held-out cells' candidates differently enough to move median G by 0.08; three seeds'
        mean by 0.02 (docs/sim-eval/README.md, "Nine seeds, two recipe changes, and an ensemble of seeds")."""
        if not members:
            raise PolicyError("an ensemble needs at least one reuse model")
        first = members[0]
        for m in members:
            if m.pool != first.pool or m.w1.shape[0] != first.w1.shape[0]:
                raise PolicyError(f"reuse models ranking other pools or features: {m.pool} against {first.pool}")
            if m.promotion is not None:
                raise PolicyError(
                    "an ensemble of reuse models with promotion heads is not built (their heads would need one too)"
                )
        hidden = sum(m.w1.shape[1] for m in members)
        if hidden > MAX_HIDDEN:
            raise PolicyError(
                f"an ensemble of {len(members)} reuse models has {hidden} hidden units; the scoring takes at most {MAX_HIDDEN}"
            )
        mean0, scale0 = first.mean.astype(np.float64), first.scale.astype(np.float64)
        w1s, b1s = [], []
        for m in members:  # ((x - m0)/s0 * s0 + m0 - mj)/sj @ W1j = (x - m0)/s0 @ (W1j * s0/sj) + (m0 - mj)/sj @ W1j
            w1, scale = m.w1.astype(np.float64), m.scale.astype(np.float64)
            w1s.append(w1 * (scale0 / scale)[:, None])
            b1s.append(m.b1.astype(np.float64) + ((mean0 - m.mean.astype(np.float64)) / scale) @ w1)
        w2 = np.concatenate([m.w2.astype(np.float64) for m in members]) / len(members)
        b2 = np.array([np.mean([float(m.b2[0]) for m in members])])
        model = cls(first.mean, first.scale, np.concatenate(w1s, axis=1), np.concatenate(b1s), w2, b2)
        model.pool = first.pool
        return model

    def save(self, folder: Path) -> Path:
        from safetensors.numpy import save_file

        folder.mkdir(parents=True, exist_ok=True)
        path = folder / WEIGHTS_FILE
        tensors = {name: getattr(self, name) for name in ("mean", "scale", "w1", "b1", "w2", "b2")}
        if self.pool != LRU_POOL:  # a tensor, not metadata: safetensors writes metadata keys in no fixed order
            tensors["pool"] = np.asarray(self.pool, dtype=np.int64)
        save_file(tensors, str(path), metadata={"features": ",".join(self.features())})
        if self.promotion is not None:  # a file of its own: a model without one is written as before
            self.promotion.save(folder)
        return path

    def features(self) -> tuple[str, ...]:
        """Its input columns: the page features, and which orderings offered the candidate
        when it ranks a pool drawn from more than LRU."""
        return FEATURES + SOURCES if self.pool[1:] != (0, 0) else FEATURES

    @classmethod
    def load(cls, folder: Path) -> ReuseModel:
        """A model from ``folder`` (or its weights file); one fitted on other features is refused."""
        from safetensors import safe_open

        path = folder / WEIGHTS_FILE if folder.is_dir() else folder
        if not path.exists():
            raise PolicyError(f"{path}: no reuse model here (expected {WEIGHTS_FILE}; `kvray train-reuse` writes one)")
        with safe_open(str(path), framework="numpy") as f:
            names = (f.metadata() or {}).get("features", "")
            tensors = {name: f.get_tensor(name) for name in ("mean", "scale", "w1", "b1", "w2", "b2")}
            pool = f.get_tensor("pool").tolist() if "pool" in f.keys() else LRU_POOL
        model = cls(**tensors)
        model.pool = tuple(int(n) for n in pool)
        model.promotion = PromotionHead.load(path.parent)
        if names != ",".join(model.features()):
            expected = ",".join(model.features())
            raise PolicyError(f"{path}: fitted on features {names!r}, this kvray computes {expected!r}")
        return model


def decision_time_us(model: ReuseModel, pages: int = 4096, repeats: int = 200) -> float:
    """Microseconds per candidate page of one scored decision (features read + model), the
    batch being the model's whole candidate pool, in a cache of ``pages``: what the ~1 us per
    page above is measured by."""
    features = PageFeatures(pages)
    rng = np.random.default_rng(0)
    handles = np.arange(pages)
    features.insert(handles, rng.integers(0, 64, pages), 64, handles)
    for _ in range(64):
        features.tick()
        features.access(rng.choice(pages, 32, replace=False))
    width = sum(model.pool)
    batch = rng.choice(pages, width, replace=False)
    leaf = np.ones(width, dtype=bool)
    source = rng.integers(0, 2, (width, len(SOURCES))).astype(np.float32) if model.pool[1:] != (0, 0) else None
    started = time.perf_counter()
    for _ in range(repeats):
        rows = features.matrix(batch, leaf, 1)
        model.predict(rows if source is None else np.hstack([rows, source]))
    return (time.perf_counter() - started) / repeats / width * 1e6
