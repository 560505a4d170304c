"""Host-tier store in a fresh process: the first ``store`` after start-up against memcpy.

A long-running benchmark sees pools the earlier rounds already faulted in; a real engine
stores its first request into a pool nothing has touched yet. Each repetition therefore
starts a new interpreter (``python -m kvray.bench.fresh``) that builds a store, times
its construction (the pool's start-up cost), then times one request's ``store`` and a
plain copy of the same bytes into a resident buffer, in alternating order.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

from kvray.bench import BenchResult, benchmark, child_env
from kvray.core.config import PageLayout, StoreConfig, TierSizes
from kvray.core.pages import request_bytes, request_page
from kvray.core.store import PageStore
from kvray.core.tiers.memory import resident_empty

LAYOUT = PageLayout(layers=4, kv_heads=8, head_dim=128, page_tokens=128, dtype="bfloat16")  # 2 MiB pages
REQUEST_PAGES = 32  # 64 MiB
POOL_PAGES = 512  # 1 GiB: start-up cost per GiB is measured on a whole GiB


def measure(kvray_first: bool) -> dict[str, float]:
    """One fresh-process sample: start-up seconds per GiB, store and memcpy GB/s."""
    tokens = np.arange(REQUEST_PAGES * LAYOUT.page_tokens, dtype=np.int32)
    kv = torch.randn(LAYOUT.request_shape(tokens.size)).to(torch.bfloat16)
    kv_bytes = request_bytes(kv)
    pages = [request_page(LAYOUT, kv_bytes, i) for i in range(REQUEST_PAGES)]
    plain = resident_empty(REQUEST_PAGES, LAYOUT.page_nbytes)
    nbytes = REQUEST_PAGES * LAYOUT.page_nbytes
    t0 = time.perf_counter()
    store = PageStore(StoreConfig(layout=LAYOUT, tiers=TierSizes(host=POOL_PAGES)))
    startup = time.perf_counter() - t0

    def ours() -> float:
        t = time.perf_counter()
        assert store.store(tokens, kv) == REQUEST_PAGES
        return time.perf_counter() - t

    def memcpy() -> float:
        t = time.perf_counter()
        for i, page in enumerate(pages):
            np.copyto(plain[i].reshape(page.shape), page)
        return time.perf_counter() - t

    first, second = (ours, memcpy) if kvray_first else (memcpy, ours)
    a, b = first(), second()
    t_ours, t_copy = (a, b) if kvray_first else (b, a)
    store.close()
    gib = POOL_PAGES * LAYOUT.page_nbytes / (1 << 30)
    return {"startup_ms_per_gib": startup * 1e3 / gib, "store_gbps": nbytes / t_ours / 1e9, "memcpy_gbps": nbytes / t_copy / 1e9}


def sample(kvray_first: bool) -> dict[str, float]:
    """Run :func:`measure` in a new interpreter with this checkout first on the path."""
    out = subprocess.run([sys.executable, "-m", "kvray.bench.fresh", str(int(kvray_first))],
                         capture_output=True, text=True, check=True, env=child_env())  # fmt: skip
    return json.loads(out.stdout)


@benchmark("host_store_fresh_process")
def host_store_fresh_process(quick: bool) -> list[BenchResult]:
    runs = [sample(kvray_first=i % 2 == 0) for i in range(4 if quick else 6)]
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    params = {"page_bytes": LAYOUT.page_nbytes, "pages": REQUEST_PAGES, "pool_pages": POOL_PAGES,
              "startup_ms_per_gib": round(med["startup_ms_per_gib"], 1), "processes": len(runs)}  # fmt: skip
    return [
        BenchResult("host_store_fresh_process_vs_memcpy[2MiB]", med["store_gbps"], med["memcpy_gbps"], "GB/s", ">= 0.8", params)
    ]


if __name__ == "__main__":
    print(json.dumps(measure(kvray_first=sys.argv[1] == "1")))
