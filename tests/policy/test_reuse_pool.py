"""The learned policy's candidate pool, feature rows and model scores in C
(kvray/policy/_pool.c) against their numpy references (``ReusePolicy.gather_python``,
``PageFeatures.matrix_python``, ``ReuseModel.predict``): the same candidates, in the same
order, offered by the same orderings, on random columns full of ties; the same rows on
random histories; scores within float32 rounding of predict's, the AVX and portable paths
equal bit for bit; and the same replay end to end."""

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvray.policy import _pool, page_features, reuse, reuse_model, reuse_pool
from kvray.policy.page_features import FEATURES, HALF_LIVES, NEVER, PageFeatures
from kvray.policy.reuse import ReusePolicy
from kvray.policy.reuse_model import ReuseModel
from kvray.scenario import DEFAULT_SCENARIO, load_scenario
from kvray.sim.simulator import Simulator, fast_capacity
from kvray.traces import read_trace
from tests.properties import examples


@pytest.fixture(autouse=True)
def pool_built() -> None:
    """Failing, not skipping: an install that lost the extension runs every replay slower."""
    assert reuse._pool is not None, "kvray.policy._pool is not built: make install, or python setup.py build_ext --inplace"
    assert page_features._pool is reuse._pool and reuse_model._pool is reuse._pool and reuse_pool._pool is reuse._pool


TRACE = "data/traces/conversation_trace_first30min.jsonl"


def columns(seed: int, pages: int, pinned: float) -> SimpleNamespace:
    """A policy's columns drawn small, so that recencies, frequencies and reads tie often."""
    rng = np.random.default_rng(seed)
    return SimpleNamespace(
        _where=rng.integers(-1, 3, pages).astype(np.int8),
        index=SimpleNamespace(pins=(rng.random(max(pages + int(rng.integers(-3, 4)), 0)) < pinned).astype(np.int32)),
        _recency=rng.integers(0, 8, pages).astype(np.int64),
        _frequency=rng.integers(0, 5, pages) / 4.0,
        features=SimpleNamespace(hits=rng.integers(0, 2, pages + 8).astype(np.float64)),
        _bits=np.zeros(pages, dtype=np.int8),
        _first_at=np.zeros(pages, dtype=np.int64),
    )


@settings(max_examples=examples(200), deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    pages=st.integers(1, 300),
    pinned=st.sampled_from([0.0, 0.3, 1.0]),
    pool=st.tuples(st.integers(0, 40), st.integers(0, 40), st.integers(0, 40)),
    tier=st.integers(0, 2),
)
def test_the_c_pool_is_the_numpy_pool(seed, pages, pinned, pool, tier):
    state = columns(seed, pages, pinned)
    state.pool = pool
    expected = ReusePolicy.gather_python(state, tier)
    got = ReusePolicy._gather(state, tier)
    assert got[0].tolist() == expected[0].tolist()
    assert got[1].tolist() == expected[1].tolist()


@pytest.mark.parametrize("sizes", [(2**60, 2**60 + 1, 2**62), (300, 0, 2**61), (2**62, 2**62, 2**62)])
def test_pool_sizes_past_the_cache_take_every_page_in_c_as_in_numpy(sizes):
    """Sizes beyond the tier's pages (from a model file or a flag: only negatives are refused)
    gather every page, as numpy does; the C sizes its heaps by the pages, not by the number
    (2**60 entries of 16 bytes wrapped to a 0-byte allocation, which the offers then overran)."""
    for tier in range(3):
        state = columns(7, 120, 0.3)
        state.pool = sizes
        expected = ReusePolicy.gather_python(state, tier)
        got = ReusePolicy._gather(state, tier)
        assert got[0].tolist() == expected[0].tolist() and got[1].tolist() == expected[1].tolist()


