"""The prefix index against a reference model of chained pages, over random operations."""

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvray.core.index import ROOT, PrefixIndex


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


IndexMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
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
