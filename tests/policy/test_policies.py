"""Placement policies behave as their definitions say, inside the real CacheManager."""

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvray.core.errors import PolicyError
from kvray.core.index import ROOT
from kvray.core.manager import CacheManager
from kvray.core.placement import LRUPolicy, PageContext, RequestInfo
from kvray.core.tiers import Tier
from kvray.policy import POLICIES, make_policy
from kvray.policy.arc import ARCPolicy
from kvray.policy.belady import BeladyPolicy
from kvray.policy.lfu import LFUPolicy
from kvray.policy.threshold import ThresholdPolicy
from kvray.policy.wfq import WFQPolicy
from kvray.scenario import DEFAULT_SCENARIO, load_scenario
from kvray.sim.simulator import Simulator
from kvray.traces import read_trace
from tests.properties import examples

NO_MOVE = lambda *move: None  # noqa: E731  (a control-plane test: no bytes to move)


def store(manager: CacheManager, key: int, parent: int = ROOT, ctx: PageContext | None = None) -> int:
    """Store one page the way the simulator and PageStore do (admit, reserve, publish)."""
    ctx = ctx or PageContext(depth=0, request_pages=1)
    tier = manager.admit(ctx)
    assert tier is not None
    slot = manager.reserve(tier, NO_MOVE)
    assert slot is not None
    return manager.complete_store(key, tier, slot, 0, parent=parent, ctx=ctx)


def test_registry_lists_every_policy_and_rejects_unknown_names():
    assert {"lru", "lfu", "arc", "wfq", "threshold", "lecar", "s3fifo", "sieve", "belady", "rl"} <= set(POLICIES)
    with pytest.raises(PolicyError, match="unknown policy 'nope'.*known: arc, belady"):
        make_policy("nope")


def test_lfu_evicts_the_least_hit_page_oldest_first():
    manager = CacheManager({Tier.HOST: 3}, LFUPolicy())
    a, b, c = (store(manager, k) for k in (1, 2, 3))
    manager.touch(np.array([a]))
    manager.touch(np.array([a]))
    manager.touch(np.array([c]))
    store(manager, 4)  # b has no hits: it leaves
    assert 2 not in manager.index and {1, 3, 4} <= set(manager.index.keys())
    store(manager, 5)  # 4 (0 hits) leaves before c (1 hit)
    assert 4 not in manager.index and 3 in manager.index


class _ShortQueueLFU(LFUPolicy):
    queue_length = 2  # most pages outside the queue: hits must keep it exact


@settings(max_examples=examples(60), deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["store", "hit", "pin", "unpin"]), st.integers(0, 40)), max_size=120),
    st.sampled_from([LFUPolicy, _ShortQueueLFU]),
)
@example([("store", k) for k in range(7)] + [("hit", 1), ("store", 7)], _ShortQueueLFU)  # 1 was queued when hit
@example([("store", k) for k in range(6)] + [("pin", 0), ("store", 6), ("unpin", 0), ("store", 7)], _ShortQueueLFU)
def test_scored_victim_is_the_minimum_over_unpinned_pages(ops, policy_class):
    """The short eviction queue of ScoredPolicy never changes the answer of a full scan."""
    policy = policy_class()
    manager = CacheManager({Tier.HOST: 6}, policy)
    pinned: list[int] = []
    for op, key in ops:
        handle = manager.index.handle_of(key)
        if op == "store" and handle is None:
            members = policy.members.handles(Tier.HOST)
            free = [h for h in members.tolist() if manager.index.pins[h] == 0]
            if manager.slots[Tier.HOST].free_count == 0 and free:
                scores = policy.scores(np.array(free))
                expected = free[int(np.argmin(scores))]
                assert policy.victim(Tier.HOST) == expected
            if manager.slots[Tier.HOST].free_count or free:
                store(manager, key)
        elif op == "hit" and handle is not None:
            manager.touch(np.array([handle]))
        elif op == "pin" and handle is not None and len(pinned) < 3:
            manager.pin(np.array([handle]))
            pinned.append(handle)
        elif op == "unpin" and pinned:
            manager.unpin(np.array([pinned.pop()]))


def test_arc_keeps_reused_pages_through_a_scan_that_flushes_lru():
    def survivors(policy) -> set[int]:
        manager = CacheManager({Tier.HOST: 4}, policy)
        hot = [store(manager, k) for k in (1, 2)]
        manager.touch(np.array(hot))  # reused: ARC moves them to its frequency list
        for key in range(100, 104):  # a one-time scan
            store(manager, key)
        return {1, 2} & set(manager.index.keys())

    assert survivors(ARCPolicy()) == {1, 2}
    assert survivors(LRUPolicy()) == set()


def test_arc_ghost_hit_grows_the_recency_target():
    policy = ARCPolicy()
    manager = CacheManager({Tier.HOST: 2}, policy)
    store(manager, 1)
    store(manager, 2)
    store(manager, 3)  # 1 leaves T1 and becomes a B1 ghost
    assert policy._lists[Tier.HOST].p == 0
    manager.drop(manager.index.handle_of(2))
    store(manager, 1)  # a ghost hit in B1: recency deserves more room
    assert policy._lists[Tier.HOST].p >= 1


