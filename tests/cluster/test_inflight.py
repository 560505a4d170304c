"""A request whose pages another request of the same process is computing waits for them
and loads them, instead of computing and storing them a second time.

The first request holds its block open (it is computing) until the second is seen
waiting; the second then finds every page cached and stores nothing. Without the claim
both miss. The claims themselves are checked without Ray too: check and claim are one
step, a claim always ends, and a wait is bounded.
"""

from __future__ import annotations

import threading
import time

import pytest

from kvray.cluster import KvrayClient, Runtime, RuntimeConfig
from kvray.cluster.checked import PagePattern
from kvray.cluster.inflight import InFlightPages
from kvray.core.config import PageLayout, TierSizes

LAYOUT = PageLayout(layers=2, kv_heads=2, head_dim=8, page_tokens=16, dtype="float16")
WAIT_S = 10.0


def test_a_claimed_page_makes_the_next_claimant_wait_until_the_claim_ends():
    pages = InFlightPages()
    first = pages.claim("rt", [1, 2, 3], WAIT_S)
    assert first is not None
    assert pages.claim("rt", [9], WAIT_S) is not None  # other pages: no wait
    assert pages.claim("other-runtime", [1], WAIT_S) is not None  # another runtime's page 1
    answers = []
    second = threading.Thread(target=lambda: answers.append(pages.claim("rt", [2, 3, 4], WAIT_S)))
    second.start()
    second.join(0.3)
    assert second.is_alive()  # page 2 is claimed: it waits
    first.end()
    second.join(WAIT_S)
    assert answers == [None]  # waited, claimed nothing
    again = pages.claim("rt", [1, 2], WAIT_S)  # the ended claim is gone
    assert again is not None
    again.end()


def test_a_narrowed_claim_frees_the_pages_its_request_found_cached():
    pages = InFlightPages()
    first = pages.claim("rt", [1, 2, 3], WAIT_S)
    answers = []
    second = threading.Thread(target=lambda: answers.append(pages.claim("rt", [1, 2, 3], WAIT_S)))
    second.start()
    second.join(0.3)
    assert second.is_alive()
    first = first.narrow([3])  # its lookup found 1 and 2 cached elsewhere: it computes 3
    second.join(WAIT_S)
    assert len(answers) == 1 and answers[0] is not None  # no longer waits for 1: claims 1 and 2
    third = []
    waiting = threading.Thread(target=lambda: third.append(pages.claim("rt", [3], WAIT_S)))
    waiting.start()
    waiting.join(0.3)
    assert waiting.is_alive()  # 3 is still being computed
    first.end()
    waiting.join(WAIT_S)
    assert third == [None]
    answers[0].end()
    assert first.narrow([]) is None and pages.claim("rt", [1, 2, 3], WAIT_S) is not None


def test_a_wait_is_bounded():
    pages = InFlightPages()
    pages.claim("rt", [1], WAIT_S)  # never ended
    t0 = time.monotonic()
    assert pages.claim("rt", [1], 0.2) is None
    assert time.monotonic() - t0 < 2.0


@pytest.mark.ray
def test_a_request_waits_for_the_pages_another_is_computing_and_loads_them(ray_cluster):
    config = RuntimeConfig(name="inflight", layout=LAYOUT, tiers=TierSizes(host=64), max_request_pages=8)
    runtime = Runtime.start(config)
    first, second = KvrayClient.connect(config.name), KvrayClient.connect(config.name)
    pattern = PagePattern(first.page_nbytes)
    keys = first.keys_for_trace(list(range(6)))
    seen = {}

    def follow():
        with second.request(keys) as r:
            seen["hit"] = r.hit
            seen["wrong"] = pattern.wrong(keys[: r.hit], r.rows)
            r.store()
        seen["stored"] = r.stored

    try:
        with first.request(keys) as r:
            assert r.hit == 0
            follower = threading.Thread(target=follow)
            follower.start()
            follower.join(0.5)
            assert follower.is_alive() and not seen  # waits while the pages are computed
            pattern.fill_rows(keys, r.rows)
            r.store()
        assert r.stored == len(keys)
        follower.join(WAIT_S)
        assert seen == {"hit": len(keys), "wrong": 0, "stored": 0}
    finally:
        second.close()
        first.close()
        runtime.close()
