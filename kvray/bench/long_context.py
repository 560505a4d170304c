"""``kvray bench --only long_context``: the KV of one million-token prompt, stored and reloaded.

A small real layout (4 layers x 2 KV heads x 128, bf16: 4 KiB per token, 512 KiB pages of
128 tokens) makes a 1,000,000-token prefix 4.1 GB in 7,812 pages, one chain. A store whose
host tier holds a quarter of it keeps the rest on disk (the head of the chain: LRU demotes
the oldest pages). The engine has room for one chunk of 64 pages (32 MiB) at a time and
streams the prefix through it (:meth:`PageStore.load_chunks`, read ahead into a second).

Rows, each beside a baseline measured in the same run:

- ``long_context_lookup``: ``PageStore.lookup`` of the whole prompt from its token array
  (chain keys + the index's binary search), against xxh3-128 of the same token bytes in one
  call (the hashing floor); the goal is under 10 ms (``params``).
- ``long_context_lookup_cpu_per_page``: lookup CPU time per page of the whole prompt
  against an eighth of it: a step quadratic in the prefix shows as a ratio near 8 (CPU
  time: on a long run queue a longer call is preempted more, so wall time is superlinear
  whatever the code does; the wall ratio is in ``params``).
- ``long_context_reload_host_vs_memcpy``: the stream's chunks held in the host tier, against
  ``numpy.copyto`` of the same bytes out of the same pool into a chunk buffer (the ratio of
  their CPU times in ``params``).
- ``long_context_reload_disk_vs_raw_read``: the stream's chunks held on disk, page cache
  dropped first (``POSIX_FADV_DONTNEED``), against plain sequential ``preadv`` of the same
  file region into a chunk buffer, cache dropped the same way.
- ``long_context_cross_node_vs_loopback_tcp``: the whole prefix held by another local Ray
  node (its host tier and disk), streamed into this engine's landing buffer by the runtime
  (``KvrayClient.load_chunks``), against raw loopback TCP moving the same bytes.
- ``long_context_controller_pin_vs_empty_call``: ``KvrayClient.lookup`` of the whole prompt
  (the keys to the controller, its lookup + pin of every page, the plan back; the release
  goes without waiting, as in a request), against an empty call to the controller; the goal
  is under 10 ms (``params``).

``KVRAY_LONG_CONTEXT_TOKENS`` overrides the size (``--quick``: 100,000 tokens); the rows also
go to ``results/long_context.json`` with a plot beside it (``KVRAY_BENCH_OUT`` moves them).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import xxhash

from kvray.bench import BenchResult, alternating_medians, benchmark
from kvray.bench.side_by_side import drop_cache
from kvray.core.config import PageLayout, StoreConfig, TierSizes
from kvray.core.errors import ClusterError
from kvray.core.pages import request_bytes
from kvray.core.request_kv import chunk_buffer
from kvray.core.store import PageStore
from kvray.core.tiers import Tier
from kvray.core.tiers.disk import HEADER_BYTES
from kvray.progress import progress_bar

LAYOUT = PageLayout(layers=4, kv_heads=2, head_dim=128, page_tokens=128, dtype="bfloat16")
FULL_TOKENS, QUICK_TOKENS = 1_000_000, 100_000
CHUNK_PAGES = 64  # 32 MiB: what the engine has room for at once
LOOKUP_GOAL_MS = 10.0
PIN_GOAL_MS = 10.0  # the client's lookup + pin of the whole prompt at the controller, and its release


def _tokens(quick: bool) -> int:
    return int(os.environ.get("KVRAY_LONG_CONTEXT_TOKENS", QUICK_TOKENS if quick else FULL_TOKENS))


def _chunks(pages: int) -> Iterator[tuple[int, int]]:
    for start in range(0, pages, CHUNK_PAGES):
        yield start, min(start + CHUNK_PAGES, pages)


def _page_block(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (CHUNK_PAGES, LAYOUT.page_nbytes), dtype=np.uint8)


def _stamped(block: np.ndarray, start: int, stop: int) -> np.ndarray:
    """The pages ``start..stop`` of the prompt: a random block with each page's number in its
    first 8 bytes, so that a page delivered in the wrong place shows."""
    pages = block[: stop - start]
    pages[:, :8] = np.arange(start, stop, dtype="<u8")[:, None].view(np.uint8)
    return pages


class _LongPrefix:
    """One store holding the prompt: a quarter in the host tier, the rest on disk."""

    def __init__(self, tokens: int, directory: str) -> None:
        self.pages = tokens // LAYOUT.page_tokens
        host = self.pages // 4
        config = StoreConfig(
            layout=LAYOUT,
            tiers=TierSizes(host=host, disk=self.pages - host + CHUNK_PAGES),
            disk_dir=directory,
            max_request_tokens=tokens,
        )
        self.store = PageStore(config)
        chunk_tokens = CHUNK_PAGES * LAYOUT.page_tokens
        self.buffers = (chunk_buffer(LAYOUT, chunk_tokens), chunk_buffer(LAYOUT, chunk_tokens))  # the engine's
        self.tokens = np.random.default_rng(0).integers(0, 128_000, tokens, dtype=np.int32)
        self.keys = self.store.keys(self.tokens)
        block = _page_block(1)
        t0 = time.perf_counter()
        with progress_bar(self.pages, "storing the prompt") as tick:
            for start, stop in _chunks(self.pages):
                self._store(block, start, stop)
                tick(stop - 1)
        self.store_s = time.perf_counter() - t0
        index = self.store.manager.index
        handles = index.lookup(self.keys)
        self.tiers = index.tier[handles].copy()
        self.disk = self.store.pools[Tier.DISK]

    def _store(self, block: np.ndarray, start: int, stop: int) -> None:
        parent = self.keys[start - 1] if start else None
        stored = self.store.put_pages(
            self.keys[start:stop], _stamped(block, start, stop), self.store.fingerprint.digest, parent_key=parent
        )
        assert stored == stop - start, f"stored {stored} of pages {start}..{stop}"

    def stream(self) -> dict[str, float]:
        """Stream the whole prefix; seconds spent on chunks wholly on disk, wholly on host
        (and the process's CPU seconds on the host ones: ``host_cpu``)."""
        spent = {"disk": 0.0, "host": 0.0, "host_cpu": 0.0}
        moved = 0
        t0, c0 = time.perf_counter(), time.process_time()
        for chunk in self.store.load_chunks(self.tokens, CHUNK_PAGES * LAYOUT.page_tokens, out=self.buffers):
            now = time.perf_counter()
            first = chunk.start // LAYOUT.page_tokens
            stamps = request_bytes(chunk.kv)[0, 0, :: LAYOUT.page_tokens, :8].copy().view("<u8").ravel()
            assert (stamps == np.arange(first, first + len(stamps))).all(), "a page came back in the wrong place"
            if len(chunk.pages_by_tier) == 1:
                tier = next(iter(chunk.pages_by_tier))
                spent[tier] += now - t0
                if tier == "host":
                    spent["host_cpu"] += time.process_time() - c0
            moved += chunk.tokens
            t0, c0 = time.perf_counter(), time.process_time()
        assert moved == self.pages * LAYOUT.page_tokens, f"streamed {moved} tokens of {self.pages * LAYOUT.page_tokens}"
        return spent

    def pure_pages(self, tier: Tier) -> int:
        """Pages in the chunks wholly held by ``tier`` (what :meth:`stream` times for it)."""
        return sum(stop - start for start, stop in _chunks(self.pages) if (self.tiers[start:stop] == int(tier)).all())

    def close(self) -> None:
        self.store.close()


def _lookup_rows(prefix: _LongPrefix, quick: bool) -> list[BenchResult]:
    tokens, pages = prefix.tokens, prefix.pages
    eighth = tokens[: len(tokens) // 8]
    whole, part, floor = alternating_medians(
        lambda: prefix.store.lookup(tokens),
        lambda: prefix.store.lookup(eighth),
        lambda: xxhash.xxh3_128_digest(tokens.data),
        repeats=7 if quick else 15,
    )
    match = statistics.median(_timed(lambda: prefix.store.match(prefix.keys)) for _ in range(15))
    whole_cpu = statistics.median(_cpu_timed(lambda: prefix.store.lookup(tokens)) for _ in range(15))
    part_cpu = statistics.median(_cpu_timed(lambda: prefix.store.lookup(eighth)) for _ in range(15))
    label = f"{len(tokens) // 1000}k tokens"
    return [
        BenchResult(
            f"long_context_lookup_vs_xxh3[{label}]",
            whole * 1e3,
            floor * 1e3,
            "ms",
            None,
            {
                "pages": pages,
                "goal_ms": LOOKUP_GOAL_MS,
                "under_goal": whole * 1e3 < LOOKUP_GOAL_MS,
                "cpu_ms": whole_cpu * 1e3,
                "match_of_keys_ms": match * 1e3,
            },
        ),
        BenchResult(
            f"long_context_lookup_cpu_per_page[{label} vs an eighth]",
            whole_cpu / pages * 1e6,
            part_cpu / (pages // 8) * 1e6,
            "us",
            "<= 2.0",
            {"pages": pages, "wall_ratio": (whole / pages) / (part / (pages // 8))},
        ),
    ]


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _cpu_timed(fn) -> float:
    """The process's CPU seconds for ``fn``: on a machine whose run queue is long, wall time
    mostly measures waiting for a core, the longer the operation the more."""
    c0 = time.process_time()
    fn()
    return time.process_time() - c0


def _reload_rows(prefix: _LongPrefix, quick: bool) -> list[BenchResult]:
    host_pages, disk_pages = prefix.pure_pages(Tier.HOST), prefix.pure_pages(Tier.DISK)
    chunk = np.empty((CHUNK_PAGES, LAYOUT.page_nbytes), dtype=np.uint8)
    host_rows = prefix.store.pools[Tier.HOST]._array  # the pool's own memory: the memcpy source

    def memcpy() -> None:
        for start in range(0, host_pages, CHUNK_PAGES):
            rows = host_rows[start : min(start + CHUNK_PAGES, host_pages)]
            np.copyto(chunk[: len(rows)], rows)

    stride = prefix.disk.stride
    region = (HEADER_BYTES, disk_pages * stride)  # where the disk pages' slots lie in the file

    def raw_read() -> None:
        drop_cache([prefix.disk.path])
        fd = os.open(prefix.disk.path, os.O_RDONLY)
        try:
            offset, end = region
            view = memoryview(chunk).cast("B")
            while offset < end:
                offset += os.preadv(fd, [view[: min(len(view), end - offset)]], offset)
        finally:
            os.close(fd)

    runs: list[dict[str, float]] = []

    def stream() -> None:
        drop_cache([prefix.disk.path])
        runs.append(prefix.stream())

    _, raw_s, memcpy_s = alternating_medians(stream, raw_read, memcpy, repeats=3 if quick else 5)
    disk_s = statistics.median(r["disk"] for r in runs)
    host_s = statistics.median(r["host"] for r in runs)
    host_cpu_s = statistics.median(r["host_cpu"] for r in runs)
    memcpy_cpu_s = statistics.median(_cpu_timed(memcpy) for _ in range(3 if quick else 5))
    raw_bytes = region[1] - region[0]
    nbytes = LAYOUT.page_nbytes
    return [
        BenchResult(
            f"long_context_reload_host_vs_memcpy[{host_pages} pages]",
            host_pages * nbytes / host_s / 1e9,
            host_pages * nbytes / memcpy_s / 1e9,
            "GB/s",
            ">= 0.8",
            {"pages": host_pages, "chunk_pages": CHUNK_PAGES, "cpu_time_ratio": memcpy_cpu_s / host_cpu_s},
        ),
        BenchResult(
            f"long_context_reload_disk_vs_raw_read[{disk_pages} pages]",
            disk_pages * nbytes / disk_s / 1e9,
            raw_bytes / raw_s / 1e9,
            "GB/s",
            ">= 0.8",
            {"pages": disk_pages, "chunk_pages": CHUNK_PAGES, "page_cache": "dropped before each pass"},
        ),
    ]


def _cross_node_rows(tokens: int, directory: str, quick: bool) -> list[BenchResult]:
    import ray

    from kvray.bench.runtime import _LoopbackTCP
    from kvray.cluster import KvrayClient, RayConnection, Runtime, RuntimeConfig
    from kvray.cluster.protocol import Loaded, Plan

    pages = tokens // LAYOUT.page_tokens
    host = pages // 4
    with RayConnection(nodes=2, object_store_mb=200):
        config = RuntimeConfig(
            name="longctx",
            layout=LAYOUT,
            tiers=TierSizes(host=host, disk=pages - host + CHUNK_PAGES),
            disk_root=directory,
            max_request_pages=pages,
            collective=False,
        )
        runtime = Runtime.start(config)
        client = KvrayClient.connect(config.name, buffer_pages=CHUNK_PAGES)
        try:
            there = next(n for n in runtime.stores if n != client.node_id)
            keys = client.keys_for_trace(list(range(pages)))
            block = _page_block(2)
            with progress_bar(pages, "storing the prompt on the other node") as tick:
                for start, stop in _chunks(pages):
                    client.buffer.pages[: stop - start] = _stamped(block, start, stop)
                    parent = keys[start - 1] if start else None
                    part, placing = keys[start:stop], Plan.placing([there] * (stop - start))
                    client.store(part, 0, placing, parent_key=parent, route_key=client.shards.route_key(keys))
                    tick(stop - 1)
            ray.get(runtime.controller.snapshot.remote())  # every commit has landed

            def stream() -> None:
                plan = client.lookup(keys)
                total = Loaded(0)
                for start, loaded in client.load_chunks(keys, plan):
                    first = client.buffer.pages[: loaded.pages, :8].copy().view("<u8").ravel()
                    assert (first == np.arange(start, start + loaded.pages)).all(), "a page came back in the wrong place"
                    total.merge(loaded)
                client.release(plan, total)
                assert total.pages == pages, f"streamed {total.pages} of {pages} pages"

            tcp = _LoopbackTCP(CHUNK_PAGES * LAYOUT.page_nbytes)

            def loopback() -> None:
                for _ in _chunks(pages):
                    tcp.move()

            kvray_s, base_s = alternating_medians(stream, loopback, repeats=3 if quick else 5)

            pins: list[float] = []  # the lookup alone: its release is sent without waiting

            def pin() -> None:
                t0 = time.perf_counter()
                plan = client.lookup(keys)
                pins.append(time.perf_counter() - t0)
                assert plan.hit_pages == pages, f"pinned {plan.hit_pages} of {pages} pages"
                client.release(plan, Loaded(0))
                client.settle()  # untimed: the release has run, so the next pin starts from none

            _, empty_s = alternating_medians(
                pin, lambda: ray.get(runtime.controller.runtime_config.remote()), repeats=7 if quick else 15
            )
            pin_s = statistics.median(pins[1:])  # after the warm-up
            tcp.close()
        finally:
            client.close()
            runtime.close()
    nbytes = pages * LAYOUT.page_nbytes
    return [
        BenchResult(
            f"long_context_cross_node_vs_loopback_tcp[{tokens // 1000}k tokens]",
            nbytes / kvray_s / 1e9,
            nbytes / base_s / 1e9,
            "GB/s",
            None,
            {"pages": pages, "chunk_pages": CHUNK_PAGES, "path": "tcp"},
        ),
        BenchResult(
            f"long_context_controller_pin_vs_empty_call[{pages} pages]",
            pin_s * 1e3,
            empty_s * 1e3,
            "ms",
            None,
            {"pages": pages, "goal_ms": PIN_GOAL_MS, "under_goal": pin_s * 1e3 < PIN_GOAL_MS},
        ),
    ]


def _save(results: list[BenchResult]) -> None:
    """The rows as JSON and a plot beside it, in ``KVRAY_BENCH_OUT`` (default ``results``)."""
    out = Path(os.environ.get("KVRAY_BENCH_OUT", "results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "long_context.json").write_text(json.dumps([r.as_dict() for r in results], indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results if r.unit == "GB/s"]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    y = np.arange(len(rows))
    ax.barh(y - 0.2, [r.kvray for r in rows], 0.4, label="kvray")
    ax.barh(y + 0.2, [r.baseline for r in rows], 0.4, label="baseline (same run)")
    ax.set_yticks(y, [r.name.replace("long_context_", "") for r in rows], fontsize=7)
    ax.set_xlabel("GB/s")
    ax.set_title("Reloading one long prompt's KV, chunk by chunk")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "long_context.png", dpi=120)
    plt.close(fig)


@benchmark("long_context")
def long_context(quick: bool) -> list[BenchResult]:
    tokens = _tokens(quick)
    results: list[BenchResult] = []
    with tempfile.TemporaryDirectory(prefix="kvray-long-") as directory:
        prefix = _LongPrefix(tokens, os.path.join(directory, "local"))
        try:
            results += _lookup_rows(prefix, quick)
            results += _reload_rows(prefix, quick)
        finally:
            prefix.close()
        _save(results)  # kept if Ray cannot start below
        try:
            results += _cross_node_rows(tokens, os.path.join(directory, "runtime"), quick)
        except ClusterError as exc:  # Ray did not start on a loaded machine: the local rows still count
            print(f"kvray bench: long_context cross-node rows skipped: {exc}", file=sys.stderr)
    _save(results)
    return results
