"""A replay engine: one per node, serving trace requests through the client API.

It plays the part of an inference engine on its node: for each request it looks up and
loads the cached prefix (into its landing buffer), computes the rest (a calibrated
:class:`~kvray.apps.prefill.PrefillWorkload` plus writing the KV pages), which gives
the time to first token, then stores the new pages and waits until its reports have
landed (``KvrayClient.settle``, after the time is taken), so the next request, on any
node, finds the cache as this one left it, as in the simulator. Page bytes are deterministic in the
page key (:class:`~kvray.cluster.checked.PagePattern`), so every loaded page is checked
against what it must contain: a wrong page is counted, never silently used.

The cluster policy's verbs for the request (``Controller.decide``, asked by the driver)
arrive with it: ``load_pages`` loads only that much of the cached prefix and recomputes
the rest; ``prefetch`` starts the lookup and load before the request takes the node's
prefill engine (``_engine``, held while computing), otherwise they run once it has it;
``replicate`` names the nodes that keep a copy of the cached prefix afterwards: the landing
buffer holds all of it by then (the loaded pages and the ones recomputed), and it goes from
there to each named node's store (``KvrayClient.replicate``). The
driver sends one request at a time, so nothing waits for the engine here and prefetch
changes the order of the steps, not the measured time.

With ``cache=False`` the engine never looks up or stores pages: it recomputes every
prompt, as an engine without kvray does, which is the baseline kvray is measured against.

Example::

    engine = ReplayEngineActor.options(scheduling_strategy=on_node(node)).remote("kvray", 5.0)
    ray.get(engine.serve.remote(request.hash_ids, request.input_length))
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence

import numpy as np
import ray

from kvray.apps.prefill import PrefillWorkload
from kvray.cluster.checked import PagePattern
from kvray.cluster.client import KvrayClient
from kvray.traces import full_blocks


class ReplayEngine:
    """Serves requests on its node; see the module docstring."""

    def __init__(self, runtime_name: str, us_per_token: float, cache: bool = True) -> None:
        self.cache = cache
        self.client = KvrayClient.connect(runtime_name)
        self.page_tokens = self.client.config.layout.page_tokens
        self.pattern = PagePattern(self.client.page_nbytes)
        # Writing the computed KV is part of a prefill's cost per token (an engine's forward
        # pass writes it), so the matmul gets what is left of ``us_per_token`` after it.
        self.prefill = PrefillWorkload(max(us_per_token - self._kv_write_us_per_token(), 0.0))
        self._engine = threading.Lock()  # the node's prefill engine: one request computes at a time

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

    def serve(
        self,
        hash_ids: list[int],
        input_length: int,
        load_pages: int | None = None,
        prefetch: bool = False,
        replicate: Sequence[str] = (),
        arrival_ms: float | None = None,
        ends_session_from: int = -1,
    ) -> dict:
        """Serve one request as the cluster policy decided (see the module docstring);
        returns its measured TTFT, what the cache gave it and what each verb did.
        ``arrival_ms``: the trace's arrival time, the clock the stores' policies are told
        (as the simulator tells them; None: the stores' own clocks); ``ends_session_from``:
        its client's end-of-session hint (``KvrayClient.request``)."""
        t0 = time.perf_counter()
        keys = self.client.keys_for_trace(full_blocks(hash_ids, input_length, self.page_tokens))
        if not (keys and self.cache):  # nothing to look up: every page computed, none stored
            ttft, compute, _ = self._compute(keys, 0, self.client.buffer.pages, input_length, t0)
            return self._served(ttft, compute, input_length, {}, wrong=0)
        # The driver sends a request only when the last one is done: nothing queues here.
        with contextlib.ExitStack() as steps:
            if not prefetch:
                steps.enter_context(self._engine)
            r = steps.enter_context(
                self.client.request(
                    keys, backlog_ms=0.0, load_pages=load_pages, arrival_ms=arrival_ms, ends_session_from=ends_session_from
                )
            )
            if prefetch:
                steps.enter_context(self._engine)
            ttft, compute, wrong = self._compute(keys, r.hit, r.rows, input_length, t0)
            r.store()
        # the buffer holds the whole cached prefix: rows 0..hit loaded, the rest of it recomputed
        copies = self.client.replicate(keys, r.plan, r.loaded, replicate, pages=r.plan.hit_pages) if replicate else {}
        self.client.settle()
        served = self._served(ttft, compute, input_length, r.loaded.by_tier, wrong)
        served["verbs"] = {
            "prefetched_pages": r.hit if prefetch else 0,
            "recomputed_hit_pages": r.recomputed,
            "replicated_pages": sum(copies.values()),
            "replicated_pages_by_node": copies,
        }
        return served

    def _compute(self, keys: list[int], hit: int, rows: np.ndarray, input_length: int, t0: float) -> tuple[float, float, int]:
        """Prefill the tokens past the ``hit`` pages and write their KV pages into ``rows``;
        returns (TTFT since ``t0``, compute time, loaded pages with wrong bytes)."""
        computing = time.perf_counter()
        self.prefill.run(input_length - hit * self.page_tokens)
        self.pattern.fill_rows(keys[hit:], rows[hit : len(keys)])
        done = time.perf_counter()
        return done - t0, done - computing, self.pattern.wrong(keys[:hit], rows)

    def _served(self, ttft: float, compute: float, tokens: int, hit_pages_by_tier: dict[str, int], wrong: int) -> dict:
        return {
            "ttft_s": ttft,
            "compute_s": compute,
            "tokens": tokens,
            "hit_tokens_by_tier": {tier: n * self.page_tokens for tier, n in hit_pages_by_tier.items()},
            "wrong_pages": wrong,
        }

    def close(self) -> None:
        self.client.close()


ReplayEngineActor = ray.remote(max_restarts=0)(ReplayEngine)
