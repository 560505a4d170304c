"""The replica choice of kvray's Ray Serve router (:mod:`kvray.engines.vllm.router`), pure:
candidates, where the request's cached prefix lives and the links' state in, a replica out.
Kept apart from the router so that it runs (and is tested) without Ray Serve.

Example::

    from kvray.policy.cluster import CostRouter

    candidates = [Candidate("r1", "node-a", queue_len=0), Candidate("r2", "node-b", queue_len=0)]
    choose_replica(CostRouter(), keys=[1, 2, 3], hit_nodes=["node-b", "node-b"], candidates=candidates)  # 'r2'
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvray.core.errors import PolicyError
from kvray.core.keys import ModelFingerprint, page_keys
from kvray.core.tiers import Tier
from kvray.policy.cluster import ClusterPolicy, ClusterView, NodeView, RequestView


@dataclass(frozen=True)
class Candidate:
    """A replica Serve offers for a request: its id, its Ray node and its queue length."""

    replica: str
    node: str
    queue_len: int


def fingerprint_stats(fingerprint: ModelFingerprint, salt: str) -> dict:
    """What a replica publishes in its Serve routing stats so that the router keys prompts
    exactly as the replica's connector does (:func:`keys_from_stats`)."""
    return {"kvray_digest": fingerprint.hex, "page_tokens": fingerprint.page_tokens, "kvray_salt": salt}


def keys_from_stats(tokens: Sequence[int], stats: dict) -> list[int]:
    """The page keys of ``tokens`` under a replica's published :func:`fingerprint_stats`."""
    fingerprint = ModelFingerprint(bytes.fromhex(stats["kvray_digest"]), stats["page_tokens"])
    return page_keys(tokens, fingerprint, stats["kvray_salt"])


class EngineCaches:
    """What each node's engine keeps in its own prefix cache (vLLM's, the device tier),
    as the router last sent it: the page keys of the prompts routed to the node, least
    recently routed evicted past ``capacity_pages`` (vLLM evicts its free blocks least
    recently used). The runtime's index holds kvray's tiers only, so without this a router
    cannot see that the replica that served a session's last turn still holds it on the
    device, with no load at all.

    Example::

        caches = EngineCaches(capacity_pages=4)
        caches.served("a", [1, 2, 3])
        caches.merge([1, 2, 3, 9], ["b", "b"])   # (['a', 'a', 'a'], ('device', 'device', 'device'))
    """

    def __init__(self, capacity_pages: int) -> None:
        self.capacity_pages = capacity_pages
        self.held: dict[str, OrderedDict[int, None]] = {}

    def served(self, node: str, keys: Sequence[int]) -> None:
        """``node``'s engine computed or loaded ``keys``: they are its most recent pages."""
        held = self.held.setdefault(node, OrderedDict())
        for key in keys:
            held[key] = None
            held.move_to_end(key)
        while len(held) > self.capacity_pages:
            held.popitem(last=False)

    def prefix(self, node: str, keys: Sequence[int]) -> int:
        """How many leading pages of ``keys`` ``node``'s engine holds."""
        held = self.held.get(node, {})
        n = 0
        while n < len(keys) and keys[n] in held:
            n += 1
        return n

    def merge(
        self, keys: Sequence[int], hit_nodes: Sequence[str], hit_tiers: Sequence[str] = ()
    ) -> tuple[list[str], tuple[str, ...]]:
        """The request's cached prefix with the engines' own caches counted: the pages of
        the longest prefix an engine holds are that engine's node's, on the device tier
        (served with no load), the rest where the runtime holds them, on ``hit_tiers`` where
        the runtime names them (``host``, its first tier, where not). Ties go to the node the
        runtime names for the page."""
        nodes = list(hit_nodes)
        best, depth = None, 0
        for node in self.held:
            n = self.prefix(node, keys)
            if n > depth or (n == depth and n and nodes[:1] == [node]):
                best, depth = node, n
        if best is None:
            return nodes, tuple(hit_tiers)
        rest = tuple(hit_tiers[depth:]) if hit_tiers else (Tier.HOST.label,) * (len(nodes) - depth)
        return [best] * depth + nodes[depth:], (Tier.DEVICE.label,) * depth + rest


def least_loaded(candidates: Sequence[Candidate]) -> Candidate:
    """The candidate with the shortest queue (the first such, in Serve's order)."""
    return min(candidates, key=lambda c: c.queue_len)


def choose_replica(
    policy: ClusterPolicy,
    keys: Sequence[int],
    hit_nodes: Sequence[str],
    candidates: Sequence[Candidate],
    links: ClusterView | None = None,
    request_ms: float = 0.0,
    page_prefill_ms: float = 0.0,
    hit_tiers: Sequence[str] = (),
) -> str:
    """The replica for a request of page ``keys`` whose cached prefix lives on ``hit_nodes``
    (one node per page, root first; ``hit_tiers``: their tiers where the controller knows
    them), by ``policy.route``.

    The policy sees one node per node holding a candidate, backlog = that node's
    least-loaded candidate's queue x ``request_ms``, link utilisations and free tier shares
    from ``links`` (the controller's view; a node it does not report is idle), and the
    least-loaded candidate's node as the requester (the front end's own choice, which a
    policy that does not route keeps). The chosen node's least-loaded candidate serves.
    """
    if not candidates:
        raise PolicyError("no replica to route to")
    front = least_loaded(candidates)
    per_node: dict[str, Candidate] = {}
    for candidate in candidates:
        best = per_node.get(candidate.node)
        if best is None or candidate.queue_len < best.queue_len:
            per_node[candidate.node] = candidate
    observed = {node.name: node for node in links.nodes} if links else {}
    nodes = tuple(
        replace(observed.get(name, NodeView(name)), backlog_ms=c.queue_len * request_ms) for name, c in per_node.items()
    )
    request = RequestView(tuple(keys), front.node, tuple(hit_nodes), hit_tiers=tuple(hit_tiers))
    node = policy.route(request, ClusterView(nodes, page_prefill_ms))
    if node not in per_node:
        raise PolicyError(f"cluster policy {policy.name!r} routed to node {node!r}; replicas run on {', '.join(per_node)}")
    return per_node[node].replica