@settings(max_examples=examples(200), deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    pages=st.integers(1, 200),
    ticks=st.integers(0, 3000),
    candidates=st.integers(0, 130),
    tier=st.integers(0, 3),
)
def test_the_c_rows_are_the_numpy_rows(seed, pages, ticks, candidates, tier):
    """Histories drawn wide (ages from none to thousands of requests, counters decayed far,
    ghosts, never-seen gaps): every value equal, or at most one float32 step apart where
    libm's exp or log1p and numpy's differ in the last bit before the rounding."""
    rng = np.random.default_rng(seed)
    features = PageFeatures(capacity=4)  # grown by the inserts
    handles = np.arange(pages)
    features.insert(handles, rng.integers(0, 300, pages), int(rng.integers(1, 400)), rng.integers(0, pages, pages))
    for _ in range(int(rng.integers(0, 40))):
        features.tick(arrival_ms=features.now_ms + float(rng.exponential(500.0)))
        features.now += float(rng.integers(0, max(ticks // 20, 1)))
        features.access(rng.choice(pages, int(rng.integers(1, pages + 1)), replace=False))
    features.ghost_age[rng.random(len(features.ghost_age)) < 0.3] = rng.integers(1, 5000)
    features.gap2[rng.random(len(features.gap2)) < 0.1] = NEVER
    batch = rng.choice(pages, min(candidates, pages), replace=False)
    leaf = rng.random(len(batch)) < 0.5
    got, expected = features.matrix(batch, leaf, tier), features.matrix_python(batch, leaf, tier)
    assert got.dtype == expected.dtype == np.float32 and got.shape == expected.shape == (len(batch), len(FEATURES))
    steps = np.abs(got.view(np.int32).astype(np.int64) - expected.view(np.int32).astype(np.int64))
    assert steps.max(initial=0) <= 1 and got.flags.writeable
    assert len(HALF_LIVES) == 3  # the C counts NCOUNTS counters per page


def test_a_reuse_replay_makes_the_same_decisions_with_the_pool_and_rows_in_c_or_numpy(monkeypatch):
    """The shipped model with its tripwire over 300 conversation requests at 5%: every
    figure of the replay (hits by tier, evictions, each request's TTFT) is the same, the
    scores by the C forward pass or by predict."""
    requests = read_trace(TRACE, limit=300)
    scenario = load_scenario(DEFAULT_SCENARIO)
    capacities = fast_capacity(scenario, requests, fraction=0.05)

    def replay():
        simulator = Simulator(scenario, ReusePolicy.load(), capacities)
        result = simulator.replay(requests)
        return result, simulator.manager.metrics.evicted_pages, simulator.policy.scored

    compiled = replay()
    monkeypatch.setattr(reuse, "_pool", None)
    monkeypatch.setattr(page_features, "_pool", None)
    monkeypatch.setattr(reuse_model, "_pool", None)  # the model's scores by predict (BLAS)
    monkeypatch.setattr(reuse_pool, "_pool", None)
    python = replay()
    assert compiled[1] > 1000 and compiled[2] > 1  # it evicted, by scoring pools
    assert compiled == python


@settings(max_examples=examples(200), deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(0, 130),
    features=st.integers(1, 40),
    hidden=st.sampled_from([1, 5, 8, 16, 20, 32]),
)
def test_the_c_forward_pass_is_predict_to_float32_rounding(seed, n, features, hidden):
    """Random weights and rows: each C score within a few float32 steps of its terms'
    magnitudes of predict's (the sums' order differs from BLAS's, nothing else), and the AVX
    path equal to the portable one bit for bit (the same fused multiply-adds in the same order)."""
    rng = np.random.default_rng(seed)
    model = ReuseModel(
        rng.normal(size=features),
        rng.uniform(0.1, 3.0, features),
        rng.normal(size=(features, hidden)),
        rng.normal(size=hidden),
        rng.normal(size=hidden),
        rng.normal(size=1),
    )
    rows = rng.normal(0.0, 3.0, (n, features)).astype(np.float32)
    weights = (model.mean, model.scale, model.w1, model.b1, model.w2, model.b2)
    got = np.frombuffer(_pool.forward(rows, *weights), dtype=np.float32)
    portable = np.frombuffer(_pool.forward(rows, *weights, True), dtype=np.float32)
    expected = model.predict(rows)
    assert got.shape == expected.shape == (n,)
    assert got.tobytes() == portable.tobytes()
    x = np.abs((rows - model.mean) / model.scale).astype(np.float64)
    units = x @ np.abs(model.w1.astype(np.float64)) + np.abs(model.b1)  # each hidden unit's terms
    magnitude = units @ np.abs(model.w2.astype(np.float64)) + abs(float(model.b2[0]))
    assert np.all(np.abs(got.astype(np.float64) - expected) <= 64 * np.finfo(np.float32).eps * magnitude)
    assert model.score(rows).tobytes() == got.tobytes()


def test_the_c_forward_pass_refuses_mismatched_weights():
    model = ReusePolicy.load(tripwire=None).model
    rows = np.zeros((3, len(model.mean)), dtype=np.float32)  # 20 features: 3 x 19 values are no whole rows
    weights = (model.mean, model.scale, model.w1, model.b1, model.w2)
    with pytest.raises(ValueError, match="forward"):
        _pool.forward(rows, *weights[:4], model.w2[:-1], model.b2)
    with pytest.raises(ValueError, match="forward"):
        _pool.forward(np.zeros((3, len(model.mean) - 1), dtype=np.float32), *weights[:5], model.b2)


def test_a_whole_scoring_in_one_c_call_is_the_scoring_in_parts():
    """``_pool.ranked_pool`` (pool, rows, forward pass and ranking in one call) against the same
    scoring in parts (``scored``, ``ReuseModel.score``, ``ranking``: ``ReusePolicy._rank``) in
    every tier of a cache warmed by 200 conversation requests: the same ranking, the same
    scores of its first TAKE, the same pool size."""
    requests = read_trace(TRACE, limit=200)
    scenario = load_scenario(DEFAULT_SCENARIO)
    simulator = Simulator(scenario, ReusePolicy.load(tripwire=None), fast_capacity(scenario, requests, fraction=0.05))
    simulator.replay(requests)
    policy = simulator.policy
    for tier in policy.tiers:
        fused = policy._pool_ranked(tier, 0)
        fused_scores, fused_scored = list(policy._pending_score[tier]), policy.scored
        candidates, rows = policy._candidates(tier)
        parts = policy._rank(candidates, tier, rows)
        assert len(fused) > policy.take and fused == parts and fused_scored == policy.scored == len(candidates)
        assert fused_scores == policy._pending_score[tier].tolist()
