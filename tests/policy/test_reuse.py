"""The per-page learned policy: its features, its contract with the cache manager, its training."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvray.core.errors import PolicyError
from kvray.core.index import ROOT
from kvray.core.manager import CacheManager
from kvray.core.placement import LRUPolicy, RequestInfo
from kvray.core.tiers import Tier
from kvray.policy import make_policy
from kvray.policy.page_features import FEATURES, HALF_LIVES, NEVER, SOURCES, PageFeatures
from kvray.policy.reuse import ReusePolicy
from kvray.policy.reuse_model import ReuseModel, decision_time_us
from kvray.policy.s3fifo import S3FIFOPolicy
from tests.policy.cache_ops import NO_MOVE, apply, chain, operations
from tests.properties import examples


def brute_force(events: list[tuple], handle: int, now: float) -> dict:
    """A page's features recomputed from the whole event log (what the columns keep in O(1))."""
    last = max(i for i, (kind, _, h) in enumerate(events) if kind == "insert" and h == handle)
    inserted = events[last][1]
    reads = [t for kind, t, h in events[last:] if kind == "access" and h == handle]
    stamps = [inserted] + reads
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {
        "age": now - inserted,
        "since": now - stamps[-1],
        "gap1": gaps[-1] if gaps else NEVER,
        "gap2": gaps[-2] if len(gaps) > 1 else NEVER,
        "hits": len(reads),
        "counts": [sum(math.exp(-(now - t) * math.log(2) / h) for t in reads) for h in HALF_LIVES],
    }


@settings(max_examples=examples(80), deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["tick", "insert", "access"]), st.lists(st.integers(0, 7), max_size=4, unique=True))))
def test_features_kept_in_o1_match_a_recomputation_from_the_log(ops):
    features = PageFeatures(capacity=2)  # grows as handles come
    events: list[tuple] = []
    live: set[int] = set()
    for op, handles in ops:
        if op == "tick":
            features.tick()
        elif op == "insert":
            features.insert(np.array(handles, dtype=np.int64), np.zeros(len(handles)), 4, np.array(handles, dtype=np.int64))
            events += [("insert", features.now, h) for h in handles]
            live |= set(handles)
        else:
            handles = [h for h in handles if h in live]
            features.access(np.array(handles, dtype=np.int64))
            events += [("access", features.now, h) for h in handles]
    for handle in sorted(live):
        expected = brute_force(events, handle, features.now)
        h = np.array([handle])
        row = features.matrix(h, np.array([True]), 1)[0]
        assert row[FEATURES.index("log_age_requests")] == pytest.approx(math.log1p(expected["age"]), rel=1e-5)
        assert row[FEATURES.index("log_since_last_requests")] == pytest.approx(math.log1p(expected["since"]), rel=1e-5)
        assert features.gap1[handle] == expected["gap1"] and features.gap2[handle] == expected["gap2"]
        assert features.hits[handle] == expected["hits"]
        assert features.decayed_counts(h)[0] == pytest.approx(expected["counts"], rel=1e-6, abs=1e-9)


def test_a_page_stored_again_soon_after_it_left_carries_its_ghost_age():
    features = PageFeatures()
    features.tick()
    features.insert(np.array([3]), np.zeros(1), 1, np.array([3]), keys=[99])
    features.left(99)
    for _ in range(5):
        features.tick()
    features.insert(np.array([4]), np.zeros(1), 1, np.array([4]), keys=[99])
    features.insert(np.array([5]), np.zeros(1), 1, np.array([5]), keys=[100])
    assert features.ghost_age[4] == 5 and features.ghost_age[5] == NEVER


UNION = (2, 1, 1)  # a pool drawn from all three orderings, small enough for the tiers below


def random_model(seed: int = 0, pool: tuple[int, int, int] = (64, 0, 0)) -> ReuseModel:
    rng = np.random.default_rng(seed)
    width = len(FEATURES) + (len(SOURCES) if pool[1:] != (0, 0) else 0)
    model = ReuseModel.initial(rng.normal(size=(32, width)).astype(np.float32), 8, rng)
    model.pool = pool
    return model


