"""What a lookup sends over Ray, without Ray: the client packs a request's keys and the
controller's plan travels as runs of one node, so a million-token prefix's lookup is a few
hundred KiB of bytes and a handful of entries, not 7,812 ints and names serialized one by one.

The Controller runs in this process (as tests/cluster/test_observe.py does); pickle is
what Ray uses for both.
"""

from __future__ import annotations

import pickle

from hypothesis import given, settings
from hypothesis import strategies as st

from kvray.cluster.config import RuntimeConfig
from kvray.cluster.controller import Controller
from kvray.cluster.protocol import Plan, node_runs
from kvray.core.keys import pack_keys
from tests.properties import examples

NODES = ["a" * 56, "b" * 56, "c" * 56]


@settings(max_examples=examples(100))
@given(
    hit=st.lists(st.sampled_from(NODES), max_size=60),
    targets=st.lists(st.sampled_from(NODES), max_size=20),
    lease=st.integers(-1, 2**62),
)
def test_a_plan_pickles_as_runs_and_loads_equal(hit, targets, lease):
    plan = Plan(lease, hit, targets, shard=3)
    assert pickle.loads(pickle.dumps(plan)) == plan
    assert sum(count for _, count in node_runs(hit)) == len(hit)
    assert all(a != b for (a, _), (b, _) in zip(node_runs(hit), node_runs(hit)[1:]))  # runs are maximal


def test_a_long_prefix_on_one_node_is_one_entry_on_the_wire():
    one_node, per_page = Plan(1, [NODES[0]] * 7812, []), Plan(1, [NODES[0], NODES[1]] * 3906, [])
    assert len(pickle.dumps(one_node)) < 300 < 10_000 < len(pickle.dumps(per_page))


def test_the_controller_answers_packed_keys_as_it_answers_a_list():
    ctrl = Controller(RuntimeConfig())
    for node in NODES:
        ctrl.register_store(node, store=object())
    keys = [(i << 64) | (i * 7 + 1) for i in range(1, 201)]  # 128-bit keys, as page_keys makes
    ctrl.commit(None, keys[:150], [NODES[0]] * 100 + [NODES[1]] * 50, 0, {})
    packed, listed = ctrl.lookup_pin(pack_keys(keys), NODES[2]), ctrl.lookup_pin(keys, NODES[2])
    assert packed.hit_nodes == listed.hit_nodes == [NODES[0]] * 100 + [NODES[1]] * 50
    assert packed.targets == listed.targets and len(packed.targets) == 50
    assert ctrl.index.pins[ctrl.index.lookup(keys)].tolist() == [2] * 150  # both leases pin the chain
    ctrl.release(packed.lease, {}, {})
    ctrl.release(listed.lease, {}, {})
    assert ctrl.index.pins[ctrl.index.lookup(keys)].tolist() == [0] * 150
