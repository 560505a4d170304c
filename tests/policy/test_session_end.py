"""End-of-session hints: which requests carry one, and what lru-session-end and reuse-session-end do with them."""

from __future__ import annotations

import numpy as np
import pytest

from kvray.core.manager import CacheManager
from kvray.core.placement import RequestInfo
from kvray.core.tiers import Tier
from kvray.policy import make_policy
from kvray.policy.cluster import make_cluster_policy
from kvray.policy.promote import promoting
from kvray.policy.reuse import ReusePolicy
from kvray.policy.session_end import SessionEndLRU, ending_sessions
from kvray.scenario import load_scenario
from kvray.sim.cluster import ClusterSimulator
from kvray.sim.node import node_capacities
from kvray.sim.workloads import WorkloadSpec, generate
from kvray.traces import full_blocks, session_end_hints

NO_MOVE = lambda *move: None  # noqa: E731  (a control-plane test: no bytes to move)
BLOCK = 512
TRACE = generate(WorkloadSpec(sessions=60, system_prompt_pages=1, document_probability=0.5), seed=4)


def test_each_sessions_last_request_names_exactly_its_own_pages():
    """A request is hinted when no later request reads its last page, and the hint starts
    at the first page of its tail that no later request reads: every page it names is never
    read again, and the page before them is (the prefix its session shares)."""
    hints = session_end_hints(TRACE, BLOCK)
    assert 0 < len(hints) < len(TRACE)
    for i, request in enumerate(TRACE):
        later = {h for r in TRACE[i + 1 :] for h in r.hash_ids}
        keys = full_blocks(request.hash_ids, request.input_length, BLOCK)
        if request.hash_ids[-1] in later or all(k in later for k in keys):
            assert i not in hints
            continue
        own_from = hints[i]
        assert not any(k in later for k in keys[own_from:])
        assert own_from == 0 or keys[own_from - 1] in later


@pytest.mark.parametrize("rule", ["lru", "reuse"])
def test_without_hints_it_replays_as_its_rule_to_the_bit(rule):
    """The hints' part adds nothing but what the hints say: told none, every figure is the
    rule's (LRU's; the learned policy's, its own counters included)."""
    told = type(make_policy(f"{rule}-session-end"))

    class Untold(told):  # type: ignore[valid-type, misc]
        needs_session_ends = False

    def untold():
        return Untold.load() if issubclass(Untold, ReusePolicy) else Untold()

    scenario = load_scenario("h100-4node-skewed")
    capacities = node_capacities(scenario, TRACE, 0.05)
    plain, hintless = (
        ClusterSimulator(scenario, p, make_cluster_policy("cost-router"), capacities).replay(TRACE) for p in (rule, untold)
    )
    assert (hintless.mean_ttft_ms, hintless.hit_tokens, hintless.bytes_moved) == (
        plain.mean_ttft_ms,
        plain.hit_tokens,
        plain.bytes_moved,
    )
    assert hintless.extra["link_bytes"] == plain.extra["link_bytes"]
    stats = hintless.extra["policy_stats"]
    assert {k: v for k, v in stats.items() if not k.startswith("ended")} == plain.extra["policy_stats"]
    assert stats.get("ended_hits", 0) == stats.get("ended_stores_refused", 0) == 0


@pytest.mark.parametrize("policy", [SessionEndLRU, lambda: ending_sessions(ReusePolicy).load()], ids=["lru", "reuse"])
def test_a_sessions_last_request_stores_none_of_its_own_pages_and_they_leave_first_unwritten(policy):
    policy = policy()
    manager = CacheManager({Tier.HOST: 4, Tier.DISK: 8}, policy)
    written: list[int] = []

    def mover(handle: int, src: Tier, src_slot: int, dst: Tier, dst_slot: int) -> None:
        written.append(manager.index.key_of(handle))

    assert manager.store_chain([1, 2, 3], mover) == 3  # a session's first turn, under a shared page 1
    policy.on_request(RequestInfo(keys=(1, 2, 3, 4), ends_session_from=1))  # its last turn: 2, 3, 4 its own
    manager.touch(manager.lookup([1, 2, 3]).handles)
    assert manager.store_chain([1, 2, 3, 4], mover) == 0 and 4 not in manager.index
    policy.on_request(RequestInfo(keys=(5, 6, 7)))
    assert manager.store_chain([5, 6, 7], mover) == 3  # the host tier is full: the ended pages made room
    assert {1, 5, 6, 7} == set(manager.index.keys()) and not written  # dropped, not written to disk
    told = {k: v for k, v in policy.stats().items() if k.startswith("ended")}
    assert told == {"ended_hits": 2, "ended_stores_refused": 1, "ended_victims": 2}