@pytest.mark.parametrize("with_model", [True, False])
@pytest.mark.parametrize("pool", [(64, 0, 0), UNION])
@settings(max_examples=examples(60), deadline=None)
@given(ops=operations)
def test_every_victim_is_an_unpinned_page_of_its_tier(with_model, pool, ops):
    """Chains stored through tight tiers (demotions, subtree drops, refusals under pins): a
    victim is an unpinned page of the tier asked (None only when every page is pinned), the
    policy's tier column holds exactly the tier's pages, the index stays prefix-closed."""
    policy = ReusePolicy(random_model(pool=pool) if with_model else None, pool=pool)
    manager = CacheManager({Tier.DEVICE: 2, Tier.HOST: 3, Tier.DISK: 4}, policy)
    index, pinned = manager.index, []
    for op, path in ops:
        apply(manager, op, path, pinned)
        handles = [index.handle_of(k) for k in index.keys()]
        for tier in manager.tiers:
            mine = {h for h in handles if index.tier[h] == tier}
            assert set(np.flatnonzero(policy._where == tier).tolist()) == mine
            victim = policy.victim(tier)
            unpinned = {h for h in mine if index.pins[h] == 0}
            assert victim in unpinned if unpinned else victim is None
        assert all(index.parent[h] == ROOT or index.key_of(int(index.parent[h])) is not None for h in handles)


def test_a_page_moved_down_a_tier_keeps_its_history_and_a_new_page_starts_fresh():
    policy = ReusePolicy()
    manager = CacheManager({Tier.HOST: 1, Tier.DISK: 4}, policy)
    manager.store_chain([11], NO_MOVE)
    first = manager.index.handle_of(11)
    manager.touch(np.array([first]))
    manager.store_chain([22], NO_MOVE)  # 11 is demoted to disk
    assert manager.index.tier[first] == Tier.DISK and policy.features.hits[first] == 1
    second = manager.index.handle_of(22)
    assert policy.features.hits[second] == 0 and policy.features.ghost_age[first] == NEVER


def test_without_a_model_it_evicts_as_lru():
    manager = CacheManager({Tier.HOST: 3}, ReusePolicy())
    for key in (1, 2, 3):
        manager.store_chain([key], NO_MOVE)
    manager.touch(np.array([manager.index.handle_of(1)]))
    manager.store_chain([4], NO_MOVE)
    assert 2 not in manager.index and {1, 3, 4} <= set(manager.index.keys())


def test_the_model_decides_among_the_tail_candidates():
    """A model that scores the most-read page highest evicts it, where LRU would not."""
    manager = CacheManager({Tier.HOST: 3}, ReusePolicy(most_read_first_model()))
    for key in (1, 2, 3):
        manager.store_chain([key], NO_MOVE)
    manager.touch(np.array([manager.index.handle_of(3)]))
    manager.store_chain([4], NO_MOVE)
    assert 3 not in manager.index and {1, 2, 4} <= set(manager.index.keys())


def test_the_pool_adds_the_least_frequent_and_the_never_read_pages_beyond_lru_s_tail():
    """Page 1 was read often but longest ago (LRU's oldest), page 3 was stored after it and
    never read (the least frequent and the oldest unread), page 2 was read once lately: a
    pool of one candidate from each ordering offers 1 and 3, once each, with the orderings
    that offered them as features; page 2 is in none."""
    from kvray.core.placement import RequestInfo

    policy = ReusePolicy(teacher=True, pool=(1, 1, 1), record=1.0)
    manager = CacheManager({Tier.HOST: 8}, policy)

    def request(key: int, store: bool) -> None:
        policy.on_request(RequestInfo(keys=(key,), future=np.full(1, np.inf)))
        if store:
            manager.store_chain([key], NO_MOVE)
        else:
            manager.touch(np.array([manager.index.handle_of(key)]))

    for key, store in [(1, True)] + [(1, False)] * 5 + [(3, True), (2, True), (2, False)]:
        request(key, store)
    policy.victim(Tier.HOST)
    assert len(policy.rows) == 1 and policy.rows[0].shape == (2, len(FEATURES) + len(SOURCES))
    assert policy.rows[0][:, len(FEATURES) :].tolist() == [[1, 0, 0], [0, 1, 1]]


