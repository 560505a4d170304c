"""Which controller shard owns a chain of pages: the one its root page's key hashes to.

The Ray runtime splits its metadata (prefix index, page locations, pins) over
``RuntimeConfig.controller_shards`` controller actors. A chain is owned whole by one
shard, chosen by the key of its first page, so a request's lookup is one call to one
shard and each shard's index stays prefix-closed on its own (a page's parent is always in
the same shard). docs/design.md ("Sharding the metadata") weighs this against hashing
every page on its own. Keys are xxh3-128 digests; the root key is hashed once more
(xxh3-64) so the split stays even whatever keys a caller makes up.

Example::

    from kvray.core.partition import Partition, chain_shard, owned_links

    keys = [11, 12, 13]  # a chain, root first
    shard = chain_shard(keys, shards=4)
    assert 0 <= shard < 4 and chain_shard(keys[:1], 4) == shard  # the root decides
    mine = Partition(shard=shard, shards=4)
    links = [(11, None, "node-a"), (12, 11, "node-a"), (13, 12, "node-b")]  # parents first
    assert owned_links(links, mine) == links
    assert owned_links(links, Partition(shard=(shard + 1) % 4, shards=4)) == []
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import xxhash

from kvray.core.errors import RequestError

Link = TypeVar("Link", bound=tuple)


def shard_of(root_key: int, shards: int) -> int:
    """The shard (``0..shards-1``) that owns every chain starting with ``root_key``."""
    if shards == 1:
        return 0
    return xxhash.xxh3_64_intdigest(root_key.to_bytes(16, "little", signed=False)) % shards


def chain_shard(keys: Sequence[int], shards: int) -> int:
    """The shard owning the chain ``keys`` (root first): its root's."""
    if not keys:
        raise RequestError("empty request: no page keys")
    return shard_of(keys[0], shards)


@dataclass(frozen=True)
class Partition:
    """One shard's share of the chains: ``shard`` of ``shards``.

    Example::

        whole = Partition()  # one shard owns everything
        assert whole.owns(12345)
    """

    shard: int = 0
    shards: int = 1

    def owns(self, root_key: int) -> bool:
        return shard_of(root_key, self.shards) == self.shard


def owned_links(ordered: Sequence[Link], partition: Partition) -> list[Link]:
    """The ``(key, parent key or None, ...)`` links, parents first (as
    :func:`~kvray.core.index.parents_first` orders them), whose chain root ``partition`` owns."""
    if partition.shards == 1:
        return list(ordered)
    root: dict[int, int] = {}
    mine = []
    for link in ordered:
        key, parent = link[0], link[1]
        root[key] = key if parent is None else root[parent]
        if partition.owns(root[key]):
            mine.append(link)
    return mine
