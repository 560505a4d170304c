"""The direct TCP page path against a dict model, without Ray: exact prefixes, framing of
short answers, strangers without the token, a server that goes away."""

from __future__ import annotations

import secrets
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvray.cluster.transfer import TOKEN_BYTES, PageServer, PeerLinks
from kvray.errors import ClusterError

PAGE = 4096
MAX_PAGES = 16


def page_of(key: int) -> np.ndarray:
    """Bytes derived from the key, so a page delivered for the wrong key shows."""
    return np.random.default_rng(key).integers(0, 256, PAGE, dtype=np.uint8)


class DictStore:
    """A store's verbs over a dict: read the cached prefix of ``keys`` into rows; write a run
    (keeping at most ``room`` pages in all, reporting a page dropped on each write)."""

    def __init__(self, keys, room: int = 1000) -> None:
        self.pages = {k: page_of(k) for k in keys}
        self.parents: dict[int, int | None] = {}
        self.room = room

    def write(self, keys, rows: np.ndarray, parent) -> tuple[int, list[int]]:
        stored = 0
        for key, row in zip(keys, rows):
            if len(self.pages) >= self.room:
                break
            self.pages[key] = row.copy()
            stored += 1
        if stored:
            self.parents[keys[0]] = parent
        dropped = [min(self.pages)]
        del self.pages[dropped[0]]
        return stored, dropped

    def read(self, keys, rows: np.ndarray) -> int:
        got = 0
        for key in keys:
            if key not in self.pages:
                break
            rows[got] = self.pages[key]
            got += 1
        return got


def eventually(check, timeout_s: float = 10.0) -> bool:
    """Poll ``check`` until it holds or ``timeout_s`` passes: what a server thread does
    after its peer hung up lands a moment later."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture
def served():
    token = secrets.token_bytes(TOKEN_BYTES)
    store = DictStore(range(1, 40))
    server = PageServer(store.read, store.write, PAGE, token, "127.0.0.1", MAX_PAGES)
    links = PeerLinks(token, PAGE, timeout_s=10)
    yield server, links, store, token
    links.close()
    server.close()


@settings(max_examples=40, deadline=None)
@given(requests=st.lists(st.lists(st.integers(1, 60), max_size=MAX_PAGES), min_size=1, max_size=6))
def test_pipelined_requests_return_exactly_the_cached_prefixes(requests):
    token = secrets.token_bytes(TOKEN_BYTES)
    store = DictStore(range(1, 40))
    server = PageServer(store.read, store.write, PAGE, token, "127.0.0.1", MAX_PAGES)
    links = PeerLinks(token, PAGE, timeout_s=10)
    try:
        pending = [links.load(server.address, keys) for keys in requests]  # all sent before any answer is read
        for keys, run in zip(requests, pending):
            rows = np.zeros((max(len(keys), 1), PAGE), dtype=np.uint8)
            got = run.receive(rows)
            expected = 0
            while expected < len(keys) and keys[expected] in store.pages:
                expected += 1
            assert got == expected
            for i in range(got):
                assert np.array_equal(rows[i], page_of(keys[i]))
    finally:
        links.close()
        server.close()


def test_a_stranger_without_the_token_gets_nothing(served):
    server, _, _, _ = served
    stranger = PeerLinks(secrets.token_bytes(TOKEN_BYTES), PAGE, timeout_s=10)
    rows = np.zeros((2, PAGE), dtype=np.uint8)
    assert stranger.load(server.address, [1, 2]).receive(rows) == 0
    stranger.close()
    assert eventually(lambda: server.rejected == 1)
    assert not rows.any() and server.sent_bytes == 0


def test_an_oversized_request_is_hung_up_on_and_the_link_recovers(served):
    server, links, _, _ = served
    rows = np.zeros((MAX_PAGES + 1, PAGE), dtype=np.uint8)
    assert links.load(server.address, list(range(1, MAX_PAGES + 2))).receive(rows) == 0
    assert links.load(server.address, [1, 2, 3]).receive(rows) == 3  # a fresh connection
    assert np.array_equal(rows[2], page_of(3))


def test_a_server_that_goes_away_is_a_miss_and_a_new_one_is_reached(served):
    server, links, store, token = served
    rows = np.zeros((4, PAGE), dtype=np.uint8)
    assert links.load(server.address, [5, 6]).receive(rows) == 2
    server.close()
    assert links.load(server.address, [5, 6]).receive(rows[2:]) == 0
    again = PageServer(store.read, store.write, PAGE, token, "127.0.0.1", MAX_PAGES)
    try:
        assert links.load(again.address, [7]).receive(rows) == 1
        assert np.array_equal(rows[0], page_of(7))
    finally:
        again.close()


def test_stores_land_with_their_parent_and_report_what_was_dropped(served):
    server, links, store, _ = served
    rows = np.stack([page_of(k) for k in (100, 101, 102)])
    first = links.store(server.address, [100, 101, 102], rows, parent=39)
    second = links.store(server.address, [200], rows[:1], parent=None)  # pipelined behind the first
    assert first.receive() == (3, [1]) and second.receive() == (1, [2])
    assert store.parents == {100: 39, 200: None}
    assert np.array_equal(store.pages[101], page_of(101)) and np.array_equal(store.pages[200], page_of(100))
    out = np.zeros((3, PAGE), dtype=np.uint8)
    assert links.load(server.address, [100, 101, 102]).receive(out) == 3 and np.array_equal(out, rows)
    assert server.received_bytes == 4 * PAGE


def test_a_full_store_keeps_a_prefix_of_the_run():
    token = secrets.token_bytes(TOKEN_BYTES)
    store = DictStore(range(1, 4), room=5)
    server = PageServer(store.read, store.write, PAGE, token, "127.0.0.1", MAX_PAGES)
    links = PeerLinks(token, PAGE, timeout_s=10)
    try:
        rows = np.stack([page_of(k) for k in range(10, 14)])
        assert links.store(server.address, list(range(10, 14)), rows, parent=3).receive() == (2, [1])
        assert set(store.pages) == {2, 3, 10, 11}
    finally:
        links.close()
        server.close()


def test_a_store_to_a_vanished_server_is_not_kept(served):
    server, links, _, _ = served
    server.close()
    assert links.store(server.address, [300], np.zeros((1, PAGE), np.uint8), parent=None).receive() is None


def test_a_token_of_the_wrong_size_is_refused():
    with pytest.raises(ClusterError, match="token must be 32 bytes"):
        PeerLinks(b"short", PAGE, timeout_s=1)
