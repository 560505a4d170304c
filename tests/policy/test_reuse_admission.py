"""Disk admission: no page written to a disk that would load it slower than the engine recomputes
it (every reuse policy), and the disk gate: a pointwise head fitted online on delayed labels,
deciding NVMe writes."""

from __future__ import annotations

import numpy as np
import pytest

from kvray.core.manager import CacheManager
from kvray.core.placement import RequestInfo
from kvray.core.tiers import Tier
from kvray.policy.reuse import ReusePolicy
from kvray.policy.reuse_admission import WARMUP, DiskGate, disk_pays

NO_MOVE = lambda *move: None  # noqa: E731


def test_the_gate_writes_everything_while_warming_up_then_drops_the_class_never_read_again():
    """Two classes of pages by one feature: class 1 is read again two requests after it is
    demoted, class 0 never. After the warm-up the gate writes class 1 and drops class 0."""
    gate = DiskGate(mean=np.zeros(2), scale=np.ones(2), disk_pages=400)
    decisions: dict[int, list[bool]] = {0: [], 1: []}
    key = 0
    for now in range(1, 3000):
        gate.request(now, disk_cost=0.3, util=0.2)
        for cls in (0, 1):
            key += 1
            decisions[cls].append(gate.admit(key, np.array([cls, 1.0], dtype=np.float32), now))
        gate.used([key - 4], now)  # the class-1 page demoted two requests ago is read
    assert gate.labelled > WARMUP
    warm = WARMUP // 2  # two demotions per request, labelled within a few horizons
    assert all(decisions[0][:warm]) and all(decisions[1][:warm])
    assert not any(decisions[0][-500:]) and all(decisions[1][-500:])


def test_a_write_pays_for_its_link_wait_and_for_the_page_it_displaces():
    """Write iff (P - r) (1 - c) >= c u / (1 - u): P the page's predicted reuse, r the base
    rate of demoted pages reused, c the disk's load cost, u the write link's utilisation."""
    gate = DiskGate(mean=np.zeros(1), scale=np.ones(1), disk_pages=100)
    gate.w[:] = 4.0  # P = sigmoid(4 x): x 0.1 -> 0.60, x -0.5 -> 0.12
    gate.labelled = gate.resolved = 10 * WARMUP  # warm; no demoted page read again so far
    gate.request(1, disk_cost=0.3, util=0.0)
    assert gate.admit(1, np.array([-0.5]), 1)  # an idle link: any chance of reuse pays
    gate.request(2, disk_cost=0.3, util=0.3)  # a write costs 0.3 * 0.3 / 0.7 = 0.13
    assert gate.admit(2, np.array([0.1]), 2) and not gate.admit(3, np.array([-0.5]), 2)
    gate.reused = 5 * WARMUP  # half the demoted pages were read again: P 0.60 displaces 0.5
    assert not gate.admit(4, np.array([0.1]), 2)
    assert (gate.written, gate.dropped) == (2, 2)


def test_reuse_admit_drops_pages_at_demotion_into_disk_and_the_simulator_tells_it_the_link():
    """The policy's demotion hook: a page leaving host for disk goes only where the gate says;
    a dropped page is gone from every tier (a miss later, never wrong KV)."""
    from kvray.policy.page_features import FEATURES
    from kvray.policy.reuse_model import ReuseModel

    model = ReuseModel(
        np.zeros(len(FEATURES)), np.ones(len(FEATURES)), np.zeros((len(FEATURES), 1)), np.zeros(1), np.ones(1), np.zeros(1)
    )
    policy = ReusePolicy(model, pool=(64, 0, 0), disk_gate=True)
    manager = CacheManager({Tier.HOST: 2, Tier.DISK: 8}, policy)
    assert policy.needs_disk_util and policy._gate is not None
    gate = policy._gate
    gate.labelled = gate.resolved = gate.reused = 10 * WARMUP  # warm; every demoted page was read again
    for i in range(6):
        policy.on_request(RequestInfo(keys=(i,), tier_cost={Tier.HOST: 0.05, Tier.DISK: 0.3}, disk_write_util=0.5))
        manager.store_chain([i], NO_MOVE)
    assert policy._gate.dropped == 4 and policy._gate.written == 0  # P 0.5 cannot beat a base rate of 1
    assert sorted(manager.index.keys()) == [4, 5] and all(
        manager.index.tier[manager.index.handle_of(k)] == Tier.HOST for k in (4, 5)
    )


def test_a_disk_no_faster_than_recomputing_is_never_written_not_even_while_warming_up():
    gate = DiskGate(mean=np.zeros(1), scale=np.ones(1), disk_pages=100)
    gate.request(1, disk_cost=1.2, util=0.0)
    assert not gate.admit(1, np.array([5.0]), 1) and gate.dropped == 1


def test_a_disk_hit_pays_while_its_load_beats_recomputing_at_the_links_queue():
    assert disk_pays(0.54, 0.0) and disk_pays(0.54, 0.45)  # 0.98 of a prefill
    assert not disk_pays(0.54, 0.47) and not disk_pays(1.08, 0.0)  # 1.02 of a prefill; a slow disk
    assert not disk_pays(0.06, 1.5) and disk_pays(0.04, 1.5)  # a link seen over-busy counts 0.95 busy
    assert disk_pays(0.0, 0.99)  # a cost not told: every page written, as before