def test_a_model_fitted_on_other_features_is_refused(tmp_path):
    from safetensors.numpy import save_file

    model = random_model()
    model.save(tmp_path)
    assert ReusePolicy.load(tmp_path).model is not None
    tensors = {n: getattr(model, n) for n in ("mean", "scale", "w1", "b1", "w2", "b2")}
    save_file(tensors, str(tmp_path / "reuse.safetensors"), metadata={"features": "age,hits"})
    with pytest.raises(PolicyError, match="fitted on features 'age,hits'"):
        make_policy(f"reuse:{tmp_path}")
    (tmp_path / "empty").mkdir()
    with pytest.raises(PolicyError, match="no reuse model"):
        ReusePolicy.load(tmp_path / "empty")


def test_a_model_keeps_the_candidate_pool_it_was_fitted_on(tmp_path):
    random_model(pool=UNION).save(tmp_path)
    policy = ReusePolicy.load(tmp_path)
    assert policy.pool == UNION and policy.candidates == sum(UNION)
    with pytest.raises(PolicyError, match="cannot rank the pool"):
        ReusePolicy(random_model(pool=UNION), pool=(64, 0, 0))


def test_a_teacher_outside_the_simulator_is_refused():
    from kvray.core.placement import RequestInfo

    policy = ReusePolicy(teacher=True)
    CacheManager({Tier.HOST: 2}, policy)
    with pytest.raises(PolicyError, match="needs the future"):
        policy.on_request(RequestInfo(keys=(1,)))


def test_a_decision_costs_under_a_few_microseconds_per_page():
    assert decision_time_us(random_model(), pages=512, repeats=20) < 20.0  # ~1 us here unloaded; generous on a shared machine


def test_training_is_deterministic_by_seed(tmp_path):
    from kvray.rl.imitation import train_reuse
    from kvray.rl.teacher_recipe import TeacherRecipe
    from kvray.sim.workloads import WorkloadSpec, generate

    sources = {"tiny": generate(WorkloadSpec(sessions=12), seed=5)}
    recipe = TeacherRecipe(promotions="all")

    def weights(seed: int, folder: str) -> bytes:
        card = train_reuse(
            tmp_path / folder, sources, seed=seed, rounds=1, record=1.0, capacities=(0.05,), epochs=2, recipe=recipe
        )
        assert card["training"]["decisions"] > 0
        assert all(0 < r["promotion_decisions"] < r["decisions"] for r in card["training"]["rounds"])
        return (tmp_path / folder / "reuse.safetensors").read_bytes()

    assert weights(3, "a") == weights(3, "b")
    assert weights(3, "a") != weights(4, "c")


def test_promotion_rows_come_from_every_round_the_rollouts_only_or_none(tmp_path):
    """``promotions="rollouts"`` keeps round 0's (the oracle's victims) out; "none" trains on evictions only."""
    from kvray.core.errors import ConfigError
    from kvray.rl.imitation import train_reuse
    from kvray.rl.teacher_recipe import TeacherRecipe
    from kvray.sim.workloads import WorkloadSpec, generate

    sources = {"tiny": generate(WorkloadSpec(sessions=12), seed=5)}
    counts = {}
    for rows in ("all", "rollouts", "none"):
        recipe = TeacherRecipe(promotions=rows)
        card = train_reuse(tmp_path / rows, sources, seed=3, rounds=1, record=1.0, capacities=(0.05,), epochs=1, recipe=recipe)
        counts[rows] = [r["promotion_decisions"] for r in card["training"]["rounds"]]
        assert card["training"]["promotion_decisions"] == rows
    assert counts["all"][0] > 0 and counts["rollouts"][0] == 0 and counts["rollouts"][1] > 0 and counts["none"] == [0, 0]
    with pytest.raises(ConfigError, match="promotions='some'"):
        TeacherRecipe(promotions="some")


def test_delayed_labels_are_the_requests_until_next_use_or_never_after_the_horizon():
    from kvray.policy.reuse_model import NEVER_REQUESTS
    from kvray.policy.reuse_online import DelayedLabels

    labels = DelayedLabels(horizon=10)
    labels.decided(np.zeros((3, len(FEATURES)), dtype=np.float32), [7, 8, 9], now=5)
    labels.used([8], now=8)
    labels.used([8], now=9)  # only the first use after the decision counts
    assert labels.expire(now=14) == ([], [])  # not a horizon old yet
    rows, got = labels.expire(now=15)
    assert len(rows) == 1 and len(labels) == 0
    assert got[0] == pytest.approx([math.log1p(NEVER_REQUESTS), math.log1p(3), math.log1p(NEVER_REQUESTS)])


