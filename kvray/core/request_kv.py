"""The engine-facing verbs of :class:`~kvray.core.store.PageStore`: a request's KV as one
tensor, stored page by page and loaded back whole or a chunk at a time.

An engine hands over ``[layers, 2, tokens, kv_heads, head_dim]``; each page is a byte view
of it (:func:`kvray.core.pages.request_page`), so storing or loading is one strided copy per
page (memory tiers) or per contiguous run (disk), through the store's page verbs
(``_store_pages``, ``_read_into``), which own the locking, the checksums and the policy.
Split out of the store module so that it keeps the pages and their tiers: :class:`RequestKV`
is a mixin ``PageStore`` inherits, so ``store.load(tokens)`` is unchanged.

Example::

    import torch
    from kvray import PageLayout, PageStore, StoreConfig, TierSizes

    layout = PageLayout(layers=2, kv_heads=2, head_dim=4, page_tokens=4, dtype="float32")
    store = PageStore(StoreConfig(layout=layout, tiers=TierSizes(host=8)))   # a RequestKV
    tokens = list(range(12))
    kv = torch.randn(layout.request_shape(len(tokens)))
    assert store.store(tokens, kv) == 3
    assert torch.equal(store.load(tokens).kv, kv)
    assert [c.tokens for c in store.load_chunks(tokens, chunk_tokens=8)] == [8, 4]
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvray.core.config import PageLayout, StoreConfig
from kvray.core.errors import RequestError
from kvray.core.keys import as_token_array
from kvray.core.pages import (
    check_chunk_buffers,
    check_load_out,
    check_request_kv,
    request_bytes,
    request_page,
    request_runs,
    torch_dtype,
)
from kvray.core.tiers.memory import resident_empty

if TYPE_CHECKING:  # torch is imported where a tensor is made (kvray.lazy)
    import torch


@dataclass(frozen=True)
class LoadResult:
    """KV of a request's longest cached prefix."""

    tokens: int  # leading tokens whose KV is in ``kv``
    kv: torch.Tensor  # [layers, 2, tokens, kv_heads, head_dim]
    pages_by_tier: dict[str, int]


@dataclass(frozen=True)
class LoadChunk:
    """One batch of a streamed load (:meth:`PageStore.load_chunks`): the KV of tokens
    ``start .. start + tokens`` of the request, valid until the next batch is asked for.

    Example::

        for chunk in store.load_chunks(prompt_tokens, chunk_tokens=8192):
            engine_cache[:, :, chunk.start : chunk.start + chunk.tokens] = chunk.kv  # copy before the next
    """

    start: int
    tokens: int
    kv: torch.Tensor  # [layers, 2, tokens, kv_heads, head_dim]
    pages_by_tier: dict[str, int]


