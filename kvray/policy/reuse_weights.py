"""What a teacher's training decision weighs: the miss it risks, and the requests that miss delays.

The reuse model's fit (:mod:`kvray.policy.reuse_model`) weighs each recorded decision of a
teacher replay (:class:`~kvray.policy.reuse.ReusePolicy` with ``teacher=True``) by what a
wrong choice costs in TTFT there: the load of a page from where it was sent (recompute at
most; :func:`link_charged_miss`, stretched by the queue on its link in a cluster) times the
requests queued behind the one that pays it (:func:`queue_weight`).

Example::

    from kvray.policy.reuse_weights import link_charged_miss, queue_weight

    assert link_charged_miss(0.2) == 0.2 and queue_weight(30.0, 10.0) == 4.0
"""

from __future__ import annotations

QUEUE_WEIGHT_CAP = 16.0  # a training decision weighs at most this many times its miss cost
MIN_MISS = 0.05  # a decision's miss weighs at least this (a page sent to a fast tier still costs a load)


def link_charged_miss(tier_cost: float, utilisation: float = 0.0) -> float:
    """What a miss of a page sent to a tier costs, relative to recomputing it: its load time
    there (``tier_cost``) stretched by the queue on the link it would be reloaded over (a link
    busy ``utilisation`` of the time serves a new load about 1 / (1 - utilisation) as slowly,
    at most :data:`QUEUE_WEIGHT_CAP` times), at most a recompute (1) and at least :data:`MIN_MISS`.
    With an idle link it is the tier's own cost (the single-node teacher's weight)."""
    stretch = 1.0 / max(1.0 - utilisation, 1.0 / QUEUE_WEIGHT_CAP)
    return max(min(tier_cost * stretch, 1.0), MIN_MISS)


def queue_weight(backlog_ms: float, request_ms: float) -> float:
    """How many requests a miss delays: the request itself and, under load, those whose work is
    queued ahead of it, each paying again for a slower service (capped at :data:`QUEUE_WEIGHT_CAP`);
    1 where nothing is queued or time is not modeled."""
    if request_ms <= 0 or backlog_ms <= 0:
        return 1.0
    return min(1.0 + backlog_ms / request_ms, QUEUE_WEIGHT_CAP)
