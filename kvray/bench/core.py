"""Benchmarks of the in-process core: tiers against memcpy and raw file I/O, the prefix
index against a plain dict walk, and key hashing against xxh3 alone.

Every kvray figure goes through the public request path (``PageStore.store`` / ``load``:
keys, index, slot reservation, packing and checksums included); every baseline moves the
same bytes with nothing but the primitive. kvray and baseline runs alternate.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable

import numpy as np
import torch
import xxhash

from kvray.bench import BenchResult, alternating_medians, benchmark
from kvray.core.config import PageLayout, StoreConfig, TierSizes
from kvray.core.index import ROOT, PrefixIndex
from kvray.core.keys import ModelFingerprint, page_keys
from kvray.core.pages import request_bytes, request_page, runs
from kvray.core.store import PageStore
from kvray.core.tiers.memory import aligned_empty

# Llama-3-8B-like pages (8 KV heads x 128, bf16, 128 tokens): 4 layers = 2 MiB, 32 layers = 16 MiB.
PAGE_LAYERS = {"2MiB": 4, "16MiB": 32}
REQUEST_MIB = 64


def _layout(layers: int) -> PageLayout:
    return PageLayout(layers=layers, kv_heads=8, head_dim=128, page_tokens=128, dtype="bfloat16")


class _TierCase:
    """A store holding one request's pages in one tier, and the same bytes for the baselines.

    The baselines move exactly the bytes kvray moves, from and to the same engine tensors
    (one primitive call per page: ``np.copyto`` of the page's view, ``pwritev`` /
    ``preadv`` of its contiguous runs), so a ratio is kvray's own cost (keys, index,
    slots, headers, checksums) over the raw movement. A second baseline copies the same
    number of bytes between page-aligned contiguous numpy buffers, the best case of the
    primitive; it is reported in ``params``.
    """

    def __init__(self, layers: int, tier: str, directory: str | None, quick: bool, fsync: bool = False) -> None:
        self.layout = _layout(layers)
        self.pages = max(2, ((REQUEST_MIB // (2 if quick else 1)) << 20) // self.layout.page_nbytes)
        tokens = self.pages * self.layout.page_tokens
        config = StoreConfig(layout=self.layout, tiers=TierSizes(**{tier: self.pages}), disk_dir=directory, disk_fsync=fsync)
        self.store = PageStore(config)
        self.tokens = np.arange(tokens, dtype=np.int32) % 30000
        self.kv = torch.randn(self.layout.request_shape(tokens)).to(torch.bfloat16)
        self.out = torch.empty_like(self.kv)
        self.round = 0
        self.nbytes = self.pages * self.layout.page_nbytes
        kv_bytes, out_bytes = request_bytes(self.kv), request_bytes(self.out)
        self.kv_pages = [request_page(self.layout, kv_bytes, i) for i in range(self.pages)]
        self.out_pages = [request_page(self.layout, out_bytes, i) for i in range(self.pages)]
        self.plain = aligned_empty(self.pages, self.layout.page_nbytes)  # a baseline's own slots
        self.plain[:] = 1
        self.plain_pages = [self.plain[i].reshape(self.kv_pages[i].shape) for i in range(self.pages)]
        self.contiguous_src = aligned_empty(self.pages, self.layout.page_nbytes)
        self.contiguous_src[:] = 2
        self.params = {"page_bytes": self.layout.page_nbytes, "pages": self.pages}

    def write(self) -> None:
        self.round += 1  # a fresh tenant salt: new keys, so every round really writes
        assert self.store.store(self.tokens, self.kv, salt=str(self.round)) == self.pages

    def read(self) -> None:
        assert self.store.load(self.tokens, salt=str(self.round), out=self.out).tokens == len(self.tokens)

    def gbps(self, seconds: float) -> float:
        return self.nbytes / seconds / 1e9

    def result(
        self,
        name: str,
        kvray: Callable[[], None],
        baseline: Callable[[], None],
        contiguous: Callable[[], None],
        repeats: int,
        **params,
    ) -> BenchResult:
        ours, base, best = alternating_medians(kvray, baseline, contiguous, repeats=repeats)
        params = {
            **self.params,
            **params,
            "contiguous_baseline_gbps": round(self.gbps(best), 2),
            "ratio_vs_contiguous": round(best / ours, 3),
        }
        return BenchResult(name, self.gbps(ours), self.gbps(base), "GB/s", ">= 0.8", params)


@benchmark("host_tier_vs_memcpy")
def host_tier(quick: bool) -> list[BenchResult]:
    results = []
    repeats = 7 if quick else 21
    for label, layers in PAGE_LAYERS.items():
        case = _TierCase(layers, "host", None, quick)

        def copy_in() -> None:
            for i in range(case.pages):
                np.copyto(case.plain_pages[i], case.kv_pages[i])

        def copy_out() -> None:
            for i in range(case.pages):
                np.copyto(case.out_pages[i], case.plain_pages[i])

        def contiguous() -> None:
            for i in range(case.pages):
                np.copyto(case.plain[i], case.contiguous_src[i])

        results += [
            case.result(f"host_tier_write_vs_memcpy[{label}]", case.write, copy_in, contiguous, repeats),
            case.result(f"host_tier_read_vs_memcpy[{label}]", case.read, copy_out, contiguous, repeats),
        ]
        case.store.close()
    return results


@benchmark("disk_tier_vs_raw_file")
def disk_tier(quick: bool) -> list[BenchResult]:
    """Page by page, both sides with the same durability: buffered (page-cache resident,
    no fsync; writes and reads), and durable writes (each page ``fdatasync``'d, as
    ``StoreConfig.disk_fsync`` does)."""
    results = []
    for fsync in (False, True):
        repeats = 5 if fsync else (7 if quick else 15)
        for label, layers in PAGE_LAYERS.items():
            with tempfile.TemporaryDirectory(prefix="kvray-bench-") as tmp:
                case = _TierCase(layers, "disk", os.path.join(tmp, "tier"), quick, fsync=fsync)
                fd = os.open(os.path.join(tmp, "raw.bin"), os.O_RDWR | os.O_CREAT, 0o600)
                size = case.layout.page_nbytes

                def durable() -> None:
                    if fsync:
                        os.fdatasync(fd)

                def raw_write() -> None:
                    for i in range(case.pages):
                        os.pwritev(fd, runs(case.kv_pages[i]), i * size)
                        durable()

                def raw_read() -> None:
                    for i in range(case.pages):
                        os.preadv(fd, runs(case.out_pages[i]), i * size)

                def contiguous_write() -> None:
                    for i in range(case.pages):
                        os.pwrite(fd, case.contiguous_src[i], i * size)
                        durable()

                def contiguous_read() -> None:
                    for i in range(case.pages):
                        os.preadv(fd, [case.plain[i]], i * size)

                suffix = f"{label},fsync" if fsync else label
                results.append(
                    case.result(
                        f"disk_tier_write_vs_raw_file[{suffix}]", case.write, raw_write, contiguous_write, repeats, fsync=fsync
                    )
                )
                if not fsync:
                    results.append(
                        case.result(
                            f"disk_tier_read_vs_raw_file[{label}]", case.read, raw_read, contiguous_read, repeats, fsync=fsync
                        )
                    )
                os.close(fd)
                case.store.close()
    return results


@benchmark("index_lookup")
def index_lookup(quick: bool) -> list[BenchResult]:
    """Longest-prefix lookups of 256-page requests over an index of 1,000,000 pages.

    ``index_lookup`` answers the scheduler's question (how many pages are cached);
    ``index_lookup_with_locations`` also returns every cached page's handle.
    """
    total, depth = (200_000 if quick else 1_000_000), 256
    rng = np.random.default_rng(0)
    chains = rng.integers(1, 2**62, size=(total // depth, depth)).tolist()
    index = PrefixIndex(initial_capacity=total)
    plain: dict[int, int] = {}
    for chain in chains:
        parent = ROOT
        for key in chain:
            parent = plain[key] = index.add(key, tier=1, slot=0, checksum=0, parent=parent)
    # Requests: a cached chain diverging at a random depth (partial hits, as in real traffic).
    queries = []
    for i in rng.integers(0, len(chains), 2000):
        cut = int(rng.integers(0, depth + 1))
        queries.append(chains[i][:cut] + rng.integers(1, 2**62, size=depth - cut).tolist())

    def dict_walk() -> None:
        for q in queries:
            found = []
            for key in q:
                handle = plain.get(key)
                if handle is None:
                    break
                found.append(handle)

    def match() -> None:
        for q in queries:
            index.match(q)

    def lookup() -> None:
        for q in queries:
            index.lookup(q)

    n, repeats = len(queries), 5
    params = {"index_pages": len(index), "request_pages": depth}
    t_match, t_lookup, t_walk = alternating_medians(match, lookup, dict_walk, repeats=repeats)
    return [
        BenchResult("index_lookup", n / t_match, n / t_walk, "lookups/s", ">= 1.0", params),
        BenchResult("index_lookup_with_locations", n / t_lookup, n / t_walk, "lookups/s", None, params),
    ]


@benchmark("key_hashing")
def key_hashing(quick: bool) -> list[BenchResult]:
    """Chained page keys against xxh3 over the same bytes (one call, and one call per page)."""
    layout = _layout(layers=32)
    fp = ModelFingerprint.of(layout, "bench")
    tokens = np.random.default_rng(0).integers(0, 128_000, 256 * layout.page_tokens, dtype=np.int32)
    data = tokens.tobytes()
    step = layout.page_tokens * tokens.itemsize
    view = memoryview(data)
    repeats = 21 if quick else 101
    chained, one_shot, per_page = alternating_medians(
        lambda: page_keys(tokens, fp),
        lambda: xxhash.xxh3_128_digest(data),
        lambda: [xxhash.xxh3_128_digest(view[s : s + step]) for s in range(0, len(data), step)],
        repeats=repeats,
    )
    params = {"tokens": tokens.size, "page_tokens": layout.page_tokens}
    n = tokens.size
    return [
        BenchResult("key_hashing[vs xxh3 one call]", n / chained, n / one_shot, "tokens/s", None, params),
        BenchResult("key_hashing[vs xxh3 per page]", n / chained, n / per_page, "tokens/s", None, params),
    ]
