"""The cache handed over to a heuristic the tripwire starts to follow (ReusePolicy._hand_over, S3FIFOPolicy.hand_over)."""

import numpy as np

from kvray.core.manager import CacheManager
from kvray.core.tiers import Tier
from kvray.policy.s3fifo import S3FIFOPolicy


def test_an_s3fifo_handed_the_cache_puts_read_pages_in_main_and_the_rest_in_small_in_the_order_given():
    manager = CacheManager({Tier.HOST: 8}, S3FIFOPolicy())
    policy = manager.policy
    for key in range(1, 7):
        manager.store_chain([key], mover=lambda *move: None)
    handles = np.array([manager.index.handle_of(k) for k in (4, 1, 6, 2, 5, 3)])
    read = np.array([False, True, False, True, False, False])
    policy._frequency[handles[1]] = 2
    policy.hand_over(Tier.HOST, handles, read)
    queues = policy._queues[Tier.HOST]
    assert list(queues.small) == handles[~read].tolist() and list(queues.main) == handles[read].tolist()
    assert policy._frequency[handles[1]] == 2  # counts kept
    assert policy.victim(Tier.HOST) == handles[0]  # small holds its share: its oldest, not read, leaves


def test_the_reuse_policy_hands_the_cache_over_once_per_switch_in_its_recency_order():
    from kvray.policy.page_features import FEATURES
    from kvray.policy.reuse import ReusePolicy
    from kvray.policy.reuse_model import ReuseModel

    model = ReuseModel(
        np.zeros(len(FEATURES)),
        np.ones(len(FEATURES)),
        np.zeros((len(FEATURES), 1), dtype=np.float32),
        np.zeros(1),
        np.ones(1),
        np.zeros(1),
    )
    policy = ReusePolicy(model, tripwire=0.05, hand_over=True)
    manager = CacheManager({Tier.HOST: 6}, policy)
    for key in (1, 2, 3, 4, 5):
        manager.store_chain([key], mover=lambda *move: None)
    handles = {k: manager.index.handle_of(k) for k in (1, 2, 3, 4, 5)}
    policy.on_access(np.array([handles[2]]))  # 2 read: the newest of the recency order
    wire = policy._tripwire
    s3fifo = wire.advisors[1]
    calls = []
    s3fifo.hand_over = lambda tier, pages, read: calls.append((tier, pages.tolist(), read.tolist()))
    wire.following = 1
    policy.victim(Tier.HOST)
    policy.victim(Tier.HOST)
    assert calls == [(Tier.HOST, [handles[k] for k in (1, 3, 4, 5, 2)], [False, False, False, False, True])]
    wire.following = None
    policy.victim(Tier.HOST)
    wire.following = 1
    policy.victim(Tier.HOST)
    assert len(calls) == 2  # followed again after the model: handed over again