def test_a_hint_holds_for_its_own_pages_whatever_requests_come_between():
    """A runtime store serves several requests at once: the hint is by key, so another
    request's arrival between a hinted request's arrival and its store changes nothing."""
    policy = SessionEndLRU()
    manager = CacheManager({Tier.HOST: 8}, policy)
    policy.on_request(RequestInfo(keys=(1, 2, 3), ends_session_from=1))  # A: 2 and 3 are its own, now done
    policy.on_request(RequestInfo(keys=(1, 5, 6)))  # B arrives before A stores
    assert manager.store_chain([1, 5, 6], NO_MOVE) == 3  # B's pages at A's depths are stored
    assert manager.store_chain([1, 2, 3], NO_MOVE) == 0  # A's own are not (1, shared, is already there)
    assert set(manager.index.keys()) == {1, 5, 6}


def test_an_ended_page_stays_ended_when_it_moves_between_tiers():
    """A promoting variant moves a page it reads; a move is not a read, so an ended page keeps
    its mark (and leaves first from its new tier), and a page stored again later is live."""
    policy = promoting(SessionEndLRU)()
    manager = CacheManager({Tier.HOST: 2, Tier.DISK: 4}, policy)
    manager.store_chain([1, 2], NO_MOVE)
    manager.store_chain([3, 4], NO_MOVE)  # 1, 2 demoted to disk
    assert all(int(manager.index.tier[manager.index.handle_of(k)]) == Tier.DISK for k in (1, 2))
    policy.on_request(RequestInfo(keys=(1, 2), ends_session_from=1))
    handles = manager.lookup([1, 2]).handles
    manager.touch(handles)
    manager.promote(handles, NO_MOVE)  # both read from disk move up to host: 2 still ended there
    two = manager.index.handle_of(2)
    assert int(manager.index.tier[two]) == Tier.HOST and policy.victim(Tier.HOST) == two


def test_an_ended_page_read_from_disk_is_not_promoted():
    """A rule that promotes disk reads (``reuse`` without a model promotes every one) leaves an
    ended page on disk: moving it up would push a live host page down for a page no one reads."""
    policy = ending_sessions(ReusePolicy)()
    manager = CacheManager({Tier.HOST: 2, Tier.DISK: 4}, policy)
    manager.store_chain([1, 2], NO_MOVE)
    manager.store_chain([3, 4], NO_MOVE)  # 1, 2 demoted to disk
    policy.on_request(RequestInfo(keys=(1, 2), ends_session_from=1))
    handles = manager.lookup([1, 2]).handles
    manager.touch(handles)
    manager.promote(handles, NO_MOVE)
    tier = {k: int(manager.index.tier[manager.index.handle_of(k)]) for k in (1, 2)}
    assert tier == {1: Tier.HOST, 2: Tier.DISK}  # the live page moved up, the ended one stayed


def test_a_wrong_hint_costs_misses_never_a_wrong_page():
    """A page hinted as ended and read again is an ordinary page from then on; one evicted on
    a wrong hint is a miss, and a lookup still matches only the prefix cached."""
    policy = SessionEndLRU()
    manager = CacheManager({Tier.HOST: 4}, policy)
    manager.store_chain([5], NO_MOVE)  # the least recently used page from here on
    manager.store_chain([1, 2, 3], NO_MOVE)
    policy.on_request(RequestInfo(keys=(1, 2, 3), ends_session_from=2))  # wrong: 3 is read again
    manager.touch(manager.lookup([1, 2, 3]).handles)
    policy.on_request(RequestInfo(keys=(1, 2, 3)))  # read again: it is live now
    manager.touch(manager.lookup([1, 2, 3]).handles)
    manager.store_chain([7], NO_MOVE)  # LRU's victim, not the once-hinted page 3
    assert set(manager.index.keys()) == {1, 2, 3, 7}
    policy.on_request(RequestInfo(keys=(1, 2, 3), ends_session_from=1))  # wrong again, and 3, 2 leave
    manager.touch(manager.lookup([1, 2, 3]).handles)
    policy.on_request(RequestInfo(keys=(8, 9)))
    manager.store_chain([8, 9], NO_MOVE)
    assert set(manager.index.keys()) == {1, 7, 8, 9}
    match = manager.lookup([1, 2, 3])
    assert len(match) == 1 and manager.index.key_of(int(match.handles[0])) == 1


