"""The reuse policy's own hooks in the compiled chain writer (kvray/sim/_chain_reuse.h, with
S3-FIFO's, kvray/sim/_chain_s3fifo.h) against its Python hooks, which stay the reference: after every store of random chains (caches from a
few pages to more than the policy's first columns hold, so that they grow mid-store; with the
tripwire's advisors, following a heuristic or not) the policy's whole state is the same, and a
replay of the conversation trace with the shipped model makes the same decisions and leaves
the same state, shadows included. And a scoring's ranking in C (``kvray.policy._pool.ranking``)
against ``np.lexsort``, on scores and depths full of ties."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvray.core.index import ROOT
from kvray.core.placement import RequestInfo
from kvray.core.tiers import Tier
from kvray.policy import _pool
from kvray.policy.reuse import ReusePolicy
from kvray.policy.reuse_model import ReuseModel
from kvray.scenario import DEFAULT_SCENARIO, load_scenario
from kvray.sim import _chain
from kvray.sim.node import SimNode
from kvray.sim.simulator import Simulator, fast_capacity
from kvray.traces import read_trace
from tests.properties import examples
from tests.sim.test_chain import chains
from tests.sim.test_chain import state as node_state

TRACE = "data/traces/conversation_trace_first30min.jsonl"
COSTS = {Tier.DEVICE: 0.0, Tier.HOST: 0.1, Tier.DISK: 0.4}


def policy_state(policy: ReusePolicy) -> dict:
    """Everything the hooks keep, as plain values (columns over the handles ever used)."""
    n = len(policy._key_of) and max(policy._key_of) + 1
    features = policy.features
    columns = {name: getattr(policy, name)[:n].tolist() for name in ("_where", "_recency", "_count", "_counted", "_frequency")}
    columns.update({name: getattr(features, name)[:n].tolist() for name in features._columns()})
    advisors = [
        ({t: (list(q.small), list(q.main), list(q.ghost)) for t, q in advisor._queues.items()}, dict(advisor._frequency))
        for advisor in policy._advisors
    ]
    return {
        "columns": columns,
        "ghosts": list(features._ghosts.items()),
        "key_of": dict(policy._key_of),
        "held": list(policy._held),
        "clock": policy._clock,
        "leaving": policy._leaving,
        "pending": {t: list(p) for t, p in policy._pending.items()},
        "advisors": advisors,
    }


def model(seed: int) -> ReuseModel:
    """A random model over the pool's features: rankings that depart from every ordering."""
    rng = np.random.default_rng(seed)
    width = 20
    model = ReuseModel(
        np.zeros(width), np.ones(width), rng.normal(size=(width, 8)), rng.normal(size=8), rng.normal(size=8), np.zeros(1)
    )
    model.pool = (64, 32, 32)
    return model


@pytest.mark.parametrize(("seed", "scale"), [(seed, 1) for seed in range(6)] + [(seed, 100) for seed in range(2)])
@pytest.mark.parametrize("following", [None, 0, 1])
def test_the_native_hooks_leave_the_python_hooks_state(seed, scale, following):
    """scale 100: over a thousand pages, beyond the 1024 handles the policy's columns start with."""
    rng = np.random.default_rng(seed)
    capacities = {
        t: int(rng.integers(low, high * scale)) for t, low, high in ((Tier.DEVICE, 1, 5), (Tier.HOST, 1, 8), (Tier.DISK, 0, 12))
    }
    scenario = load_scenario(DEFAULT_SCENARIO)
    native, python = (SimNode(0, scenario, ReusePolicy(model(seed), tripwire=0.05), capacities) for _ in range(2))
    assert native.policy.native_hooks
    for i, chain in enumerate(chains(rng, 40 if scale == 1 else 8, longest=24 * scale)):
        for node in (native, python):
            busy = {Tier.DISK: 0.7 if i % 3 == 0 else 0.0}  # every third request the disk is closed to demotions
            node.policy.on_request(RequestInfo(tuple(chain), tier_cost=COSTS, arrival_ms=10.0 * i, load_util=busy))
            node.policy._tripwire.following = following  # the model, LRU's advisor or S3-FIFO's
            node.clock = float(i)
            hits = node.manager.lookup(chain).handles
            node.manager.touch(hits)
        stored = _chain.store_chain(native.manager, native, chain, None, ROOT, 0, len(chain), "", True, True)
        assert stored == _chain.store_chain(python.manager, python, chain, None, ROOT, 0, len(chain), "", True)
        assert policy_state(native.policy) == policy_state(python.policy), f"store {i} of {chain}"
        assert node_state(native) == node_state(python)
    assert native.manager.metrics.evicted_pages and native.policy._clock > len(native.manager.index)
    if scale > 1:
        assert len(native.policy._where) > 1024  # the columns grew mid-store