@pytest.mark.parametrize("name", ["reuse", "lru-load-cost"])
def test_a_page_goes_to_disk_only_while_a_disk_hit_would_beat_recomputing(name):
    """No gate: a page leaving host goes to disk while the disk's load cost over its load path's
    queue is under one prefill, and is dropped (gone from every tier) while it is not."""
    from kvray.policy import make_policy
    from kvray.policy.page_features import FEATURES
    from kvray.policy.reuse_model import ReuseModel

    model = ReuseModel(
        np.zeros(len(FEATURES)), np.ones(len(FEATURES)), np.zeros((len(FEATURES), 1)), np.zeros(1), np.ones(1), np.zeros(1)
    )
    policy = ReusePolicy(model, pool=(64, 0, 0)) if name == "reuse" else make_policy(name)
    manager = CacheManager({Tier.HOST: 2, Tier.DISK: 8}, policy)
    assert policy.needs_link_util
    costs = {Tier.HOST: 0.05, Tier.DISK: 0.6}
    for i in range(8):
        busy = 0.5 if i < 4 else 0.2  # 0.6 / 0.5 = 1.2 prefills, then 0.75
        policy.on_request(RequestInfo(keys=(i,), tier_cost=costs, load_util={Tier.HOST: 0.9, Tier.DISK: busy}))
        manager.store_chain([i], NO_MOVE)
    tier_of = {k: int(manager.index.tier[manager.index.handle_of(k)]) for k in manager.index.keys()}
    assert tier_of == {2: Tier.DISK, 3: Tier.DISK, 4: Tier.DISK, 5: Tier.DISK, 6: Tier.HOST, 7: Tier.HOST}
    teacher = ReusePolicy(model, pool=(64, 0, 0), teacher=True, load_cost_admission=True)
    assert not teacher.load_cost_admission  # a teacher's replays demote as they were recorded


def test_the_simulator_tells_reuse_its_disks_queue_and_a_slow_disk_is_never_written():
    """On the 4-node scenario at half bandwidth a disk loads a page in 1.08 prefills: reuse
    writes it nothing where LRU writes every demotion; at full bandwidth (0.54) it writes."""
    from kvray.policy.cluster import LocalFirstRing
    from kvray.scenario import load_scenario
    from kvray.sim.cluster import ClusterSimulator
    from kvray.sim.node import node_capacities
    from kvray.sim.workloads import WorkloadSpec, generate

    trace = generate(WorkloadSpec(sessions=60, session_rate_per_s=20.0, document_probability=0.6), seed=4)

    def nvme_writes(policy: str, scale: float) -> int:
        scenario = load_scenario("h100-4node-skewed").with_bandwidth(scale)
        result = ClusterSimulator(scenario, policy, LocalFirstRing(), node_capacities(scenario, trace, 0.05)).replay(trace)
        return sum(v for k, v in result.extra["link_bytes"].items() if k.endswith("nvme_write"))

    assert nvme_writes("reuse", 0.5) == 0 < nvme_writes("lru", 0.5)
    assert nvme_writes("reuse", 1.0) > 0


def test_the_tripwires_shadows_pay_for_their_disk_writes_while_the_drive_queues():
    """A shadow's request costs its pages plus, per page it wrote to disk, the wait a write adds
    at the drive's utilisation (``write_wait``: 0 on an idle drive, as on a single node, whose
    links never queue). LRU promoting disk reads writes more (the promoted page pushes a host
    page down): with the drive busy its shadow costs more than plain LRU's by that much."""
    from kvray.core.placement import LRUPolicy
    from kvray.policy.promote import promoting
    from kvray.policy.reuse_admission import write_wait
    from kvray.policy.reuse_online import ShadowTripwire

    assert write_wait(0.4, 0.0) == 0.0 and write_wait(0.4, 0.5) == pytest.approx(0.4)
    assert ReusePolicy.load().needs_disk_util and not ReusePolicy.load(tripwire=None).needs_disk_util  # told u
    assert write_wait(0.4, 2.0) == write_wait(0.4, 0.95) == pytest.approx(0.4 * 19)
    sizes = {Tier.HOST: 2, Tier.DISK: 8}
    costs = {Tier.HOST: 0.05, Tier.DISK: 0.4}
    wires = {
        u: ShadowTripwire(LRUPolicy(), {"lru-promote": promoting(LRUPolicy)}, sizes, margin=0.05, sample=1) for u in (0.0, 0.5)
    }
    for wire in wires.values():
        wire.bind(CacheManager(sizes, LRUPolicy()).index, sizes)
    gap, decay = np.zeros(2), wires[0.5]._decay
    rng = np.random.default_rng(3)
    for _ in range(200):
        keys = (int(rng.integers(1, 6)),)  # five pages over two host slots: reads from disk
        before = np.array([s.disk_writes() for s in wires[0.5].shadows], dtype=float)
        for u, wire in wires.items():
            wire.request(RequestInfo(keys=keys, tier_cost=costs, disk_write_util=u))
        wrote = np.array([s.disk_writes() for s in wires[0.5].shadows], dtype=float) - before
        gap = gap * decay + wrote * write_wait(0.4, 0.5)
        assert wires[0.5].cost - wires[0.0].cost == pytest.approx(gap)
    plain, promoting_lru = (s.disk_writes() for s in wires[0.5].shadows)
    assert promoting_lru > plain > 0
    assert wires[0.5].cost[1] - wires[0.0].cost[1] > wires[0.5].cost[0] - wires[0.0].cost[0] > 0
