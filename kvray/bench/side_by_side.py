"""The kvray-vs-LMCache workload and its timing, shared by both sides of ``kvray bench --only lmcache``.

Each side runs in its own interpreter (LMCache lives in a separate environment), so this
module imports neither kvray nor LMCache: a side is an object with the verbs below, and
:func:`main` runs every row against it and prints one JSON object. Both sides thus time
exactly the same calls in the same order on the same tokens.

Rows: host store into a fresh process's pool, host store into a pool already used, host
retrieve (per-request p50 and p99), lookup from a numpy array and from a Python list,
disk store (until the bytes are written), disk retrieve with the page cache warm, and
cold (the cache dropped for the side's own files with ``POSIX_FADV_DONTNEED``).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import numpy as np

LAYERS, KV_HEADS, HEAD_DIM, CHUNK_TOKENS = 8, 8, 128, 256
PROMPT_TOKENS, SHARED_TOKENS = 2048, 1024
REQUEST_BYTES = LAYERS * 2 * PROMPT_TOKENS * KV_HEADS * HEAD_DIM * 2  # bf16


def workload(prompts: int, seed: int = 0) -> np.ndarray:
    """``[prompts, 2048]`` int32 token ids, in pairs whose first 1,024 tokens agree."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 30_000, (prompts, PROMPT_TOKENS), dtype=np.int32)
    tokens[1::2, :SHARED_TOKENS] = tokens[0::2, :SHARED_TOKENS]
    return tokens


def unique_chunks(prompts: int) -> int:
    """Chunks a cache holds after storing :func:`workload`: a pair shares its first half."""
    per_prompt, shared = PROMPT_TOKENS // CHUNK_TOKENS, SHARED_TOKENS // CHUNK_TOKENS
    return prompts * per_prompt - (prompts // 2) * shared


class Side(Protocol):
    """One cache under test. ``tokens`` is an int32 array (a Python list too for ``lookup``).

    A side's output buffer is written once before any row is timed, like an engine's KV
    buffers, which are resident long before a load: left untouched, the first retrieve
    pays its page faults (~200 ms for 64 MiB here, more under load), and that one request
    was the p99 of both sides.
    """

    def open_host(self, chunks: int) -> None: ...
    def open_disk(self, directory: str, chunks: int) -> None: ...
    def store(self, tokens: np.ndarray) -> None: ...
    def flush(self) -> None: ...
    def retrieve(self, tokens: np.ndarray) -> int: ...
    def lookup(self, tokens: np.ndarray | list[int]) -> int: ...
    def files(self) -> list[str]: ...
    def close(self) -> None: ...


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def drop_cache(paths: list[str | Path]) -> None:
    """Evict these files' pages from the page cache (no root-wide drop_caches)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _retrieve_rows(side: Side, tokens: np.ndarray, prefix: str) -> dict[str, float]:
    """Retrieve every prompt once: throughput and per-request p50 / p99 latency."""
    times = []
    for row in tokens:
        t0 = time.perf_counter()
        got = side.retrieve(row)
        times.append(time.perf_counter() - t0)
        if got != PROMPT_TOKENS:
            raise RuntimeError(f"{prefix}: retrieved {got} of {PROMPT_TOKENS} tokens")
    return {
        f"{prefix}_gbps": len(tokens) * REQUEST_BYTES / sum(times) / 1e9,
        f"{prefix}_p50_ms": float(np.percentile(times, 50)) * 1e3,
        f"{prefix}_p99_ms": float(np.percentile(times, 99)) * 1e3,
    }


def measure(side: Side, tokens: np.ndarray, directory: str) -> dict[str, float]:
    """Every row, in order, on one side (a fresh process: the first store is its first)."""
    prompts = len(tokens)
    chunks = unique_chunks(prompts)
    gb = prompts * REQUEST_BYTES / 1e9
    rows: dict[str, float] = {"host_open_s": _timed(lambda: side.open_host(2 * chunks))}
    rows["host_store_fresh_gbps"] = gb / _timed(lambda: [side.store(t) for t in tokens])
    recent = tokens + 1  # new keys: the pool's slots have all been written once
    rows["host_store_touched_gbps"] = gb / _timed(lambda: [side.store(t) for t in recent])
    rows.update(_retrieve_rows(side, recent, "host_retrieve"))
    for name, inputs in (("lookup_array_us", list(recent)), ("lookup_list_us", [t.tolist() for t in recent])):
        calls = [_timed(lambda q=q: side.lookup(q)) for _ in range(5) for q in inputs]
        rows[name] = statistics.median(calls) * 1e6
    side.close()
    side.open_disk(directory, chunks)
    rows["disk_store_gbps"] = gb / _timed(lambda: ([side.store(t) for t in tokens], side.flush()))
    rows.update(_retrieve_rows(side, tokens, "disk_retrieve_warm"))
    drop_cache(side.files())
    rows.update(_retrieve_rows(side, tokens, "disk_retrieve_cold"))
    side.close()
    return rows


def main(make_side: Callable[[], Side]) -> None:
    """``<python> <side script> TOKENS.npy DIR``: print :func:`measure`'s rows as JSON."""
    tokens = np.load(sys.argv[1])
    print(json.dumps(measure(make_side(), tokens, sys.argv[2])))