def most_read_first_model() -> ReuseModel:
    """A model that predicts the most-read page is used furthest ahead: it evicts the hot pages."""
    weights = np.zeros((len(FEATURES), 1), dtype=np.float32)
    weights[FEATURES.index("log_hits"), 0] = 1.0
    return ReuseModel(np.zeros(len(FEATURES)), np.ones(len(FEATURES)), weights, np.zeros(1), np.ones(1), np.zeros(1))


def test_the_tripwire_follows_a_heuristic_only_while_its_shadow_leads_the_model_s_by_the_margin():
    from kvray.policy.reuse_online import ShadowTripwire

    wire = ShadowTripwire(LRUPolicy(), {"lru": LRUPolicy, "s3fifo": S3FIFOPolicy}, {Tier.HOST: 4}, margin=0.1)
    wire.bind(CacheManager({Tier.HOST: 4}, LRUPolicy()).index, {Tier.HOST: 4})
    steps = [
        ([10.0, 9.5, 9.4], None),  # a 6% lead: under the margin, the model stays
        ([10.0, 9.5, 8.5], 1),  # S3-FIFO leads by 15%: followed
        ([10.0, 9.5, 9.0], 1),  # LRU is 5% ahead of S3-FIFO now: under the margin, no switch
        ([10.0, 8.0, 9.0], 0),  # LRU leads S3-FIFO by 11%
        ([7.0, 8.0, 9.0], None),  # the model leads LRU by 12.5%: back to it
    ]
    for cost, following in steps:
        wire.cost = np.array(cost)
        wire._follow()
        assert wire.following == following
        assert wire.follow() is (None if following is None else wire.advisors[following])
    assert wire.trips == 1


def test_a_model_that_evicts_the_hot_pages_trips_and_the_cache_then_hits_like_lru():
    """A cyclic working set that fits the cache: LRU hits every page once warm; the model
    evicts the most-read page each time. Its own shadow pays for that, LRU's does not, so
    the real cache follows LRU and hits nearly as often (costs in page prefills here)."""
    from kvray.core.placement import RequestInfo

    def replay(policy):
        manager = CacheManager({Tier.HOST: 16}, policy)
        hits = 0
        for i in range(600):
            keys = (100 + i % 6, 1000 + i)  # a hot root, then a page never read again
            policy.on_request(RequestInfo(keys=keys, tier_cost={Tier.HOST: 0.1}))
            match = manager.lookup(keys)
            hits += len(match)
            manager.touch(match.handles)
            manager.store_chain(keys, NO_MOVE)
        return hits

    alone = replay(ReusePolicy(most_read_first_model()))
    guarded = ReusePolicy(most_read_first_model(), tripwire=0.05)
    lru = replay(LRUPolicy())
    assert replay(guarded) >= lru - 20 > alone + 100 and guarded._tripwire.trips == 1


@pytest.mark.parametrize("following", [0, 1])
@settings(max_examples=examples(40), deadline=None)
@given(ops=operations)
def test_a_tripped_policy_evicts_as_the_followed_heuristic(following, ops):
    """While the tripwire follows LRU (0) or S3-FIFO (1), every victim is the one that
    heuristic, told of every event of the real cache, names: an unpinned page of the tier."""
    policy = ReusePolicy(random_model(), tripwire=0.05)
    manager = CacheManager({Tier.DEVICE: 2, Tier.HOST: 3, Tier.DISK: 4}, policy)
    policy._tripwire.following = following
    advisor = policy._tripwire.advisors[following]
    index, pinned = manager.index, []
    for op, path in ops:
        apply(manager, op, path, pinned)
        for tier in manager.tiers:
            unpinned = {h for k in index.keys() if index.tier[h := index.handle_of(k)] == tier and index.pins[h] == 0}
            expected = advisor.victim(tier)
            assert policy.victim(tier) == expected
            assert expected in unpinned if unpinned else expected is None