def test_wfq_takes_from_the_flow_furthest_over_its_weighted_share():
    manager = CacheManager({Tier.HOST: 6}, WFQPolicy())
    for k in range(4):
        store(manager, 10 + k, ctx=PageContext(0, 1, tenant="big"))
    for k in range(2):
        store(manager, 20 + k, ctx=PageContext(0, 1, tenant="small"))
    store(manager, 30, ctx=PageContext(0, 1, tenant="small"))
    assert 10 not in manager.index  # big holds 4 of 6: its oldest goes, not small's older pages
    assert {20, 21} <= set(manager.index.keys())
    # a priority-2 flow has weight 3: its 3 pages count as 1 page of a weight-1 flow
    manager = CacheManager({Tier.HOST: 5}, WFQPolicy())
    for k in range(3):
        store(manager, 40 + k, ctx=PageContext(0, 1, priority=2, tenant="gold"))
    for k in range(3):
        store(manager, 50 + k, ctx=PageContext(0, 1, tenant="plain"))
    assert 50 not in manager.index and {40, 41, 42} <= set(manager.index.keys())


def test_threshold_rule_places_by_context_length_and_priority():
    policy = ThresholdPolicy(long_context_pages=64)
    CacheManager({Tier.DEVICE: 4, Tier.HOST: 8, Tier.DISK: 16}, policy)
    assert policy.admit(PageContext(depth=0, request_pages=100)) == Tier.DISK
    assert policy.admit(PageContext(depth=0, request_pages=4, priority=1)) == Tier.DEVICE
    assert policy.admit(PageContext(depth=0, request_pages=4)) == Tier.HOST
    only_host = ThresholdPolicy()
    CacheManager({Tier.HOST: 8}, only_host)
    assert only_host.admit(PageContext(depth=0, request_pages=4, priority=5)) == Tier.HOST


def test_belady_evicts_the_page_used_furthest_ahead_and_skips_unused_pages():
    policy = BeladyPolicy()
    manager = CacheManager({Tier.HOST: 2}, policy)
    policy.on_request(RequestInfo(keys=(1, 2, 3), future=np.array([5.0, 9.0, np.inf])))
    h1 = store(manager, 1, ctx=PageContext(depth=0, request_pages=3))
    store(manager, 2, parent=h1, ctx=PageContext(depth=1, request_pages=3))
    assert manager.admit(PageContext(depth=2, request_pages=3)) is None  # never used again
    policy.on_request(RequestInfo(keys=(7,), future=np.array([6.0])))
    store(manager, 7, ctx=PageContext(depth=0, request_pages=1))
    assert 2 not in manager.index and {1, 7} <= set(manager.index.keys())  # 2 is needed last


def test_belady_refuses_to_run_without_the_future():
    policy = BeladyPolicy()
    CacheManager({Tier.HOST: 2}, policy)
    with pytest.raises(PolicyError, match="needs the future"):
        policy.on_request(RequestInfo(keys=(1,)))


@pytest.mark.parametrize("trace", ["conversation_trace_first30min", "synthetic_trace"])
def test_belady_hits_at_least_as_often_as_every_online_heuristic(trace):
    requests = read_trace(f"data/traces/{trace}.jsonl", limit=600)
    scenario = load_scenario(DEFAULT_SCENARIO)
    capacities = scenario.scaled(fast_pages=150)
    rates = {
        p: Simulator(scenario, make_policy(p), capacities).replay(requests).token_hit_rate
        for p in ("lru", "lfu", "arc", "belady")
    }
    assert rates["belady"] >= max(rates.values()) and rates["belady"] > rates["lru"]


class _CheckedLFU(LFUPolicy):
    """LFU whose every answer is checked against a full scan of the tier."""

    wrong = 0

    def victim(self, tier):
        answer = super().victim(tier)
        handles = self.members.handles(tier)
        handles = handles[self.index.pins[handles] == 0]
        scan = min(zip(self.scores(handles).tolist(), handles.tolist()), default=(None, None))[1]
        self.wrong += answer != scan
        return answer


def test_lfu_victims_equal_a_full_scan_through_a_replay_with_refusals_and_demotions():
    """A replay demotes pages, refuses victims (a chain being stored keeps its ancestors:
    they are pinned for the rest of that reserve, then unpinned) and hits queued pages."""
    from kvray.sim.simulator import fast_capacity
    from kvray.sim.workloads import generate, named_workload

    trace = generate(named_workload("phase"), 3)[:1500]
    scenario = load_scenario(DEFAULT_SCENARIO)
    policy = _CheckedLFU()
    simulator = Simulator(scenario, policy, fast_capacity(scenario, trace, 0.1))
    simulator.replay(trace)
    assert simulator.manager.metrics.evicted_pages > 100
    assert policy.wrong == 0
