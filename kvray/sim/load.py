"""Offered load: a trace's arrival times scaled so that its prefill engines are busy a chosen
share of the time.

A trace's own arrival rate says little about a policy at the load a deployment runs at: a
quiet trace hides what a saved prefill is worth in queueing, a saturated one turns mean TTFT
into minutes of queue that one request more or less moves (docs/sim-eval). ``--load U``
(``kvray sim``, ``eval``, ``cluster-eval``) replays a trace whose gaps between arrivals are
multiplied by one factor, chosen so that under LRU (each node's policy; the default cluster
policy above them) the prefill engines are busy ``U`` of the time from the first arrival to
the last first token (the replay's ``prefill_utilisation``); in a cluster, the busiest
node's engines (a skewed front end can leave the others idle whatever the rate). Every
policy of a comparison then replays the same scaled trace.

The busy share falls as the gaps grow (more idle time between requests) and tends to 1 as
they shrink to nothing (every request queued at once), so the factor is found by a few LRU
replays: a proportional step until the target is bracketed, then the factor's logarithm
interpolated on the share inside the bracket (kept off its ends, so it also halves it when
the share bends) until the share is within ``tolerance`` of the target.

Example::
    from kvray.scenario import DEFAULT_SCENARIO, load_scenario
    from kvray.sim.node import node_capacities
    from kvray.sim.load import find_load
    from kvray.sim.workloads import WorkloadSpec, generate

    scenario = load_scenario(DEFAULT_SCENARIO)
    trace = generate(WorkloadSpec(sessions=30), seed=1)
    load = find_load(trace, scenario, 0.6, node_capacities(scenario, trace, 0.05))
    assert abs(load.utilisation - 0.6) <= 0.01
    load.trace[-1].timestamp_ms / trace[-1].timestamp_ms   # about load.factor
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from kvray.core.errors import ConfigError
from kvray.core.tiers import Tier
from kvray.scenario import Scenario
from kvray.traces import TraceRequest

TOLERANCE = 0.01  # the busy share reached, within this of the target
MAX_REPLAYS = 24
MAX_STEP = 16.0  # the proportional step changes the factor at most this much, either way


@dataclass(frozen=True)
class Load:
    """A trace scaled to a load: ``factor`` multiplies its gaps between arrivals, under
    which LRU keeps the prefill engines busy ``utilisation`` of the time (``target``
    asked), found in ``replays`` LRU replays."""

    target: float
    factor: float
    utilisation: float
    replays: int
    trace: list[TraceRequest]

    def as_dict(self) -> dict:
        """What a report records of it (``load`` in ``--json`` output and eval rows)."""
        return {
            "target": self.target,
            "arrival_scale": self.factor,
            "lru_prefill_utilisation": self.utilisation,
            "lru_replays": self.replays,
        }


def describe(load: Mapping[str, float]) -> str:
    """One line for stderr from :meth:`Load.as_dict`: the factor found and the busy share reached."""
    return (
        f"load {load['target']:g}: arrival gaps x{load['arrival_scale']:.4g}; under LRU the prefill engines are "
        f"busy {load['lru_prefill_utilisation']:.3f} of the time ({load['lru_replays']} LRU replays)"
    )


def scaled(trace: Sequence[TraceRequest], factor: float) -> list[TraceRequest]:
    """``trace`` with every gap between arrivals ``factor`` times as long (the first
    request arrives when it did)."""
    if not trace:
        return []
    first = trace[0].timestamp_ms
    return [replace(r, timestamp_ms=first + (r.timestamp_ms - first) * factor) for r in trace]


def lru_utilisation(
    trace: Sequence[TraceRequest], scenario: Scenario, capacities: Sequence[Mapping[Tier, int]], warmup_requests: int = 0
) -> float:
    """The busiest node's prefill engines' busy share when ``trace`` is replayed under LRU
    on every node."""
    from kvray.sim.cluster import ClusterSimulator

    result = ClusterSimulator(scenario, "lru", None, capacities).replay(trace, warmup_requests)
    return max(result.extra["prefill_utilisation"].values())


def find_load(
    trace: Sequence[TraceRequest],
    scenario: Scenario,
    target: float,
    capacities: Sequence[Mapping[Tier, int]],
    warmup_requests: int = 0,
    tolerance: float = TOLERANCE,
    utilisation: Callable[[Sequence[TraceRequest]], float] | None = None,
) -> Load:
    """The factor on ``trace``'s gaps under which LRU keeps the engines busy ``target``
    (in (0, 1)) of the time, within ``tolerance``; ``capacities`` per node, as the replays
    to compare will use. ``utilisation`` replaces the LRU replay (a trace -> busy share).

    Raises ConfigError when ``target`` is outside (0, 1), the trace spans no time (nothing
    to scale) or no factor reaches it in :data:`MAX_REPLAYS` replays."""
    if not 0 < target < 1:
        raise ConfigError(f"load must be a busy share in (0, 1), got {target:g}")
    if len(trace) < 2 or trace[-1].timestamp_ms <= trace[0].timestamp_ms:
        raise ConfigError("a load scales the gaps between arrivals: the trace needs requests at two different times")
    measure = utilisation or (lambda t: lru_utilisation(t, scenario, capacities, warmup_requests))
    busier: tuple[float, float] | None = None  # (factor, share) above the target
    idler: tuple[float, float] | None = None  # (factor, share) below it
    best: tuple[float, float, list[TraceRequest]] | None = None
    factor = 1.0
    for replays in range(1, MAX_REPLAYS + 1):
        candidate = scaled(trace, factor)
        share = measure(candidate)
        if best is None or abs(share - target) < abs(best[1] - target):
            best = (factor, share, candidate)
        if abs(share - target) <= tolerance:
            return Load(target, factor, share, replays, candidate)
        if share > target:
            busier = (factor, share)
        else:
            idler = (factor, share)
        if busier and idler:
            factor = _between(busier, idler, target)
        else:  # not bracketed yet: gaps scaled as if the busy share fell in proportion to them
            step = share / target if share > 0 else MAX_STEP
            factor *= min(MAX_STEP, max(1 / MAX_STEP, step))
    assert best is not None
    raise ConfigError(
        f"load {target:g} not reached in {MAX_REPLAYS} LRU replays: the closest was {best[1]:.3f} at arrival gaps x{best[0]:.4g}"
    )


def _between(busier: tuple[float, float], idler: tuple[float, float], target: float) -> float:
    """The next factor inside the bracket: log-factor interpolated at ``target`` between the
    (factor, share) pairs on either side, kept in the bracket's middle 80%."""
    (fb, sb), (fi, si) = busier, idler
    lo, hi = math.log(fb), math.log(fi)
    at = (sb - target) / (sb - si)  # 0 at the busier end, 1 at the idler one
    return math.exp(lo + min(0.9, max(0.1, at)) * (hi - lo))