@settings(max_examples=examples(60), deadline=None)
@given(ops=operations, compiled=st.booleans())
def test_the_lru_advisor_read_off_the_recency_column_names_lru_s_victim(ops, compiled):
    """The tripwire's LRU advisor keeps no order of its own (``RecencyLRU``): in every state
    of random stores, hits, pins and drops it names the victim an ``LRUPolicy`` told of
    every event of the same cache names, in every tier (with the pool in C or numpy)."""
    from kvray.policy import reuse

    assert reuse._pool is not None, "kvray.policy._pool is not built"
    with pytest.MonkeyPatch.context() as patch:
        if not compiled:
            patch.setattr(reuse, "_pool", None)
        lru_advisor_agrees(ops)


def lru_advisor_agrees(ops) -> None:
    from kvray.policy import reuse

    policy = ReusePolicy(random_model(), tripwire=0.05)
    manager = CacheManager({Tier.DEVICE: 2, Tier.HOST: 3, Tier.DISK: 4}, policy)
    advisor = policy._tripwire.advisors[0]
    assert isinstance(advisor, reuse.RecencyLRU) and advisor not in policy._advisors
    lru = LRUPolicy()
    lru.bind(manager.index, manager.capacities)
    policy._advisors.append(lru)  # told of every event, as the advisor was
    pinned = []
    for op, path in ops:
        apply(manager, op, path, pinned)
        for tier in manager.tiers:
            assert advisor.victim(tier) == lru.victim(tier)


def test_online_refit_fits_the_model_to_labels_that_arrive_later(monkeypatch):
    from kvray.core.placement import RequestInfo
    from kvray.policy import reuse
    from kvray.policy.reuse_online import DelayedLabels

    monkeypatch.setattr(reuse, "REFIT_BATCH", 4)
    model = random_model(1)
    before = model.w1.copy()
    policy = ReusePolicy(model, refit=True)
    manager = CacheManager({Tier.HOST: 4}, policy)
    policy._labels = DelayedLabels(horizon=8)
    rng = np.random.default_rng(0)
    for _ in range(120):
        keys = chain(rng.integers(0, 6, 3).tolist())
        policy.on_request(RequestInfo(keys=tuple(keys)))
        manager.touch(manager.lookup(keys).handles)
        manager.store_chain(keys, NO_MOVE)
    assert policy.refits > 0 and not np.array_equal(model.w1, before)
    expected = {"refits": policy.refits, "tripwire_trips": 0, "disk_closed_requests": 0}
    assert policy.stats() == expected  # what a replay reports (policy_stats)


def test_the_shadows_sample_one_key_in_eight_by_hash_at_an_eighth_of_the_tier_sizes():
    """SHARDS: a key is kept or not by its hash alone (sequential trace ids spread evenly),
    whichever chain it comes in, so the kept keys of a chain keep its order."""
    from kvray.policy.reuse_online import ShadowTripwire, sampled

    keys = list(range(80_000))
    kept = sampled(keys, 8)
    assert abs(len(kept) / len(keys) - 1 / 8) < 0.01
    assert list(kept) == sorted(kept)
    assert set(sampled(keys[40_000:], 8)) == {k for k in kept if k >= 40_000}
    assert sampled(keys[:5], 1) == tuple(keys[:5])
    wire = ShadowTripwire(LRUPolicy(), {"lru": LRUPolicy}, {Tier.HOST: 800, Tier.DISK: 0}, margin=0.05, sample=8)
    assert all(s.manager.capacities == {Tier.HOST: 100} for s in wire.shadows)


@pytest.mark.parametrize("promote", ["model", "every", "none"])
def test_a_page_read_from_disk_moves_up_to_host_and_the_host_victim_goes_down(promote):
    """Without a model every disk read moves up (LRU with promotion) unless promotion is off."""
    policy = ReusePolicy(promote=promote)
    manager = CacheManager({Tier.HOST: 1, Tier.DISK: 4}, policy)
    manager.store_chain([11], NO_MOVE)
    manager.store_chain([22], NO_MOVE)  # 11 is demoted to disk
    hot = manager.index.handle_of(11)
    match = manager.lookup([11])
    manager.touch(match.handles)
    manager.promote(match.handles, NO_MOVE)
    if promote != "none":  # 11 read from disk goes back to host, 22 (host's LRU victim) down to disk
        assert manager.index.tier[hot] == Tier.HOST and manager.index.tier[manager.index.handle_of(22)] == Tier.DISK
        assert policy.features.hits[hot] == 1  # the same page: its history moves with it
    else:
        assert manager.index.tier[hot] == Tier.DISK


