"""PageStore over random request sequences, against a reference model.

With room for everything, the store must behave like a set of cached prefixes exactly.
With tight tiers (pages demoted and dropped), every load must still return bit-exact KV
of the exact prefix asked for, and the tier accounting must add up, under the default
policy (LRU) and under the FIFO-based ones (S3-FIFO, SIEVE), whose victims are often pages
with descendants.
"""

from __future__ import annotations

import tempfile

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvray.core.config import StoreConfig, TierSizes
from kvray.core.store import PageStore
from kvray.policy import make_policy
from tests.conftest import TINY, prefix_kv
from tests.properties import examples

P = TINY.page_tokens
# Requests share prefixes: a few page-sized token blocks, combined in short sequences.
requests = st.lists(st.integers(0, 3), min_size=1, max_size=6).map(
    lambda blocks: [b * 10 + j for b in blocks for j in range(P)]
) | st.lists(st.integers(0, 50), min_size=1, max_size=23)


class StoreMachine(RuleBasedStateMachine):
    roomy = True
    policy: str | None = None  # the store's default (LRU)

    @initialize()
    def open_store(self):
        self.tmp = tempfile.TemporaryDirectory()
        sizes = TierSizes(device=64, host=64, disk=64) if self.roomy else TierSizes(device=1, host=2, disk=3)
        policy = make_policy(self.policy) if self.policy else None
        self.store = PageStore(StoreConfig(layout=TINY, tiers=sizes, disk_dir=self.tmp.name), policy)
        self.cached: set[tuple] = set()  # reference: full-page prefixes stored

    def teardown(self):
        self.store.close()
        self.tmp.cleanup()

    @rule(tokens=requests)
    def store_request(self, tokens):
        self.store.store(tokens, prefix_kv(TINY, tokens))
        self.cached.update(tuple(tokens[: P * (i + 1)]) for i in range(len(tokens) // P))

    @rule(tokens=requests)
    def load_request(self, tokens):
        looked_up = self.store.lookup(tokens)
        hit = self.store.load(tokens)
        assert hit.tokens == looked_up  # nothing can fail its checksum here
        assert torch.equal(hit.kv, prefix_kv(TINY, tokens)[:, :, : hit.tokens])  # never wrong KV
        if self.roomy:
            expected = 0
            while expected + P <= len(tokens) and tuple(tokens[: expected + P]) in self.cached:
                expected += P
            assert hit.tokens == expected

    @invariant()
    def accounting_adds_up(self):
        if not hasattr(self, "store"):
            return
        tiers = self.store.stats()["tiers"]
        assert sum(t["used"] for t in tiers.values()) == len(self.store)
        assert all(t["used"] <= t["capacity"] for t in tiers.values())
        assert self.store.stats()["corrupt_pages"] == 0


class TightStoreMachine(StoreMachine):
    roomy = False


class TightS3FIFOStoreMachine(TightStoreMachine):
    policy = "s3fifo"


class TightSieveStoreMachine(TightStoreMachine):
    policy = "sieve"


StoreMachine.TestCase.settings = settings(max_examples=examples(40), stateful_step_count=25, deadline=None)
TightStoreMachine.TestCase.settings = settings(max_examples=examples(60), stateful_step_count=30, deadline=None)
for machine in (TightS3FIFOStoreMachine, TightSieveStoreMachine):
    machine.TestCase.settings = settings(max_examples=examples(30), stateful_step_count=30, deadline=None)
TestRoomyStore = StoreMachine.TestCase
TestTightStore = TightStoreMachine.TestCase
TestTightS3FIFOStore = TightS3FIFOStoreMachine.TestCase
TestTightSieveStore = TightSieveStoreMachine.TestCase