def chunk_buffer(layout: PageLayout, tokens: int) -> torch.Tensor:
    """A host buffer for the KV of ``tokens`` tokens (``[layers, 2, tokens, kv_heads, head_dim]``)
    that pages copy into at memory speed: page-aligned and resident from the start
    (:func:`~kvray.core.tiers.memory.resident_empty`)."""
    import torch

    raw = resident_empty(1, tokens * layout.page_nbytes // layout.page_tokens)
    return torch.from_numpy(raw).view(torch_dtype(layout)).reshape(layout.request_shape(tokens))


class RequestKV:
    """:meth:`store`, :meth:`load` and :meth:`load_chunks` for
    :class:`~kvray.core.store.PageStore` (which defines the attributes and page verbs named
    below); see the module docstring."""

    config: StoreConfig
    layout: PageLayout

    def store(self, tokens: Sequence[int] | np.ndarray, kv: torch.Tensor, salt: str = "", priority: int = 0) -> int:
        """Keep the KV of each full page of ``tokens`` that is not cached yet; returns pages stored."""
        arr = as_token_array(tokens, self.config.max_request_tokens)
        check_request_kv(self.layout, kv, arr.size)
        kv_bytes = request_bytes(kv)
        return self._store_pages(
            self.keys(arr, salt),
            lambda i: request_page(self.layout, kv_bytes, i),
            priority,
            page_runs=lambda pages: request_runs(self.layout, kv_bytes, pages),
        )

    def load(self, tokens: Sequence[int] | np.ndarray, salt: str = "", out: torch.Tensor | None = None) -> LoadResult:
        """KV of the longest cached prefix of ``tokens``, every page checksum-verified.

        ``out`` (contiguous ``[layers, 2, >=tokens, kv_heads, head_dim]``) receives the KV
        in place; otherwise a new tensor is returned.
        """
        keys = self.keys(tokens, salt)
        tokens_wanted = len(keys) * self.layout.page_tokens
        if out is None:
            import torch

            out = torch.empty(self.layout.request_shape(tokens_wanted), dtype=torch_dtype(self.layout))
        else:
            check_load_out(self.layout, out, tokens_wanted)
        out_bytes = request_bytes(out)
        got, by_tier = self._read_into(
            keys, lambda i: request_page(self.layout, out_bytes, i), lambda pages: request_runs(self.layout, out_bytes, pages)
        )
        return LoadResult(got * self.layout.page_tokens, out[:, :, : got * self.layout.page_tokens], by_tier)

    def load_chunks(
        self,
        tokens: Sequence[int] | np.ndarray,
        chunk_tokens: int,
        salt: str = "",
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Iterator[LoadChunk]:
        """The longest cached prefix of ``tokens``, ``chunk_tokens`` at a time, read ahead.

        For a prefix larger than the engine has room for (a million tokens is 4 GB of KV in
        a small model): the engine holds two chunks, consumes one while the next is read
        into the other (a background thread; disk reads and copies release the GIL), and
        each chunk's pages are pinned only while it is read. A chunk's ``kv`` is valid
        until the next one is asked for. Keys chain, so a cached page names its whole
        prefix: a chunk read after an earlier one is still exactly its tokens' KV, and the
        stream ends at the first chunk that comes back short (a page evicted meanwhile, or
        one that failed verification): a shorter prefix, never wrong KV. ``out``: the engine's
        two chunk buffers (contiguous ``[layers, 2, chunk_tokens, kv_heads, head_dim]`` in host
        memory, reused across loads; fresh memory costs a page fault per 4 KiB on first use,
        and a buffer that starts on a 4 KiB boundary copies fastest, see
        :func:`~kvray.core.tiers.memory.aligned_empty`), else two such buffers are allocated.
        """
        page = self.layout.page_tokens
        if chunk_tokens <= 0 or chunk_tokens % page:
            raise RequestError(f"chunk_tokens={chunk_tokens} must be a positive multiple of page_tokens={page}")
        keys = self.keys(tokens, salt)
        step = chunk_tokens // page
        if out is None:
            buffers = [chunk_buffer(self.layout, chunk_tokens) for _ in range(2)]
        else:
            check_chunk_buffers(self.layout, out, chunk_tokens)
            buffers = list(out)
        as_bytes = [request_bytes(b) for b in buffers]

        def read(i: int) -> tuple[int, dict[str, int]]:
            rows = as_bytes[(i // step) % 2]
            return self._read_into(
                keys[i : i + step],
                lambda j: request_page(self.layout, rows, j),
                lambda pages: request_runs(self.layout, rows, pages),
            )

        if not keys:
            return
        with ThreadPoolExecutor(1, thread_name_prefix="kvray-load-ahead") as ahead:
            pending = ahead.submit(read, 0)
            for start in range(0, len(keys), step):
                got, by_tier = pending.result()
                full = got == len(keys[start : start + step])
                if full and start + step < len(keys):
                    pending = ahead.submit(read, start + step)  # into the other buffer
                if got:
                    kv = buffers[(start // step) % 2][:, :, : got * page]
                    yield LoadChunk(start * page, got * page, kv, by_tier)
                if not full:
                    return