def test_a_heuristic_given_the_promotion_moves_disk_reads_up_and_is_registered():
    from kvray.policy.promote import promoting

    for name, base in (("lru-promote", LRUPolicy), ("s3fifo-promote", S3FIFOPolicy)):
        policy = make_policy(name)
        assert isinstance(policy, base) and policy.name == name
        manager = CacheManager({Tier.HOST: 1, Tier.DISK: 4}, policy)
        manager.store_chain([11], NO_MOVE)
        manager.store_chain([22], NO_MOVE)
        match = manager.lookup([11])
        manager.promote(match.handles, NO_MOVE)
        assert manager.index.tier[manager.index.handle_of(11)] == Tier.HOST
    assert promoting(LRUPolicy)().promote_target(0, Tier.HOST) is None  # host reads stay (device is the engine's)


def test_a_training_decision_weighs_more_the_more_work_is_queued_ahead():
    from kvray.policy.reuse_weights import QUEUE_WEIGHT_CAP, queue_weight

    assert queue_weight(0.0, 10.0) == 1.0 and queue_weight(50.0, 0.0) == 1.0
    assert queue_weight(30.0, 10.0) == 4.0  # three requests' work ahead: the miss delays four
    assert queue_weight(1e9, 10.0) == QUEUE_WEIGHT_CAP


def test_training_at_a_load_replays_each_source_scaled_to_it(tmp_path):
    from kvray.rl.imitation import train_reuse
    from kvray.sim.workloads import WorkloadSpec, generate

    sources = {"tiny": generate(WorkloadSpec(sessions=12), seed=5)}
    own = train_reuse(tmp_path / "own", sources, seed=3, rounds=0, record=1.0, capacities=(0.05,), epochs=1)
    both = train_reuse(tmp_path / "both", sources, seed=3, rounds=0, record=1.0, capacities=(0.05,), epochs=1, loads=(None, 0.9))
    assert both["training"]["loads"] == ["own rate", 0.9] and own["training"]["loads"] == ["own rate"]
    own_ttft, (same, loaded) = own["training"]["rounds"][0]["mean_ttft_ms"], both["training"]["rounds"][0]["mean_ttft_ms"]
    assert own_ttft == [same] and loaded > same  # the scaled replay queues


def most_read_nearest_model() -> ReuseModel:
    """A model that predicts the most-read page is used soonest: score -log1p(hits)."""
    weights = np.zeros((len(FEATURES), 1), dtype=np.float32)
    weights[FEATURES.index("log_hits"), 0] = 1.0
    return ReuseModel(np.zeros(len(FEATURES)), np.ones(len(FEATURES)), weights, np.zeros(1), -np.ones(1), np.zeros(1))


COSTS = {Tier.HOST: 0.1, Tier.DISK: 0.5}  # a disk read saves 0.4 of a prefill over a host read


def read_from_disk(host_reads: int, disk_reads: int, host: int = 1, policy: ReusePolicy | None = None):
    """Page 11 demoted to disk, page 22 the host's (next victim if host is full), 22 read
    ``host_reads`` times, then 11 read from disk ``disk_reads`` times (the last time, the
    promotion is decided). The manager, the policy and page 11's handle."""
    policy = policy or ReusePolicy(most_read_nearest_model())
    manager = CacheManager({Tier.HOST: host, Tier.DISK: 4}, policy)

    def request(keys):
        policy.on_request(RequestInfo(keys=tuple(keys), tier_cost=COSTS))
        match = manager.lookup(keys)
        manager.touch(match.handles)
        manager.promote(match.handles, NO_MOVE)
        manager.store_chain(keys, NO_MOVE)

    request([11])
    manager.relocate(manager.index.handle_of(11), Tier.DISK, NO_MOVE)  # demoted while cold
    request([22])
    for _ in range(host_reads):
        request([22])
    for _ in range(disk_reads):
        request([11])
    return manager, policy, manager.index.handle_of(11)


