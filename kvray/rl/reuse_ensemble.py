"""``kvray train-reuse --ensemble K``: K reuse models of one recipe, seeds ``K x seed`` to
``K x seed + K - 1``, served as one model scoring their mean (:meth:`ReuseModel.mean_of`).

Why: one recipe's seeds differ by up to 0.08 in median G over the held-out cells at
``--load 0.6`` (nine seeds: 0.22 to 0.30), because each ranks some cells' near-tied candidates
its own way; more training rows or another DAgger round did not narrow it, and three seeds'
mean did (0.26 to 0.28 over six ensembles). Its price: K times the hidden units in every
scoring (docs/sim-eval/README.md, "Nine seeds, two recipe changes, and an ensemble of seeds"). Each member is trained and kept under
``OUT/members/seed-S`` (its own card: rebuildable alone); ``OUT`` holds the merged weights
and a card naming the members.

Example::

    import tempfile
    from pathlib import Path
    from kvray.rl.reuse_ensemble import train_reuse_ensemble
    from kvray.sim.workloads import WorkloadSpec, generate

    sources = {"tiny": generate(WorkloadSpec(sessions=10), seed=1)}
    card = train_reuse_ensemble(Path(tempfile.mkdtemp()), sources, members=2, seed=0, rounds=0,
                                record=1.0, capacities=(0.05,), epochs=1)
    card["ensemble"]["seeds"]   # [0, 1]
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvray.core.errors import ConfigError
from kvray.policy.reuse_model import MAX_HIDDEN, ReuseModel
from kvray.rl.imitation import CARD_FILE, train_reuse
from kvray.rl.teacher_recipe import TeacherRecipe
from kvray.traces import TraceRequest

MEMBERS_DIR = "members"
MAX_MEMBERS = MAX_HIDDEN // 16  # members of the recipe's width (16 hidden units) that the scoring takes
PER_MEMBER = ("seed", "decisions", "rounds", "wall_s")  # a member's own training figures; the rest is the recipe's


def member_seeds(members: int, seed: int) -> list[int]:
    """The seeds of ensemble ``seed``'s members: ensembles of K members and other seeds share
    no member, so that they are independent fits of one recipe."""
    return [members * seed + j for j in range(members)]


def train_reuse_ensemble(out: Path, sources: dict[str, list[TraceRequest]], members: int, seed: int = 0, **settings: Any) -> dict:
    """Train ``members`` models by :func:`~kvray.rl.imitation.train_reuse` with ``settings``
    (its keyword arguments), one seed each, and write their mean into ``out`` with a card.
    What the mean cannot hold is refused before any member trains."""
    if not 2 <= members <= MAX_MEMBERS:
        raise ConfigError(f"--ensemble: an ensemble has 2 to {MAX_MEMBERS} members, got {members}")
    if settings.get("recipe", TeacherRecipe()).promotion_label == "pointwise":
        raise ConfigError("--ensemble: members with promotion heads (--promotion-label pointwise) cannot be averaged")
    seeds = member_seeds(members, seed)
    folders = [out / MEMBERS_DIR / f"seed-{s}" for s in seeds]
    cards = [train_reuse(folder, sources, seed=s, **settings) for folder, s in zip(folders, seeds)]
    model = ReuseModel.mean_of([ReuseModel.load(folder) for folder in folders])
    model.save(out)
    training = {k: v for k, v in cards[0]["training"].items() if k not in PER_MEMBER}
    training["decisions"] = sum(c["training"]["decisions"] for c in cards)
    training["wall_s"] = round(sum(c["training"]["wall_s"] for c in cards), 1)
    training["members"] = [
        {"folder": str(folder.relative_to(out)), **{k: c["training"][k] for k in PER_MEMBER}} for folder, c in zip(folders, cards)
    ]
    card = {
        **cards[0],
        "training": training,
        "ensemble": {
            "seed": seed,
            "seeds": seeds,
            "hidden": int(model.w1.shape[1]),
            "rule": "the mean of the members' scores, as one model with their hidden layers side by side",
        },
    }
    (out / CARD_FILE).write_text(json.dumps(card, indent=2) + "\n")
    return card
