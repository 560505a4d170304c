"""The prefix index against a reference model of chained pages, over random operations."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvray.core.errors import RequestError
from kvray.core.index import ROOT, PrefixIndex, parents_first
from tests.properties import examples


class IndexMachine(RuleBasedStateMachine):
    """Pages are paths in a small token tree; a key names its whole path (like chained keys)."""

    def __init__(self):
        super().__init__()
        self.index = PrefixIndex(initial_capacity=2)  # small, so growth is exercised
        self.model: dict[tuple, int] = {}  # path -> handle
        self.pins: dict[tuple, int] = {}

    @staticmethod
    def key(path: tuple) -> int:
        return hash(("page",) + path) & (2**127 - 1)

    @rule(path=st.lists(st.integers(0, 2), min_size=1, max_size=6).map(tuple))
    def store_chain(self, path):
        parent = ROOT
        for depth in range(1, len(path) + 1):
            prefix = path[:depth]
            if prefix not in self.model:
                self.model[prefix] = self.index.add(self.key(prefix), 1, depth, 0, parent=parent, depth=depth)
            parent = self.model[prefix]

    @rule(path=st.lists(st.integers(0, 2), min_size=1, max_size=8).map(tuple))
    def match_agrees(self, path):
        keys = [self.key(path[: d + 1]) for d in range(len(path))]
        expected = 0
        while expected < len(path) and path[: expected + 1] in self.model:
            expected += 1
        assert self.index.match(keys) == expected
        handles = self.index.lookup(keys)
        assert handles.tolist() == [self.model[path[: d + 1]] for d in range(expected)]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def drop_subtree(self, data):
        path = data.draw(st.sampled_from(sorted(self.model)))
        doomed = [p for p in self.model if p[: len(path)] == path]
        if any(self.pins.get(p, 0) for p in doomed):
            return
        order = self.index.subtree([self.model[path]])
        assert sorted(order) == sorted(self.model[p] for p in doomed)
        position = {h: i for i, h in enumerate(order)}
        for p in doomed:  # children come before their parents
            if p[:-1] in self.model and p != path:
                assert position[self.model[p]] < position[self.model[p[:-1]]]
        for handle in order:
            self.index.remove(handle)
        for p in doomed:
            del self.model[p]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def pin_then_remove_fails(self, data):
        path = data.draw(st.sampled_from(sorted(self.model)))
        handle = self.model[path]
        self.index.pin(np.array([handle]))
        self.pins[path] = self.pins.get(path, 0) + 1
        with pytest.raises(ValueError):
            self.index.remove(handle)
        self.index.unpin(np.array([handle]))
        self.pins[path] -= 1

    @invariant()
    def sizes_agree(self):
        assert len(self.index) == len(self.model)
        for path, handle in self.model.items():
            assert self.index.key_of(handle) == self.key(path)
            assert self.index.has_children([handle])[0] == any(p[:-1] == path for p in self.model)


IndexMachine.TestCase.settings = settings(max_examples=examples(60), stateful_step_count=30, deadline=None)
TestIndex = IndexMachine.TestCase


def test_unpin_without_pin_is_an_error():
    index = PrefixIndex()
    handle = index.add(1, 1, 0, 0, parent=ROOT)
    with pytest.raises(ValueError, match="unpin without a matching pin"):
        index.unpin(np.array([handle]))


def test_add_needs_an_indexed_parent_and_a_new_key():
    index = PrefixIndex()
    root = index.add(1, 1, 0, 0, parent=ROOT)
    with pytest.raises(KeyError, match="already indexed"):
        index.add(1, 1, 0, 0, parent=ROOT)
    index.remove(root)
    with pytest.raises(KeyError, match="parent handle"):
        index.add(2, 1, 0, 0, parent=root)


@settings(max_examples=examples(200), deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 30), st.one_of(st.none(), st.integers(1, 30))), max_size=40, unique_by=lambda link: link[0])
)
def test_parents_first_orders_every_rooted_chain_and_sets_orphans_apart(links):
    ordered, orphans = parents_first((key, parent, key) for key, parent in links)
    position = {key: i for i, (key, _, _) in enumerate(ordered)}
    parent_of = dict(links)
    rooted = set()
    for key in parent_of:  # a key is rooted when following parents reaches None without a cycle
        seen, k = set(), key
        while k is not None and k in parent_of and k not in seen:
            seen.add(k)
            k = parent_of[k]
        if k is None:
            rooted.add(key)
    assert set(position) == rooted and set(orphans) == set(parent_of) - rooted
    assert all(parent is None or position[parent] < position[key] for key, parent, _ in ordered)
    index = PrefixIndex()  # and the order rebuilds a prefix-closed index
    handles: dict[int, int] = {}
    for key, parent, _ in ordered:
        handles[key] = index.add(key, 1, 0, 0, parent=ROOT if parent is None else handles[parent])
    assert len(index) == len(rooted)


def test_remove_subtree_takes_the_descendants_or_nothing_when_one_is_pinned():
    index = PrefixIndex()
    a = index.add(1, 1, 0, 0, parent=ROOT)
    b = index.add(2, 1, 1, 0, parent=a)
    c = index.add(3, 1, 2, 0, parent=b)
    index.add(4, 1, 3, 0, parent=a)
    index.pin(np.array([c]))
    with pytest.raises(ValueError, match="pinned"):
        index.remove_subtree(b)
    assert len(index) == 4
    index.unpin(np.array([c]))
    assert index.remove_subtree(b) == [c, b] and sorted(index.keys()) == [1, 4]


def test_keys_that_do_not_chain_are_refused_by_name_and_nothing_changes():
    index = PrefixIndex()
    first = index.add(1, 1, 0, 0, parent=ROOT)
    index.add(2, 1, 1, 0, parent=first)
    with pytest.raises(RequestError, match=r"key #1 \(0x2\) is cached but key #0 \(0x9\) before it is not"):
        index.lookup([9, 2])  # a client's keys that are not one chain: 2 is cached under 1, not 9
    assert index.lookup([1, 2]).tolist() == [first, first + 1]
    assert index.pins[:2].tolist() == [0, 0]
