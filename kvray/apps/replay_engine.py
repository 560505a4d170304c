"""A replay engine: one per node, serving trace requests through the client API.

It plays the part of an inference engine on its node: for each request it looks up and
loads the cached prefix (into its landing buffer), computes the rest (a calibrated
:class:`~kvray.apps.prefill.PrefillWorkload` plus writing the KV pages), which gives
the time to first token, then stores the new pages and waits until its reports have
landed (``KvrayClient.settle``, after the time is taken), so the next request, on any
node, finds the cache as this one left it, as in the simulator. Page bytes are deterministic in the
page key (a fixed random pattern XOR the key), so every loaded page is checked against
what it must contain: a wrong page is counted, never silently used.

With ``cache=False`` the engine never looks up or stores pages: it recomputes every
prompt, as an engine without kvray does, which is the baseline kvray is measured against.

Example::

    engine = ReplayEngineActor.options(scheduling_strategy=on_node(node)).remote("kvray", 5.0)
    ray.get(engine.serve.remote(request.hash_ids, request.input_length))
"""

from __future__ import annotations

import time

import numpy as np
import ray
import torch

from kvray.apps.prefill import PrefillWorkload
from kvray.cluster.client import KvrayClient, Loaded
from kvray.core.keys import MASK64
from kvray.traces import full_blocks


class PagePattern:
    """The KV bytes a page must hold: one random page XOR the key's low 64 bits.

    Example::

        pattern = PagePattern(page_nbytes=4096)
        pattern.fill(key, row); pattern.matches(key, row)    # True
    """

    def __init__(self, page_nbytes: int, seed: int = 0) -> None:
        self.base = np.random.default_rng(seed).integers(0, 2**63, page_nbytes // 8, dtype=np.uint64)
        self._scratch = np.empty_like(self.base)

    def fill(self, key: int, row: np.ndarray) -> None:
        np.bitwise_xor(self.base, np.uint64(key & MASK64), out=row.view(np.uint64))

    def matches(self, key: int, row: np.ndarray) -> bool:
        np.bitwise_xor(row.view(np.uint64), self.base, out=self._scratch)
        return bool((self._scratch == np.uint64(key & MASK64)).all())


class ReplayEngine:
    """Serves requests on its node; see the module docstring."""

    def __init__(self, runtime_name: str, us_per_token: float, cache: bool = True) -> None:
        torch.set_num_threads(1)
        self.cache = cache
        self.client = KvrayClient.connect(runtime_name)
        self.page_tokens = self.client.config.layout.page_tokens
        self.pattern = PagePattern(self.client.page_nbytes)
        # Writing the computed KV is part of a prefill's cost per token (an engine's forward
        # pass writes it), so the matmul gets what is left of ``us_per_token`` after it.
        self.prefill = PrefillWorkload(max(us_per_token - self._kv_write_us_per_token(), 0.0))

    def _kv_write_us_per_token(self) -> float:
        """The fastest of a few timed page fills, per token (as the matmul is calibrated)."""
        row = np.empty(self.client.page_nbytes, dtype=np.uint8)
        times = []
        for key in range(8):
            t0 = time.perf_counter()
            self.pattern.fill(key, row)
            times.append(time.perf_counter() - t0)
        return min(times[1:]) * 1e6 / self.page_tokens

    def node_id(self) -> str:
        return self.client.node_id

    def refresh(self) -> None:
        self.client.refresh()

    def serve(self, hash_ids: list[int], input_length: int) -> dict:
        """Serve one request; returns its measured TTFT and what the cache gave it."""
        t0 = time.perf_counter()
        keys = self.client.keys_for_trace(full_blocks(hash_ids, input_length, self.page_tokens))
        plan, loaded = None, Loaded(0)
        try:
            if keys and self.cache:
                # The driver sends a request only when the last one is done: nothing queues here.
                plan = self.client.lookup(keys, backlog_ms=0.0)
                loaded = self.client.load(keys, plan)
            hit = loaded.pages
            rows = self.client.buffer.pages  # after the load: it may have moved to a fresh buffer
            computing = time.perf_counter()
            self.prefill.run(input_length - hit * self.page_tokens)
            for i in range(hit, len(keys)):
                self.pattern.fill(keys[i], rows[i])
            done = time.perf_counter()
            ttft, compute = done - t0, done - computing
            wrong = sum(not self.pattern.matches(keys[i], rows[i]) for i in range(hit))
            del rows  # no view of the buffer may outlive a store call (it may move to a fresh one)
        finally:  # even if the load raised: a lease never released pins its pages until it expires
            if plan is not None:
                self.client.release(plan, loaded)
        if plan is not None:
            self.client.store(keys, hit, plan)
            self.client.settle()
        return {
            "ttft_s": ttft,
            "compute_s": compute,
            "tokens": input_length,
            "hit_tokens_by_tier": {tier: n * self.page_tokens for tier, n in loaded.by_tier.items()},
            "wrong_pages": wrong,
        }

    def close(self) -> None:
        self.client.close()


ReplayEngineActor = ray.remote(max_restarts=0)(ReplayEngine)
