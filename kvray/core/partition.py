"""Which controller shard owns a chain of pages: the one its routing page's key hashes to.

The Ray runtime splits its metadata (prefix index, page locations, pins) over
``RuntimeConfig.controller_shards`` controller actors. A request's chain is routed by the
key of its page at ``depth`` (``RuntimeConfig.controller_route_depth``; a shorter chain by
its last page), so a request's lookup is one call to one shard. With ``depth`` 0 that is
the root page and a chain is owned whole by one shard; with ``depth`` d > 0 the pages past
a shared prompt of d pages spread over the shards, and the d shared pages are indexed by
every shard that routes a chain through them (replicated), so each shard's index stays
prefix-closed on its own (a page's parent is always in the same shard). docs/design.md
("Sharding the metadata") weighs this against hashing every page on its own. Keys are
xxh3-128 digests; the routing key is hashed once more (xxh3-64) so the split stays even
whatever keys a caller makes up.

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


def route_key(keys: Sequence[int], depth: int = 0) -> int:
    """The key a request's chain ``keys`` (root first) is routed by: its page at ``depth``,
    or its last page if it is shorter. A caller storing a chain a part at a time computes it
    once, from the whole chain, and sends it with every part: a part's own pages need not
    include it (a part past the routing depth), and routing a part by its own first page
    would commit it to a shard its lookups never ask."""
    if not keys:
        raise RequestError("empty request: no page keys")
    return keys[min(depth, len(keys) - 1)]


def chain_shard(keys: Sequence[int], shards: int, depth: int = 0) -> int:
    """The shard a request's chain ``keys`` (root first) is routed to: the one its
    :func:`route_key` hashes to."""
    return shard_of(route_key(keys, depth), shards)


def short_prefix_shards(keys: Sequence[int], shards: int, depth: int) -> dict[int, int]:
    """Where lookups of a chain's short prefixes go: shard -> the longest prefix of
    ``keys`` (root first), of at most ``depth`` pages, whose lookup routes there. A prefix
    that short has no page at ``depth`` and routes by its last page, so each may ask a
    shard other than the one the whole chain commits to; a store commits the prefix there
    too (:class:`~kvray.cluster.storing.ChainStores`), or that lookup misses pages the
    cluster holds. Empty at depth 0 (every chain routes by its root)."""
    owners: dict[int, int] = {}
    for length in range(1, min(depth, len(keys)) + 1):
        owners[shard_of(keys[length - 1], shards)] = length
    return owners


@dataclass(frozen=True)
class Partition:
    """One shard's share of the chains: ``shard`` of ``shards``.

    Example::

        whole = Partition()  # one shard owns everything
        assert whole.owns(12345)
    """

    shard: int = 0
    shards: int = 1
    depth: int = 0  # the routing page's depth (see the module docstring)

    def owns(self, route_key: int) -> bool:
        """Whether chains routed by ``route_key`` (their page at ``depth``) are this shard's."""
        return shard_of(route_key, self.shards) == self.shard


def owned_links(ordered: Sequence[Link], partition: Partition) -> list[Link]:
    """The ``(key, parent key or None, ...)`` links, parents first (as
    :func:`~kvray.core.index.parents_first` orders them), that ``partition`` indexes: those
    under a routing page (at ``depth``) it owns, and every page above that depth, which any
    shard may route a chain through (a rebuilt shard takes them all: a superset of what it
    held, every page of it held by a store)."""
    if partition.shards == 1:
        return list(ordered)
    depth_of: dict[int, int] = {}
    route: dict[int, int] = {}  # key -> the key of its ancestor at partition.depth (itself there)
    mine = []
    for link in ordered:
        key, parent = link[0], link[1]
        depth = depth_of[key] = 0 if parent is None else depth_of[parent] + 1
        if depth < partition.depth:
            mine.append(link)
            continue
        route[key] = key if depth == partition.depth else route[parent]
        if partition.owns(route[key]):
            mine.append(link)
    return mine
