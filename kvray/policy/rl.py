"""The learned placement policy: the adaptive :class:`~kvray.policy.experts.ExpertsPolicy`
whose selector ranks the experts by their smoothed shadow cost (follow the leader) plus a
small trained MLP's correction for each expert's row, bounded
(:func:`~kvray.policy.experts.corrected_scores`).

It is trained by PPO in the simulator (:mod:`kvray.rl.train`) and stored as
``policy.safetensors`` (the scorer's weights, no pickle) beside ``card.json`` (the
model card: observation space, training data, steps, seed, evaluation scores).
Inference is numpy: the rows of a decision (or of many decisions at once) go through the
MLP in one batch, and the best-scored expert is followed for the next window.

A file whose card names other features or other experts raises
:class:`~kvray.core.errors.PolicyError`: its scores would mean nothing on these rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kvray.core.errors import ConfigError, PolicyError
from kvray.core.tiers import Tier
from kvray.policy.experts import (
    EXPERTS,
    LEADER_PRIOR,
    LONG_HALF_LIFE,
    SELECTOR_FEATURES,
    WINDOW,
    ExpertsPolicy,
    corrected_scores,
)
from kvray.resources import shipped_or_given

DEFAULT_POLICY = "default"  # the policy shipped in policies/default (kvray.resources)
WEIGHTS_FILE = "policy.safetensors"
CARD_FILE = "card.json"


def observation_spec() -> dict:
    """What a policy file must have been trained on to be usable here."""
    return {
        "features": list(SELECTOR_FEATURES),
        "experts": list(EXPERTS),
        "window": WINDOW,
        "leader_prior": LEADER_PRIOR,
        "half_life_windows": LONG_HALF_LIFE,
        "cost": "modeled TTFT (ms) where known, else page prefills",
    }


class MLPScorer:
    """``score(rows)``: ReLU MLP over feature rows, numpy only.

    Example::

        scorer = MLPScorer([np.ones((4, 13)), np.ones((1, 4))], [np.zeros(4), np.zeros(1)])
        scorer.score(np.zeros((3, 10), dtype=np.float32))   # array of 3 scores
    """

    def __init__(self, weights: list[np.ndarray], biases: list[np.ndarray]) -> None:
        self.layers = [(w.T.astype(np.float32).copy(), b.astype(np.float32)) for w, b in zip(weights, biases)]

    chunk_rows: int = 512  # rows per pass: activations stay in cache, BLAS stays single-threaded

    def score(self, rows: np.ndarray) -> np.ndarray:
        if len(rows) > self.chunk_rows:
            return np.concatenate([self.score(rows[i : i + self.chunk_rows]) for i in range(0, len(rows), self.chunk_rows)])
        return self.forward(rows)[:, 0]

    def forward(self, rows: np.ndarray) -> np.ndarray:
        """Every output of the MLP for each row (``score`` is the first, in chunks)."""
        x = rows
        for i, (w, b) in enumerate(self.layers):
            x = x @ w + b
            if i < len(self.layers) - 1:
                np.maximum(x, 0.0, out=x)
        return x


def load_scorer(path: str | Path) -> tuple[MLPScorer, dict]:
    """Read a policy directory (or its ``policy.safetensors``); checks the card's spec."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        path = shipped_or_given(path, "policies")
    except ConfigError:
        raise PolicyError(f"{path}: not a policy: no such file or folder, nor a policy shipped by that name") from None
    folder = path if path.is_dir() else path.parent
    weights_path, card_path = folder / WEIGHTS_FILE, folder / CARD_FILE
    if not weights_path.is_file() or not card_path.is_file():
        raise PolicyError(f"{path}: not a policy: needs {WEIGHTS_FILE} and {CARD_FILE}")
    try:
        card = json.loads(card_path.read_text())
        tensors = load_file(str(weights_path))
    except (json.JSONDecodeError, SafetensorError, OSError) as exc:
        raise PolicyError(f"{path}: unreadable policy file ({exc})") from None
    spec = card.get("observation") if isinstance(card, dict) else None
    if spec != observation_spec():
        raise PolicyError(f"{card_path}: policy was trained on observation {spec}, this kvray builds {observation_spec()}")
    n = len(tensors) // 2
    try:
        weights = [tensors[f"layer{i}.weight"] for i in range(n)]
        biases = [tensors[f"layer{i}.bias"] for i in range(n)]
    except KeyError as exc:
        raise PolicyError(f"{weights_path}: missing tensor {exc}") from None
    if not weights or weights[0].shape[1] != len(SELECTOR_FEATURES) or weights[-1].shape[0] != 1:
        raise PolicyError(f"{weights_path}: scorer shape does not take {len(SELECTOR_FEATURES)} features to one score")
    return MLPScorer(weights, biases), card


class RLPolicy(ExpertsPolicy):
    """Follows, window by window, the expert heuristic a trained scorer picks.

    Example::

        policy = make_policy("rl")                     # the shipped policies/default
        policy = make_policy("rl:policies/mine")       # one trained by `kvray train`
    """

    name = "rl"

    def __init__(self, scorer: MLPScorer, card: dict | None = None) -> None:
        super().__init__(self.best)
        self.scorer = scorer
        self.card = card or {}

    def bind(self, index, capacities) -> None:
        super().bind(index, capacities)
        trained = {Tier[label.upper()]: cost for label, cost in self.card.get("tier_cost", {}).items()}
        self.tier_cost.update({t: c for t, c in trained.items() if t in self.tier_cost})

    @classmethod
    def load(cls, path: str | Path | None = None) -> RLPolicy:
        scorer, card = load_scorer(path or DEFAULT_POLICY)
        return cls(scorer, card)

    def best(self, rows: np.ndarray) -> int:
        """The expert rated highest by the leader ranking plus the trained correction, bounded."""
        return int(np.argmax(corrected_scores(rows, self.scorer.score(rows))))


def decision_time_us(scorer: MLPScorer, decisions: int = 4096, repeats: int = 20) -> float:
    """Median microseconds per decision when ``decisions`` decisions (one row per expert
    each) are scored in one batch."""
    import statistics
    import time

    rows = np.random.default_rng(0).random((decisions * len(EXPERTS), len(SELECTOR_FEATURES)), dtype=np.float32)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        scorer.score(rows).reshape(decisions, len(EXPERTS)).argmax(axis=1)
        times.append(time.perf_counter() - started)
    return statistics.median(times) / decisions * 1e6