@pytest.mark.parametrize(
    ("host_reads", "disk_reads", "host", "promoted"),
    [
        (0, 1, 1, True),  # the page read (1 hit) is predicted nearer than host's victim (0 hits): pays
        (2, 1, 1, False),  # host's victim is read more (2 hits to 1): displacing it costs more than the page saves
        (2, 3, 1, True),  # read from disk again and again: now it pays
        (2, 1, 2, True),  # a free host slot: nothing displaced, it moves up whatever the scores
    ],
)
def test_the_model_promotes_a_disk_read_only_when_its_predicted_reuse_beats_the_host_victim_s(
    host_reads, disk_reads, host, promoted
):
    manager, policy, page = read_from_disk(host_reads, disk_reads, host)
    assert manager.index.tier[page] == (Tier.HOST if promoted else Tier.DISK)
    if host == 1:  # promoted: 22 left host for disk; refused: it stays, the next eviction takes it
        assert manager.index.tier[manager.index.handle_of(22)] == (Tier.DISK if promoted else Tier.HOST)


def test_the_reference_promotes_every_disk_read_the_model_would_refuse():
    """`reuse-promote-every` (the rule before per-page decisions) moves up the page the model
    refuses; an unknown promotion rule is refused at construction."""
    manager, _, page = read_from_disk(2, 1, policy=ReusePolicy(most_read_nearest_model(), promote="every"))
    assert manager.index.tier[page] == Tier.HOST
    assert make_policy("reuse-promote-every").promote == "every" and make_policy("reuse").promote == "model"
    with pytest.raises(PolicyError, match="promote='sometimes'"):
        ReusePolicy(promote="sometimes")


def test_a_refused_promotion_s_ranking_serves_the_next_eviction():
    """The ranking made to price the host's victim is left pending: the next store evicts
    that very page (22, the only one) without ranking again."""
    manager, policy, page = read_from_disk(2, 1)
    assert manager.index.tier[page] == Tier.DISK and policy._pending[Tier.HOST] == [manager.index.handle_of(22)]
    manager.store_chain([33], NO_MOVE)
    assert manager.index.tier[manager.index.handle_of(22)] == Tier.DISK and not policy._pending[Tier.HOST]


def test_the_tripwire_follows_a_promoting_shadow_that_leads_and_promotes_as_it_does():
    """The shadows are LRU and S3-FIFO with promotion; while one leads the model's shadow by the
    margin the real cache promotes every disk read, as that heuristic does, where the model
    alone refuses (host's victim is read more); once the model leads again, it decides."""
    from kvray.policy.reuse import TRIPWIRE_HEURISTICS

    names = list(TRIPWIRE_HEURISTICS)
    assert names == ["lru-promote", "s3fifo-promote"]
    for following, promoted in ((None, False), ("lru-promote", True), ("s3fifo-promote", True)):
        policy = ReusePolicy(most_read_nearest_model(), tripwire=0.05, shadow_sample=1)
        manager, _, page = read_from_disk(2, 0, policy=policy)  # 22 read twice in host, 11 on disk
        wire = policy._tripwire
        assert wire.shadows[0].manager.policy.promote == "model"  # the model's own shadow promotes by the model
        wire.following, cost = None, np.full(1 + len(names), 10.0)
        if following is not None:
            cost[1 + names.index(following)] = 8.0  # that heuristic's shadow 20% ahead
        wire.cost = cost
        wire._follow()
        assert wire.follow() is (None if following is None else wire.advisors[names.index(following)])
        match = manager.lookup([11])
        manager.touch(match.handles)
        manager.promote(match.handles, NO_MOVE)
        assert manager.index.tier[page] == (Tier.HOST if promoted else Tier.DISK)


def test_a_promoting_shadow_is_charged_a_host_read_for_a_page_it_moved_up():
    """The tripwire's costs count what promotion changes: a promoting heuristic's shadow pays a
    disk read once and host reads after, the plain heuristic's disk reads every time. The move
    itself is not charged, as the one-node simulator does not (its links are unqueued)."""
    from kvray.policy.experts import ShadowCache
    from kvray.policy.promote import promoting

    costs = {}
    for build in (LRUPolicy, promoting(LRUPolicy)):
        shadow = ShadowCache(build(), {Tier.HOST: 1, Tier.DISK: 4})
        paid = [shadow.serve(keys, COSTS)[0] for keys in ((11,), (22,), (11,), (11,), (11,))]
        costs[build().name] = paid[2:]
    assert costs == {"lru": [0.5, 0.5, 0.5], "lru-promote": [0.5, 0.1, 0.1]}