def test_hints_in_a_cluster_replay_save_drive_writes_and_keep_hits():
    """On the 4-node cluster, the sessions' own pages after their last request are neither
    stored nor written to NVMe: fewer bytes written than LRU's, and no fewer hits."""
    scenario = load_scenario("h100-4node-skewed")
    capacities = node_capacities(scenario, TRACE, 0.05)
    results = {
        p: ClusterSimulator(scenario, p, make_cluster_policy("cost-router"), capacities).replay(TRACE)
        for p in ("lru", "lru-session-end")
    }
    stats = results["lru-session-end"].extra["policy_stats"]
    assert stats["ended_stores_refused"] > 0 and stats["ended_hits"] > 0
    written = {p: sum(v for k, v in r.extra["link_bytes"].items() if k.endswith("nvme_write")) for p, r in results.items()}
    assert written["lru-session-end"] < written["lru"]
    assert results["lru-session-end"].hit_tokens >= results["lru"].hit_tokens
    assert np.isfinite(results["lru-session-end"].mean_ttft_ms)


def test_the_cluster_environment_sends_the_hints_too():
    """A router trained over lru-session-end nodes (``kvray train --cluster --node-policy
    lru-session-end``) learns on nodes told the hints, as the replays it is evaluated in."""
    from kvray.rl.cluster_env import ClusterEnv

    scenario = load_scenario("h100-2node-train")
    env = ClusterEnv(TRACE, scenario, policy="lru-session-end", episode_requests=len(TRACE) // 2, warmup_requests=0)
    env.reset(seed=0)
    done = False
    while not done:
        done = env.step(np.zeros(env.action_space.shape, dtype=np.int64))[2]
    told = [n.policy.stats() for n in env.sim.nodes]
    assert sum(s["ended_hits"] + s["ended_stores_refused"] for s in told) > 0


def test_the_learned_policy_told_the_hints_writes_less_and_hits_more_than_untold():
    """``reuse-session-end`` keeps the learned ranking for the pages no hint names and adds the
    hints' part: on one node it refuses the sessions' own pages, evicts ended pages first and
    writes fewer bytes to NVMe than ``reuse``, with no fewer hits; it is not LRU with the
    hints (its hits differ from ``lru-session-end``'s), and its counters are reported beside
    the hints'."""
    from kvray.sim.simulator import simulate

    scenario = load_scenario("h100-llama8b")
    results = {p: simulate(TRACE, p, scenario, capacity_fraction=0.05) for p in ("reuse", "reuse-session-end")}
    told, plain = results["reuse-session-end"], results["reuse"]
    stats = told.extra["policy_stats"]
    assert stats["ended_stores_refused"] > 0 and stats["ended_hits"] > 0 and stats["ended_victims"] > 0
    assert "tripwire_trips" in stats and "refits" in stats
    written = {p: sum(v for k, v in r.extra["link_bytes"].items() if k.endswith("nvme_write")) for p, r in results.items()}
    assert written["reuse-session-end"] < written["reuse"]
    assert told.hit_tokens >= plain.hit_tokens
    lru_told = simulate(TRACE, "lru-session-end", scenario, capacity_fraction=0.05)
    assert told.hit_tokens_by_tier != lru_told.hit_tokens_by_tier


def test_a_reuse_model_by_path_is_told_the_hints_too():
    """``reuse-session-end:PATH``: a trained reuse model of one's own, with the hints' part."""
    from kvray.policy.session_end import SessionEnds
    from kvray.resources import shipped_or_given

    policy = make_policy(f"reuse-session-end:{shipped_or_given('reuse', 'policies')}")
    assert isinstance(policy, SessionEnds) and isinstance(policy, ReusePolicy) and policy.needs_session_ends
    assert np.array_equal(policy.model.w1, make_policy("reuse").model.w1)
    with pytest.raises(Exception, match="no-such-model"):  # the path is the one read
        make_policy("reuse-session-end:no-such-model")
