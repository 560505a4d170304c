"""The promotion head: will a page read from disk be read again before host's next victim is?

:meth:`~kvray.policy.reuse.ReusePolicy.promote_target` moves a page read from disk up to host
only where that pays, and the eviction model alone prices it by comparing the page's score
with host's next victim's. That model is fitted to a softmax over ``log1p(requests to next
use)``, so a pair's target shares out how much further off the victim's next use is, and a
victim never used again pulls the fitted difference towards promoting even where the page
is read after it more often than not (docs/sim-eval/README.md, "Promotion decisions in the
teacher's replays"). The head answers the question a promotion turns on instead: a small
ReLU MLP on the pair's two feature rows (the page as it would sit in host, the victim as it
was ranked) with a logistic output, fitted pointwise to the oracle's binary label (the page's
next use comes strictly before the victim's; neither used again: no), each pair weighted by
what the wrong choice costs per read (a disk read over a host read) times the queue behind it.
It promotes when ``p * saved > (1 - p) * lost`` (``saved``: a read of the page from host
instead of disk; ``lost``: the victim's reads from below instead of host).

It is trained in the same DAgger replays as the eviction model (``kvray train-reuse
--promotion-label pointwise``, :mod:`kvray.rl.imitation`), stored beside it in
:data:`HEAD_FILE`, and rides on the model as ``ReuseModel.promotion``: a model folder without
the file has none and promotes as before. Adam as the eviction model's (:func:`adam`).

Example::

    import numpy as np
    from kvray.policy.reuse_promotion import PromotionHead

    rng = np.random.default_rng(0)
    pairs = [rng.normal(size=(2, 5)).astype(np.float32) for _ in range(64)]
    labels = [np.array([a, b], dtype=np.float32) for a, b in rng.integers(0, 9, (64, 2))]
    head = PromotionHead.fit(pairs, labels, np.ones(64), seed=0, epochs=2)
    head.pays(pairs[0][0], pairs[0][1], saved=1.0, lost=1.0)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

HEAD_FILE = "promotion.safetensors"
PARAMETERS = ("mean", "scale", "w1", "b1", "w2", "b2")


def adam(
    owner: object, state: dict[str, tuple[np.ndarray, np.ndarray]], step: int, grads: dict[str, np.ndarray], lr: float
) -> None:
    """One Adam step (betas 0.9, 0.999) on ``owner``'s float32 parameters named in ``grads``, in place."""
    for name, grad in grads.items():
        m, v = state.get(name, (np.zeros_like(grad), np.zeros_like(grad)))
        m = 0.9 * m + 0.1 * grad
        v = 0.999 * v + 0.001 * grad * grad
        state[name] = (m, v)
        m_hat, v_hat = m / (1 - 0.9**step), v / (1 - 0.999**step)
        param = getattr(owner, name)
        param -= (lr * m_hat / (np.sqrt(v_hat) + 1e-8)).astype(np.float32)


def pointwise(labels: list[np.ndarray]) -> np.ndarray:
    """Each pair's label: 1 where the page read (first) is next used strictly before the victim
    (second). The pairs carry the eviction decisions' labels, ``log1p(requests to next use)``."""
    return np.asarray([float(y[0] < y[1]) for y in labels], dtype=np.float32)


class PromotionHead:
    """``probability(page_row, victim_row)``: standardise the two rows side by side, one hidden
    ReLU layer, a logistic output: the chance the page is read before the victim."""

    def __init__(self, mean: np.ndarray, scale: np.ndarray, w1: np.ndarray, b1: np.ndarray, w2: np.ndarray, b2: np.ndarray):
        self.mean, self.scale = mean.astype(np.float32), scale.astype(np.float32)
        self.w1, self.b1 = w1.astype(np.float32), b1.astype(np.float32)
        self.w2, self.b2 = w2.astype(np.float32), b2.astype(np.float32)

    def probability(self, page_row: np.ndarray, victim_row: np.ndarray) -> float:
        x = (np.concatenate([page_row.reshape(-1), victim_row.reshape(-1)]) - self.mean) / self.scale
        logit = float(np.maximum(x @ self.w1 + self.b1, 0.0) @ self.w2 + self.b2[0])
        return 1.0 / (1.0 + np.exp(-logit))

    def pays(self, page_row: np.ndarray, victim_row: np.ndarray, saved: float, lost: float) -> bool:
        """Promote where the expected read saved beats the expected read lost."""
        p = self.probability(page_row, victim_row)
        return p * saved > (1.0 - p) * lost

    @classmethod
    def fit(
        cls,
        pairs: list[np.ndarray],
        labels: list[np.ndarray],
        weights: np.ndarray,
        seed: int,
        hidden: int = 16,
        epochs: int = 8,
        batch: int = 64,
        lr: float = 3e-3,
    ) -> PromotionHead:
        """A head fitted from scratch to promotion decisions: each a (2, F) pair of rows (the
        page read, host's next victim) with their ``log1p(requests to next use)`` labels; weighted
        binary cross-entropy against :func:`pointwise`'s label, Adam over shuffled mini-batches."""
        rng = np.random.default_rng(seed)
        x = np.stack([p.reshape(-1) for p in pairs]).astype(np.float32)
        y = pointwise(labels)
        mean, scale = x.mean(axis=0), x.std(axis=0)
        scale[scale < 1e-6] = 1.0
        w1 = rng.normal(0.0, np.sqrt(2.0 / x.shape[1]), (x.shape[1], hidden))
        w2 = rng.normal(0.0, np.sqrt(1.0 / hidden), (hidden,))
        head = cls(mean, scale, w1, np.zeros(hidden), w2, np.zeros(1))
        x = ((x - head.mean) / head.scale).astype(np.float32)
        w = (weights / max(float(np.mean(weights)), 1e-12)).astype(np.float32)
        state: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        step = 0
        for _ in range(epochs):
            order = rng.permutation(len(x))
            for start in range(0, len(order), batch):
                take = order[start : start + batch]
                step += 1
                adam(head, state, step, head._gradients(x[take], y[take], w[take]), lr)
        return head

    def _gradients(self, x: np.ndarray, y: np.ndarray, w: np.ndarray) -> dict[str, np.ndarray]:
        """Of the weighted mean binary cross-entropy of a batch."""
        pre = x @ self.w1 + self.b1
        hidden = np.maximum(pre, 0.0)
        p = 1.0 / (1.0 + np.exp(-(hidden @ self.w2 + self.b2[0])))
        err = ((p - y) * w / len(w)).astype(np.float32)  # d loss / d logit
        back = err[:, None] * self.w2 * (pre > 0)
        return {
            "w2": hidden.T @ err,
            "b2": np.array([err.sum()], dtype=np.float32),
            "w1": x.T @ back,
            "b1": back.sum(axis=0),
        }

    def save(self, folder: Path) -> Path:
        from safetensors.numpy import save_file

        path = folder / HEAD_FILE
        save_file({name: getattr(self, name) for name in PARAMETERS}, str(path))
        return path

    @classmethod
    def load(cls, folder: Path) -> PromotionHead | None:
        """The head stored in ``folder``, None where it has none (a model trained without one)."""
        from safetensors import safe_open

        path = folder / HEAD_FILE
        if not path.exists():
            return None
        with safe_open(str(path), framework="numpy") as f:
            return cls(**{name: f.get_tensor(name) for name in PARAMETERS})
