"""Load: request throughput and p99 latency of one PageStore shared by 1, 4 and 16
client threads storing and loading overlapping prefixes.

Baseline: the simplest correct thread-safe cache of the same pages, a dict of page bytes
behind one lock, serving the same requests (no tiers, no checksums, no eviction).
"""

from __future__ import annotations

import statistics
import threading
import time

import numpy as np
import torch

from kvray.bench import BenchResult, benchmark
from kvray.core.config import PageLayout, StoreConfig, TierSizes
from kvray.core.keys import page_keys
from kvray.core.store import PageStore

LAYOUT = PageLayout(layers=8, kv_heads=8, head_dim=128, page_tokens=64, dtype="bfloat16")  # 2 MiB pages
PROMPTS = 24


class DictCache:
    """One lock, one dict: key -> page bytes."""

    def __init__(self, store: PageStore) -> None:
        self.pages: dict[int, bytes] = {}
        self.lock = threading.Lock()
        self.fp = store.fingerprint

    def store(self, tokens: np.ndarray, kv: torch.Tensor) -> None:
        keys = page_keys(tokens, self.fp)
        with self.lock:
            for i, key in enumerate(keys):
                if key not in self.pages:
                    start = i * LAYOUT.page_tokens
                    self.pages[key] = (
                        kv[:, :, start : start + LAYOUT.page_tokens].contiguous().view(torch.uint8).numpy().tobytes()
                    )

    def load(self, tokens: np.ndarray) -> int:
        keys = page_keys(tokens, self.fp)
        out = []
        with self.lock:
            for key in keys:
                page = self.pages.get(key)
                if page is None:
                    break
                out.append(np.frombuffer(page, dtype=np.uint8).copy())
        return len(out)


def _workload(quick: bool) -> list[tuple[np.ndarray, torch.Tensor]]:
    rng = np.random.default_rng(0)
    system = rng.integers(0, 30000, 4 * LAYOUT.page_tokens, dtype=np.int32)  # shared system prompt
    requests = []
    for _ in range(PROMPTS // (2 if quick else 1)):
        own = rng.integers(0, 30000, int(rng.integers(1, 5)) * LAYOUT.page_tokens, dtype=np.int32)
        tokens = np.concatenate([system, own])
        requests.append((tokens, torch.randn(LAYOUT.request_shape(tokens.size)).to(torch.bfloat16)))
    return requests


def _drive(cache, requests, clients: int, per_client: int) -> tuple[float, float]:
    """Run ``clients`` threads, each storing then loading requests; (requests/s, p99 seconds)."""
    latencies: list[float] = []
    lock = threading.Lock()

    def client(seed: int) -> None:
        rng = np.random.default_rng(seed)
        mine = []
        for _ in range(per_client):
            tokens, kv = requests[int(rng.integers(len(requests)))]
            t0 = time.perf_counter()
            cache.store(tokens, kv)
            cache.load(tokens)
            mine.append(time.perf_counter() - t0)
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=client, args=(seed,)) for seed in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    return len(latencies) / elapsed, statistics.quantiles(latencies, n=100)[98]


@benchmark("load_clients")
def load_clients(quick: bool) -> list[BenchResult]:
    requests = _workload(quick)
    results = []
    for clients in (1, 4, 16):
        per_client = max(2, (48 if quick else 160) // clients)
        store = PageStore(StoreConfig(layout=LAYOUT, tiers=TierSizes(host=96)))
        kv_rps, kv_p99 = _drive(store, requests, clients, per_client)
        base_rps, base_p99 = _drive(DictCache(store), requests, clients, per_client)
        params = {"clients": clients, "requests": clients * per_client, "page_bytes": LAYOUT.page_nbytes}
        results += [
            BenchResult(f"load_throughput[{clients} clients]", kv_rps, base_rps, "requests/s", None, params),
            BenchResult(f"load_p99_latency[{clients} clients]", kv_p99 * 1e3, base_p99 * 1e3, "ms", None, params),
        ]
        store.close()
    return results
