"""Long prefixes: a streamed load, and no step whose cost per page grows with the prefix.

A million-token prompt is thousands of pages in one chain. Every per-request step (keys,
the index's match and lookup, the chain writer with its slot accounting and demotions,
the reads) must cost the same per page at 2,000 pages as at 16,000: the scaling test
measures CPU time per page at both sizes and fails on a factor a quadratic step would
show (8x between these sizes), with the margin a loaded machine needs.
"""

from __future__ import annotations

import tempfile
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvray.core.config import PageLayout, StoreConfig, TierSizes
from kvray.core.errors import RequestError
from kvray.core.store import PageStore
from kvray.core.tiers import Tier
from tests.conftest import TINY, prefix_kv
from tests.properties import examples

P = TINY.page_tokens
# Pages of 512 bytes: what is timed is the per-page bookkeeping, not memcpy.
SMALL = PageLayout(layers=1, kv_heads=1, head_dim=8, page_tokens=16, dtype="bfloat16")


def _store(tmp: str, host: int, disk: int, layout: PageLayout = TINY) -> PageStore:
    return PageStore(StoreConfig(layout=layout, tiers=TierSizes(host=host, disk=disk), disk_dir=tmp, max_request_tokens=1 << 24))


@settings(max_examples=examples(40), deadline=None)
@given(cached=st.integers(0, 12), asked=st.integers(1, 14), chunk_pages=st.integers(1, 5), host=st.integers(1, 6))
def test_chunks_add_up_to_the_cached_prefix(cached, asked, chunk_pages, host):
    tokens = list(range(1000, 1000 + asked * P + 2))  # a partial page at the end, never loaded
    with tempfile.TemporaryDirectory() as tmp:
        store = _store(tmp, host=host, disk=16)
        kv = prefix_kv(TINY, tokens)
        if cached:
            store.store(tokens[: cached * P], kv[:, :, : cached * P])
        chunks = [(c, c.kv.clone()) for c in store.load_chunks(tokens, chunk_pages * P)]  # kv: valid until the next chunk
        whole = min(cached, asked) * P
        assert [c.start for c, _ in chunks] == list(range(0, whole, chunk_pages * P))
        assert sum(c.tokens for c, _ in chunks) == whole
        streamed = torch.cat([kv for _, kv in chunks], dim=2) if chunks else kv[:, :, :0]
        assert torch.equal(streamed, kv[:, :, :whole])  # bit-exact, through host and disk
        assert sum(sum(c.pages_by_tier.values()) for c, _ in chunks) == whole // P
        store.close()


def test_stream_ends_at_a_page_that_fails_verification():
    tokens = list(range(12 * P))
    with tempfile.TemporaryDirectory() as tmp:
        store = _store(tmp, host=2, disk=16)
        kv = prefix_kv(TINY, tokens)
        store.store(tokens, kv)
        disk = store.pools[Tier.DISK]
        handle = store.manager.index.handle_of(store.keys(tokens)[5])
        slot = int(store.manager.index.slot[handle])
        with open(disk.path, "r+b") as f:  # flip a byte of page 5's KV on disk
            f.seek(slot * disk.stride + 200)
            byte = f.read(1)
            f.seek(slot * disk.stride + 200)
            f.write(bytes([byte[0] ^ 0xFF]))
        chunks = [c.kv.clone() for c in store.load_chunks(tokens, 2 * P)]
        assert torch.equal(torch.cat(chunks, dim=2), kv[:, :, : 5 * P])  # pages 0-4, then the stream ends
        assert store.stats()["corrupt_pages"] == 1
        store.close()


def test_chunk_size_must_be_whole_pages():
    with tempfile.TemporaryDirectory() as tmp:
        store = _store(tmp, host=4, disk=4)
        for bad in (0, -P, P + 1):
            with pytest.raises(RequestError, match="chunk_tokens"):
                next(store.load_chunks(list(range(4 * P)), bad))
        store.close()


def _per_page_cpu(pages: int, disk_pages: int) -> dict[str, float]:
    """CPU seconds per page of each step of storing and reloading one chain of ``pages``
    (host holds a quarter, the disk ``disk_pages``: the rest, or too few)."""
    tokens = np.arange(pages * SMALL.page_tokens, dtype=np.int32)
    spent: dict[str, float] = {}

    def timed(step: str, fn, repeats: int = 1):
        best = float("inf")
        for _ in range(repeats):
            t0 = time.process_time()
            out = fn()
            best = min(best, time.process_time() - t0)
        spent[step] = best / pages
        return out

    with tempfile.TemporaryDirectory() as tmp:
        store = _store(tmp, host=pages // 4, disk=disk_pages, layout=SMALL)
        keys = timed("keys", lambda: store.keys(tokens), repeats=3)
        pages_bytes = np.zeros((pages, SMALL.page_nbytes), dtype=np.uint8)
        timed("store_chain", lambda: store.put_pages(keys, pages_bytes, store.fingerprint.digest))
        held = min(pages, pages // 4 + disk_pages)
        assert len(store) == held and store.match(keys) == held
        timed("match", lambda: [store.match(keys) for _ in range(100)], repeats=3)
        with store._lock:
            timed("index_lookup", lambda: store.manager.lookup(keys, count=False), repeats=3)
        out = np.empty_like(pages_bytes)
        got, _ = timed(
            "read_pages", lambda: store.read_pages(keys, lambda i: out[i]), repeats=3
        )  # best of 3: other threads of the process (Ray's, in a shared session) add CPU time
        assert got == held
        store.close()
    return spent


@pytest.mark.parametrize("disk_share", [1.0, 0.5], ids=["fits", "longer_than_the_cache"])
def test_no_step_grows_with_the_prefix(disk_share):
    small, large = 2_000, 16_000
    a = _per_page_cpu(small, int(small * disk_share))
    b = _per_page_cpu(large, int(large * disk_share))
    floor = 2e-7  # steps far below a microsecond per page are noise at either size
    slower = {step: (b[step] + floor) / (a[step] + floor) for step in a}
    assert max(slower.values()) < 3.0, f"per-page CPU time at {large} vs {small} pages: {slower}"
