"""Placement policies and their registry.

``make_policy("lru")`` builds a policy by name; :data:`POLICIES` lists what is registered
(``lru``, ``lfu``, ``arc``, ``wfq``, ``threshold``, ``lecar``, ``s3fifo``, ``sieve``, ``selective-write``,
``experts`` (follows whichever of
lru, arc and threshold does best on shadow caches of the same workload), ``belady`` (evaluation only: the
simulator feeds it the future), ``rl`` (the shipped trained selector), ``lru-session-end``
(LRU told its clients' end-of-session hints: a session's own pages are not stored by its
last request, and go first, unwritten, :mod:`kvray.policy.session_end`; ``reuse-session-end``
the per-page learned policy told them), ``lru-load-cost`` (LRU writing no page to a disk that
would load it slower than recomputing it, as ``reuse`` does: a reference,
:mod:`kvray.policy.reuse_admission`); ``rl:PATH`` loads a
trained policy file; ``reuse`` (the per-page learned policy: LRU's, a decayed-frequency heap's and a never-read
FIFO's oldest pages re-ranked by a reuse model imitating Belady, :mod:`kvray.policy.reuse`), ``reuse:PATH`` a trained reuse model, ``reuse-cluster:PATH`` one trained on cluster replays (``kvray train-reuse --cluster``, promotion as its card says); ``package.module:Class`` an importable policy class).
Unknown names raise :class:`kvray.core.errors.PolicyError` listing the known ones.
"""

from __future__ import annotations

from collections.abc import Callable

from kvray.core.errors import PolicyError
from kvray.core.placement import LRUPolicy, PageContext, PlacementPolicy
from kvray.policy.arc import ARCPolicy
from kvray.policy.belady import BeladyPolicy
from kvray.policy.experts import ExpertsPolicy
from kvray.policy.lecar import LeCaRPolicy
from kvray.policy.lfu import LFUPolicy
from kvray.policy.promote import promoting
from kvray.policy.reuse_admission import LoadCostLRU
from kvray.policy.s3fifo import S3FIFOPolicy
from kvray.policy.selective import SelectiveWritePolicy
from kvray.policy.session_end import SessionEndLRU, ending_sessions
from kvray.policy.sieve import SievePolicy
from kvray.policy.threshold import ThresholdPolicy
from kvray.policy.wfq import WFQPolicy


def _reuse(
    path: str | None = None,
    refit: bool = False,
    disk_gate: bool = False,
    promote: str = "model",
    hand_over: bool = False,
    session_ends: bool = False,
) -> PlacementPolicy:
    from kvray.policy.reuse import ReusePolicy  # loads weights; kept out of plain imports

    policy = ending_sessions(ReusePolicy) if session_ends else ReusePolicy
    return policy.load(path or None, refit=refit, disk_gate=disk_gate, promote=promote, hand_over=hand_over)


def _reuse_cluster(path: str) -> PlacementPolicy:
    from kvray.policy.reuse import ReusePolicy  # loads weights; kept out of plain imports

    return ReusePolicy.load_cluster(path)


def _rl(path: str | None = None) -> PlacementPolicy:
    from kvray.policy.rl import RLPolicy  # loads weights; kept out of plain imports

    return RLPolicy.load(path)


POLICIES: dict[str, Callable[[], PlacementPolicy]] = {
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "arc": ARCPolicy,
    "wfq": WFQPolicy,
    "threshold": ThresholdPolicy,
    "belady": BeladyPolicy,
    "lecar": LeCaRPolicy,
    "s3fifo": S3FIFOPolicy,
    "sieve": SievePolicy,
    "selective-write": SelectiveWritePolicy,
    "experts": ExpertsPolicy,
    "rl": _rl,
    "reuse": _reuse,
    "reuse-online": lambda: _reuse(refit=True),
    "reuse-admit": lambda: _reuse(disk_gate=True),  # and NVMe writes gated by predicted reuse (reuse_admission)
    # references: a heuristic with reuse's promotion of disk reads to host (kvray.policy.promote)
    "lru-promote": promoting(LRUPolicy),
    "s3fifo-promote": promoting(S3FIFOPolicy),
    # and `reuse` promoting every disk read, not only those its model says pay (kvray.policy.reuse.PROMOTION)
    "reuse-promote-every": lambda: _reuse(promote="every"),
    # and a heuristic the tripwire starts to follow handed the cache in recency order (ReusePolicy._hand_over)
    "reuse-handover": lambda: _reuse(hand_over=True),
    # LRU told the clients' end-of-session hints (kvray.policy.session_end)
    "lru-session-end": SessionEndLRU,
    # ... and the per-page learned policy told them (its ranking for every page no hint names)
    "reuse-session-end": lambda: _reuse(session_ends=True),
    # a reference: LRU that, as reuse does, writes no page to a disk slower than recomputing it
    "lru-load-cost": LoadCostLRU,
}


def register(name: str, factory: Callable[[], PlacementPolicy]) -> None:
    POLICIES[name] = factory


def make_policy(name: str) -> PlacementPolicy:
    """A policy by registered name; ``rl:PATH`` loads a trained policy from ``PATH``
    (``reuse:PATH`` a reuse model, ``reuse-session-end:PATH`` one told the end-of-session hints,
    ``reuse-cluster:PATH`` one trained on cluster replays);
    ``package.module:Class`` builds an importable one (:mod:`kvray.policy.plugin`)."""
    from kvray.policy.plugin import is_import_path, policy_class

    if name.startswith("rl:"):
        return _rl(name[3:])
    if name.startswith("reuse:"):
        return _reuse(name[6:])
    if name.startswith("reuse-session-end:"):
        return _reuse(name[18:], session_ends=True)
    if name.startswith("reuse-cluster:"):
        return _reuse_cluster(name[14:])
    if is_import_path(name):
        return policy_class(name, PlacementPolicy)()
    if name not in POLICIES:
        raise PolicyError(f"unknown policy {name!r}; known: {', '.join(sorted(POLICIES))}")
    return POLICIES[name]()


__all__ = [
    "ARCPolicy",
    "BeladyPolicy",
    "ExpertsPolicy",
    "LFUPolicy",
    "LRUPolicy",
    "LeCaRPolicy",
    "POLICIES",
    "PageContext",
    "PlacementPolicy",
    "S3FIFOPolicy",
    "SelectiveWritePolicy",
    "SessionEndLRU",
    "SievePolicy",
    "ThresholdPolicy",
    "WFQPolicy",
    "make_policy",
    "register",
]
