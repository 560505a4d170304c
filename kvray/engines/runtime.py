"""An engine's pages on a shared kvray runtime instead of its own in-process store.

Engines (the vLLM connector, the transformers adapter) keep their pages in an in-process
:class:`~kvray.core.store.PageStore` unless a kvray runtime is named, by the engine's
settings or by the environment (a setting wins over its variable):

- ``kvray_runtime`` / ``$KVRAY_RUNTIME``: the runtime's name (``kvray up --name``,
  default ``kvray`` once an address is given);
- ``kvray_ray_address`` / ``$KVRAY_RAY_ADDRESS``: the Ray cluster it runs on (``auto``,
  ``HOST:PORT``); a process already connected to Ray (a Ray actor, a Serve replica)
  uses its own connection.

Then every instance on every node shares one cache: :class:`RuntimePages` looks pages up
with one controller round trip, reads them from the node's mapped host tier or by TCP
from a peer's page server (:class:`~kvray.cluster.client.KvrayClient`), and stores
computed pages on its own node. A runtime named but not reachable is logged and the
engine falls back to its in-process store: a cache that cannot be reached is a miss,
never a failed engine. A runtime whose page layout differs from the engine's is refused
with a :class:`~kvray.core.errors.ConfigError` naming both.

Page keys bind the engine's own model fingerprint (model name, layout, checkpoint
revision), not the runtime's, so two models sharing a runtime never share a page.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvray.core.config import PageLayout
from kvray.core.errors import ConfigError, KvrayError, RequestError
from kvray.core.keys import ModelFingerprint, as_token_array, page_keys
from kvray.core.pages import torch_dtype
from kvray.core.request_kv import LoadResult

log = logging.getLogger(__name__)

RUNTIME_ENV = "KVRAY_RUNTIME"
ADDRESS_ENV = "KVRAY_RAY_ADDRESS"
DEFAULT_RUNTIME = "kvray"


@dataclass(frozen=True)
class RuntimeTarget:
    """Which kvray runtime an engine asked for: its Ray address (None: the current or
    local Ray) and its name."""

    address: str | None
    name: str


def runtime_target(address: str | None = None, name: str | None = None) -> RuntimeTarget | None:
    """The runtime named by settings (``address``, ``name``) or else the environment;
    ``None`` when neither names one (the engine keeps its pages in process)."""
    address = address or os.environ.get(ADDRESS_ENV) or None
    name = name or os.environ.get(RUNTIME_ENV) or None
    if address is None and name is None:
        return None
    return RuntimeTarget(address, name or DEFAULT_RUNTIME)


class RuntimePages:
    """One engine process's page verbs on a kvray runtime; see the module docstring.

    Duck-types the parts of :class:`~kvray.core.store.PageStore` the engines use (``keys``,
    ``match``, ``load``, ``put_pages``, ``layout``, ``config``, ``fingerprint``) and adds
    the split the vLLM connector needs: ``lookup`` (scheduler: pins the cached prefix) and
    ``read`` (worker: brings the pages, ends the pins). Not thread-safe: one thread at a
    time per instance.

    Example::

        pages = RuntimePages.open(runtime_target("auto", "kvray"), layout, "my-llama")
        keys = pages.keys(prompt_tokens)
        plan = pages.lookup(keys)                 # pins the cached prefix
        loaded, raw = pages.read(keys, plan)      # raw: [loaded.pages, page_nbytes] uint8
        parent = keys[loaded.pages - 1]           # the chain the computed pages continue
        pages.put_pages(keys[loaded.pages:], computed, pages.fingerprint.digest, parent, pages.route_key(keys))
    """

    def __init__(self, client, model_name: str | None = None, model_revision: str | None = None) -> None:
        self.client = client
        self._model = (model_name, model_revision)
        self.layout: PageLayout = client.config.layout
        self.config = client.config.store_config(client.node_id)
        self.fingerprint = ModelFingerprint.of(self.layout, model_name or client.config.model_name, model_revision)
        self.node_id: str = client.node_id
        self.pages_by_path: Counter[str] = Counter()  # pages loaded, by transfer path (mapped, local, tcp, ...)
        self.lost_pages = 0  # pages a plan promised that did not arrive (misses, never wrong KV)

    @classmethod
    def open(
        cls, target: RuntimeTarget, layout: PageLayout, model_name: str | None = None, model_revision: str | None = None
    ) -> RuntimePages | None:
        """Connect to ``target`` (``ray.init`` unless this process is connected already);
        ``None``, logged, when it cannot be reached."""
        import ray

        from kvray.cluster.client import KvrayClient
        from kvray.cluster.runtime import check_reachable

        try:
            if not ray.is_initialized():
                if target.address:
                    check_reachable(target.address)
                ray.init(address=target.address or "auto", log_to_driver=False)
            client = KvrayClient.connect(target.name)
        except (KvrayError, ConnectionError, RuntimeError, TimeoutError) as exc:
            log.warning("kvray runtime %r at %s not reachable (%s): pages stay in process", target.name, target.address, exc)
            return None
        if client.config.layout != layout:
            client.close()
            raise ConfigError(
                f"kvray runtime {target.name!r} keeps pages of layout {client.config.layout}, this engine's are {layout}: "
                "start the runtime with the engine's layout (kvray up --scenario with runtime.layout)"
            )
        return cls(client, model_name, model_revision)

    def twin(self) -> RuntimePages:
        """Another handle on the same runtime with the same page keys (a client and landing
        buffer of its own), for a second thread: this one is not thread-safe."""
        from kvray.cluster.client import KvrayClient

        client = KvrayClient.connect(self.client.config.name, timeout_s=self.client.timeout_s)
        return RuntimePages(client, *self._model)

    @property
    def capacity(self) -> int:
        """Most pages one lookup, load or store covers (the runtime's ``max_request_pages``)."""
        return self.client.buffer.capacity

    def keys(self, tokens: Sequence[int] | np.ndarray, salt: str = "") -> list[int]:
        return page_keys(tokens, self.fingerprint, salt)

    # -- the split verbs (vLLM: scheduler looks up, worker reads) ------------------------------
    def lookup(self, keys: Sequence[int], route_key: int | None = None, ends_session_from: int = -1, tell: bool = True):
        """Pin the runtime's cached prefix of ``keys`` (at most :attr:`capacity` of them) and
        return the :class:`~kvray.cluster.protocol.Plan`; a controller that does not
        answer is a miss. ``route_key``: the prompt's (:meth:`route_key`) when ``keys`` are
        fewer than the pages its saves will cover (all but the page holding the last token):
        the lookup asks the shard the saves commit to. ``ends_session_from``, ``tell``: as
        ``KvrayClient.lookup`` takes them (the client's end-of-session hint over ``keys``, which
        names none of the pages looked up when it is past them; False: no store is told of the
        request by this lookup)."""
        keys = list(keys[: self.capacity])
        hint = ends_session_from if ends_session_from < len(keys) else -1
        return self.client.lookup(keys, route_key=route_key, ends_session_from=hint, tell=tell)

    def announce(self, keys: Sequence[int], ends_session_from: int = -1) -> None:
        """Tell this node's store now of the request looked up last, as a request of ``keys``
        with its hint over them (``KvrayClient.announce``): for the vLLM connector, whose worker
        reads and stores with clients of its own."""
        self.client.announce(keys, ends_session_from)

    def release(self, plan) -> None:
        """End a plan's pins without loading anything (the request went away)."""
        from kvray.cluster.protocol import Loaded

        self.client.release(plan, Loaded(0))

    def read(self, keys: Sequence[int], plan) -> tuple[object, np.ndarray]:
        """Bring ``plan``'s cached pages of ``keys`` here, then end its pins. Returns the
        :class:`~kvray.cluster.protocol.Loaded` record and ``[loaded.pages, page_nbytes]``
        uint8 rows, valid until the next call on this instance. A page that did not arrive
        ends the prefix there."""
        from kvray.cluster.protocol import Loaded

        loaded = self.client.load(list(keys[: plan.hit_pages]), plan) if plan.hit_pages else Loaded(0)
        self.client.release(plan, loaded)
        self.pages_by_path.update(loaded.paths)
        self.lost_pages += plan.hit_pages - loaded.pages
        return loaded, self.client.buffer.pages[: loaded.pages]

    # -- PageStore's verbs, as the transformers adapter uses them -------------------------------
    def match(self, keys: Sequence[int]) -> int:
        """Leading pages of ``keys`` the runtime holds (a lookup whose pins end at once)."""
        plan = self.lookup(keys)
        self.release(plan)
        return plan.hit_pages

    def load(self, tokens: Sequence[int] | np.ndarray, salt: str = "", route_key: int | None = None) -> LoadResult:
        """KV of the runtime's longest cached prefix of ``tokens``, like ``PageStore.load``;
        ``route_key`` as for :meth:`lookup`."""
        keys = self.keys(as_token_array(tokens, self.config.max_request_tokens), salt)
        plan = self.lookup(keys, route_key)
        loaded, raw = self.read(keys, plan)
        n, layout = loaded.pages, self.layout
        if n == 0:
            return LoadResult(0, torch.empty(layout.request_shape(0), dtype=torch_dtype(layout)), {})
        pages = torch.from_numpy(raw.copy()).view(torch_dtype(layout)).view(n, *layout.page_shape)
        kv = pages.permute(1, 2, 0, 3, 4, 5).reshape(layout.request_shape(n * layout.page_tokens))
        return LoadResult(n * layout.page_tokens, kv, dict(loaded.by_tier))

    def route_key(self, keys: Sequence[int]) -> int:
        """The key the runtime routes a prompt of ``keys`` (root first) by, as :meth:`lookup`
        asks it: what every save of a part of the prompt carries (``put_pages``'
        ``route_key``), so the part commits to the controller shard the prompt's lookups ask."""
        return self.client.shards.route_key(keys[: self.capacity])

    def put_pages(
        self,
        keys: Sequence[int],
        pages: np.ndarray,
        fingerprint: bytes,
        parent_key: int | None = None,
        route_key: int | None = None,
    ) -> int:
        """Store ``pages`` (``[n, page_nbytes]`` uint8) of one chain on this node, continuing
        ``parent_key``'s chain, a landing buffer at a time; returns pages stored (a store that
        fails stores fewer). ``route_key``: the whole prompt's (:meth:`route_key`), which a
        continuation must carry (its own keys do not say where the chain is routed); None
        with no ``parent_key``: ``keys`` are the chain from its root, routed by themselves."""
        from kvray.cluster.protocol import Plan

        if fingerprint != self.fingerprint.digest:
            raise ConfigError("pages of another model fingerprint cannot be stored under this engine's keys")
        keys = list(keys)
        if route_key is None:
            if parent_key is not None:
                raise RequestError(
                    "put_pages(parent_key=...) continues a chain: pass route_key (RuntimePages.route_key of the prompt)"
                )
            route_key = self.route_key(keys)
        stored, step = 0, self.capacity
        for lo in range(0, len(keys), step):
            chunk = keys[lo : lo + step]
            parent = parent_key if lo == 0 else keys[lo - 1]
            self.client.buffer.pages[: len(chunk)] = pages[lo : lo + len(chunk)]
            placing = Plan.placing([self.node_id] * len(chunk))
            stored += self.client.store(chunk, 0, placing, parent_key=parent, route_key=route_key)
        return stored

    def close(self) -> None:
        self.client.close()