def teacher_reads_from_disk(trace: list[int], policy: ReusePolicy, decided_at: int = 2):
    """A teacher replays ``trace`` (one key a request, told each key's next use) on one host
    slot and a disk: page 11 (request 0) demoted to disk while cold, 22 then holds host, and
    request ``decided_at`` reads 11 from disk (the promotion is decided). Stops after it:
    the manager and page 11's handle."""
    manager = CacheManager({Tier.HOST: 1, Tier.DISK: 4}, policy)
    for i, key in enumerate(trace[: decided_at + 1]):
        nxt = next((j for j in range(i + 1, len(trace)) if trace[j] == key), math.inf)
        policy.on_request(RequestInfo(keys=(key,), tier_cost=COSTS, future=np.array([nxt]), index=i))
        match = manager.lookup([key])
        manager.touch(match.handles)
        manager.promote(match.handles, NO_MOVE)
        manager.store_chain([key], NO_MOVE)
        if i == 0:
            manager.relocate(manager.index.handle_of(11), Tier.DISK, NO_MOVE)
    return manager, manager.index.handle_of(11)


NEAR, FAR = [11, 22, 11, 11, 22], [11, 22, 11, 22, 11]  # 11 read next before 22 / after it


@pytest.mark.parametrize(("trace", "promoted"), [(NEAR, True), (FAR, False)])
def test_a_teacher_without_a_model_promotes_as_the_oracle_and_records_the_decision(trace, promoted):
    """Round 0 promotes a disk read iff its next use comes before host's next victim's, and
    records the decision: the page read (scored in host, the newest there, offered by no
    ordering) beside the victim's row as it was ranked, labelled with their true requests
    to next use and weighed by a disk read's cost over a host read's."""
    policy = ReusePolicy(teacher=True, record=1.0, record_promotions=True)
    manager, page = teacher_reads_from_disk(trace, policy)
    assert manager.index.tier[page] == (Tier.HOST if promoted else Tier.DISK)
    assert policy.promotions_recorded == 1
    rows, labels, weight = policy.rows[-1], policy.labels[-1], policy.weights[-1]
    ranked_victim = policy.rows[-2]  # host's ranking that named the victim (22, alone there)
    assert rows.shape == (2, len(FEATURES) + len(SOURCES)) and np.array_equal(rows[1], ranked_victim[0])
    assert rows[0, FEATURES.index("tier")] == Tier.HOST and rows[0, FEATURES.index("candidate_position")] == 1.0
    assert not rows[0, len(FEATURES) :].any()
    page_next, victim_next = (1, 2) if promoted else (2, 1)  # requests from the decision (index 2) to each next use
    assert np.allclose(labels, np.log1p([page_next, victim_next]))
    assert weight == pytest.approx(COSTS[Tier.DISK] - COSTS[Tier.HOST])


def test_promotion_decisions_are_recorded_only_when_asked():
    policy = ReusePolicy(teacher=True, record=1.0)
    teacher_reads_from_disk(NEAR, policy)
    assert policy.promotions_recorded == 0 and all(len(rows) == 1 for rows in policy.rows)  # host's rankings only


def test_a_dagger_round_promotes_as_its_model_says_and_records_what_the_oracle_would_do():
    """With a model the teacher rolls it out: 22 read twice before, the model refuses 11
    (fewer hits) though the oracle would promote it (read next); the label says promote."""
    policy = ReusePolicy(most_read_nearest_model(), teacher=True, record=1.0, record_promotions=True, pool=(64, 0, 0))
    manager, page = teacher_reads_from_disk([11, 22, 22, 22, 11, 11, 22], policy, decided_at=4)
    assert manager.index.tier[page] == Tier.DISK and policy.promotions_recorded == 1
    rows, labels = policy.rows[-1], policy.labels[-1]
    page_score, victim_score = policy.model.predict(rows)
    assert page_score > victim_score and labels[0] < labels[1]  # the model ranks the page further, the oracle nearer