def test_the_native_hooks_drop_what_leaves_for_a_closed_disk_and_only_that():
    """A disk with room: a request whose disk is closed (its load path 70% busy: 0.4 / 0.3 of a
    prefill) drops pages leaving host; an open one drops none."""
    rng = np.random.default_rng(0)
    capacities = {Tier.DEVICE: 2, Tier.HOST: 3, Tier.DISK: 10_000}
    node = SimNode(0, load_scenario(DEFAULT_SCENARIO), ReusePolicy(model(0), tripwire=0.05), capacities)
    assert node.policy.native_hooks
    dropped = {True: 0, False: 0}
    for i, chain in enumerate(chains(rng, 40, longest=24)):
        closed = i % 3 == 0
        busy = {Tier.DISK: 0.7 if closed else 0.0}
        node.policy.on_request(RequestInfo(tuple(chain), tier_cost=COSTS, arrival_ms=10.0 * i, load_util=busy))
        node.clock = float(i)
        node.manager.touch(node.manager.lookup(chain).handles)
        evicted = node.manager.metrics.evicted_pages
        _chain.store_chain(node.manager, node, chain, None, ROOT, 0, len(chain), "", True, True)
        dropped[closed] += node.manager.metrics.evicted_pages - evicted
    assert dropped[True] > 0 and dropped[False] == 0
    assert node.policy.stats()["disk_closed_requests"] == 14  # requests 0, 3, ..., 39


def test_a_reuse_replay_makes_the_same_decisions_with_the_native_hooks_or_the_python_ones(monkeypatch):
    """The shipped model with its tripwire over 300 conversation requests at 5%: every figure
    of the replay, and the policy's state and its learned shadow's at the end, the same."""
    requests = read_trace(TRACE, limit=300)
    scenario = load_scenario(DEFAULT_SCENARIO)
    capacities = fast_capacity(scenario, requests, fraction=0.05)

    def replay():
        simulator = Simulator(scenario, ReusePolicy.load(), capacities)
        result = simulator.replay(requests)
        policy = simulator.policy
        shadow = policy._tripwire.shadows[0].manager.policy
        return result, simulator.manager.metrics.evicted_pages, policy_state(policy), policy_state(shadow), policy.scored

    native = replay()
    monkeypatch.setattr(ReusePolicy, "native_hooks", property(lambda self: False))
    python = replay()
    assert native[1] > 1000 and native[4] > 1  # it evicted, by scoring pools
    assert native == python


@settings(max_examples=examples(300), deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 160), distinct=st.integers(1, 6))
def test_the_c_ranking_is_lexsort(seed, n, distinct):
    rng = np.random.default_rng(seed)
    depth = rng.integers(0, distinct, 400).astype(np.int32)
    handles = rng.choice(400, n, replace=False).astype(np.int64)
    score = (rng.integers(-distinct, distinct, n) / 4.0).astype(np.float32)
    score[rng.random(n) < 0.1] = -0.0  # equal to 0.0 in both orders
    ranked, order = _pool.ranking(score, handles, depth)
    expected = np.lexsort((-depth[handles], -score))
    assert np.frombuffer(order, dtype=np.int64).tolist() == expected.tolist()
    assert ranked == handles[expected].tolist()
