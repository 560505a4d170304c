"""The compiled chain writer (kvray/sim/_chain.c) leaves a node exactly as the manager's
Python does: the same index (keys, handles, columns, free handles), LRU order, slot heaps,
metrics, link counters and modeled move time, after every store of random chains in caches
far smaller than them (eviction cascades, refusals of a kept lineage, chains longer than the
whole cache), on unqueued and queued links, and when a writer fails mid-chain."""

import numpy as np
import pytest

from kvray.core.errors import KvrayError
from kvray.core.index import ROOT
from kvray.core.tiers import Tier
from kvray.policy import make_policy
from kvray.scenario import DEFAULT_SCENARIO, load_scenario
from kvray.sim import _chain
from kvray.sim.links import Link
from kvray.sim.node import SimNode


def state(node: SimNode) -> dict:
    """Everything a store may change, as plain values."""
    index, manager = node.manager.index, node.manager
    live = sorted(index._handles.values())
    columns = {name: col[live].tolist() for name, col in index._cols.items()}
    return {
        "handles": dict(index._handles),
        "keys": list(index._keys),
        "free_handles": list(index._free_handles),
        "columns": columns,
        "clock": index.clock,
        "lru": {t: list(order) for t, order in getattr(node.policy, "_order", {}).items()},
        "tier_of": dict(getattr(node.policy, "_tier_of", {})),
        "victims": [node.policy.victim(t) for t in manager.tiers],  # a generic policy's state, as it acts on it
        "slots": {t: (list(a._free), bytes(a._used)) for t, a in manager.slots.items()},
        "metrics": manager.metrics.snapshot(),
        "kept": (dict(manager._kept), dict(manager._lineage)),
        "links": [
            (link.name, dict(link.bytes_by_kind), link.busy_ms, link.last_end_ms, arrivals(link), link._starts, link._ends)
            for link in node.links
        ],
        "background_ms": node.background_ms,
    }


def arrivals(link: Link) -> dict[float, int]:
    """Bytes by the time they arrive, what Link.utilisation reads off its pending heap (the
    compiled path pushes a call's bookings that end together as one entry)."""
    by_end: dict[float, int] = {}
    for end, nbytes in link._pending:
        by_end[end] = by_end.get(end, 0) + nbytes
    return by_end


def nodes(capacities: dict[Tier, int], queued: bool, policy: str = "lru") -> tuple[SimNode, SimNode]:
    scenario = load_scenario(DEFAULT_SCENARIO)
    return tuple(SimNode(0, scenario, make_policy(policy), capacities, queued=queued) for _ in range(2))


def chains(rng: np.random.Generator, count: int, longest: int) -> list[list[int]]:
    """Requests that share prefixes (a random tree of page keys), some longer than the cache."""
    made: list[list[int]] = []
    next_key = 1
    for _ in range(count):
        base = made[rng.integers(len(made))] if made and rng.random() < 0.8 else []
        chain = base[: rng.integers(len(base) + 1)]
        for _ in range(int(rng.integers(1, longest))):
            chain.append(next_key)
            next_key += 1
        made.append(chain)
    return made


@pytest.mark.parametrize("queued", [False, True])
@pytest.mark.parametrize(("seed", "scale"), [(seed, 1) for seed in range(12)] + [(seed, 10) for seed in range(4)])
@pytest.mark.parametrize("policy", ["lru", "arc", "s3fifo", "selective-write", "wfq"])
def test_compiled_stores_leave_the_python_paths_state(seed, queued, scale, policy):
    """scale 10: tiers of tens of pages, so that a chain longer than the cache refuses more
    than the 32 victims a reserve may (REFUSALS_PER_RESERVE) in one kept lineage. LRU's hooks
    are transcribed in C; any other policy's are called from C (``generic``): the
    selective write's demotion depends on the page (a kept lineage's pages go different ways)."""
    rng = np.random.default_rng(seed)
    capacities = {
        t: int(rng.integers(low, high * scale)) for t, low, high in ((Tier.DEVICE, 1, 5), (Tier.HOST, 0, 8), (Tier.DISK, 0, 12))
    }
    compiled, python = nodes(capacities, queued, policy)
    generic = () if policy == "lru" else ("", True)
    for i, chain in enumerate(chains(rng, 60, longest=24 * scale)):
        for node in (compiled, python):
            node.clock = float(i)
            hits = node.manager.lookup(chain).handles
            node.manager.touch(hits)  # LRU order moves between stores
        stored = _chain.store_chain(compiled.manager, compiled, chain, None, ROOT, 0, len(chain), *generic)
        assert stored == python.manager.store_chain(chain, python.mover, python.write)
        assert state(compiled) == state(python), f"store {i} of {chain}"
    assert python.manager.metrics.moved_pages and python.manager.metrics.evicted_pages  # cascades ran


def test_a_failing_writer_gives_its_slot_back_on_both_paths():
    compiled, python = nodes({Tier.DEVICE: 2, Tier.HOST: 3, Tier.DISK: 4}, queued=False)
    for node in (compiled, python):
        node.manager.store_chain([1, 2, 3, 4, 5], node.mover, node.write)
    calls = {"compiled": 0, "python": 0}

    def failing(which: str):
        def write(depth: int, key: int, tier: Tier, slot: int, parent: int) -> int:
            calls[which] += 1
            if calls[which] == 3:
                raise KvrayError("the copy failed")
            return 7

        return write

    with pytest.raises(KvrayError):
        _chain.store_chain(compiled.manager, compiled, [1, 2, 6, 7, 8, 9], failing("compiled"), ROOT, 0, 6)
    with pytest.raises(KvrayError):
        python.manager.store_chain([1, 2, 6, 7, 8, 9], python.mover, failing("python"))
    assert state(compiled) == state(python)
    assert compiled.manager.lookup([1, 2, 6, 7, 8]).checksums.tolist() == [0, 0, 7, 7]  # stored before the failure


def test_store_chain_takes_the_compiled_path_only_where_it_is_exact(monkeypatch):
    """Nothing kept from outside, and a policy whose demotion may be asked in any order: else
    the manager's Python runs."""
    import kvray.sim.node

    taken = []
    monkeypatch.setattr(kvray.sim.node, "_chain", type("Spy", (), {"store_chain": staticmethod(lambda *a: taken.append(a) or 0)}))
    scenario = load_scenario(DEFAULT_SCENARIO)
    capacities = {Tier.DEVICE: 2, Tier.HOST: 2}
    lru, arc = SimNode(0, scenario, make_policy("lru"), capacities), SimNode(0, scenario, make_policy("arc"), capacities)
    lru.store_chain([1, 2], lru.write)
    assert len(taken) == 1 and taken[0][3] is None and taken[0][7:] == ()  # the node's own writer: booked in C
    arc.store_chain([1, 2], arc.write)
    assert len(taken) == 2 and taken[1][7:] == ("", True)  # another policy: its hooks called from C
    arc.policy.compiled_chain = False  # its demotion asked in the Python order only (reuse's disk gate)
    assert arc.store_chain([1, 2], arc.write) == 2 and len(taken) == 2  # the spy stored nothing: Python both
    lru.manager.keep(0)
    assert lru.store_chain([1, 2, 3], lru.write) == 3 and len(taken) == 2


def test_a_policy_naming_no_page_of_its_tier_is_an_index_error_on_the_compiled_path():
    """Handles from Python are checked before the C indexes a column by them: a victim out of
    range, or of another tier, and a parent that is no page are IndexErrors naming them, never
    a read or write past a column."""
    compiled, _ = nodes({Tier.DEVICE: 2, Tier.HOST: 3}, queued=False, policy="arc")
    compiled.manager.store_chain([1, 2, 3], compiled.mover, compiled.write)
    index = compiled.manager.index
    elsewhere = next(h for h in index._handles.values() if index.tier[h] != Tier.DEVICE)
    for bad in (10**6, len(index._keys) + 5, elsewhere):
        compiled.policy.victim = lambda tier, bad=bad: bad
        with pytest.raises(IndexError, match=f"returned handle {bad}, not a page of that tier"):
            _chain.store_chain(compiled.manager, compiled, [11, 12, 13, 14, 15], None, ROOT, 0, 5, "", True)
    del compiled.policy.victim
    with pytest.raises(IndexError, match="parent handle 1000000 is not a page of the index"):
        _chain.store_chain(compiled.manager, compiled, [21], None, 10**6, 0, 1, "", True)


def test_a_victim_named_while_pinned_is_refused_and_counted_as_in_python():
    """A policy that keeps naming a pinned page: the page is pinned as refused each time, the
    reserve gives up after REFUSALS_PER_RESERVE and every pin is undone, on both paths (before:
    the compiled path looped for ever, and the Python path undid one pin of the 32)."""
    compiled, python = nodes({Tier.DEVICE: 2, Tier.HOST: 2}, queued=False, policy="arc")
    for node in (compiled, python):
        node.manager.store_chain([1, 2, 3, 4], node.mover, node.write)
        index = node.manager.index
        pinned = min(h for h in index._handles.values() if index.tier[h] == Tier.DEVICE)
        index.pins[pinned] += 1
        own = node.policy.victim
        node.policy.victim = lambda tier, pinned=pinned, own=own: pinned if tier == Tier.DEVICE else own(tier)
    stored = _chain.store_chain(compiled.manager, compiled, [31, 32], None, ROOT, 0, 2, "", True)
    assert stored == python.manager.store_chain([31, 32], python.mover, python.write)
    for node in (compiled, python):
        del node.policy.victim
    assert state(compiled) == state(python)
