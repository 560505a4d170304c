"""Page buffers and the copies between engine tensors and pages.

A page is ``page_nbytes`` raw bytes, laid out as :attr:`PageLayout.page_shape`. Engines hand kvray the KV of a request
as one tensor ``[layers, 2, tokens, kv_heads, head_dim]``; :func:`check_request_kv`
validates it once, and a page then moves as a strided byte view of that tensor
(:func:`request_page`): one copy into a slot, or one write per contiguous run, no staging buffer.
The host data plane works on numpy byte views, which cost a fraction of a microsecond to
slice, where torch ops cost several: that keeps per-page overhead small next to the copy.
"""

from __future__ import annotations

import math
from functools import cache
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from kvray.core.config import PageLayout
from kvray.core.errors import LayoutError

try:  # built with kvray (setup.py); without it pages are hashed by xxhash alone, a little slower
    from kvray.core import _pagecopy
except ImportError:
    _pagecopy = None

if TYPE_CHECKING:
    import torch


@cache
def torch_dtypes() -> dict[str, torch.dtype]:
    """Each page dtype's torch dtype; torch is imported here, not with the module, so a
    process that moves only page bytes (a store actor without an accelerator tier) never
    pays for it (kvray.lazy)."""
    import torch

    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(layout: PageLayout) -> torch.dtype:
    return torch_dtypes()[layout.dtype]


def check_request_kv(layout: PageLayout, kv: torch.Tensor, tokens: int) -> None:
    """Reject KV whose dtype or shape does not match ``layout`` for ``tokens`` tokens."""
    import torch

    if not isinstance(kv, torch.Tensor):
        raise LayoutError(f"KV must be a torch.Tensor, got {type(kv).__name__}")
    if kv.dtype != torch_dtype(layout):
        raise LayoutError(f"KV dtype {kv.dtype} does not match the layout's {layout.dtype}")
    expected = layout.request_shape(tokens)
    if tuple(kv.shape) != expected:
        raise LayoutError(f"KV shape {tuple(kv.shape)} does not match [layers, 2, tokens, kv_heads, head_dim] = {expected}")


def check_load_out(layout: PageLayout, out: torch.Tensor, tokens: int) -> None:
    """Reject an ``out`` tensor a load cannot fill in place: the layout's dtype and row shape,
    room for ``tokens`` tokens, contiguous, in host memory (:meth:`PageStore.load
    <kvray.core.store.PageStore.load>`)."""
    rows = layout.request_shape(0)
    if (
        out.dtype != torch_dtype(layout)
        or tuple(out.shape[:2]) + tuple(out.shape[3:]) != rows[:2] + rows[3:]
        or out.shape[2] < tokens
        or not out.is_contiguous()
    ):
        raise LayoutError(
            f"out tensor {tuple(out.shape)} {out.dtype} cannot hold {tokens} tokens of layout "
            f"{layout.request_shape(tokens)} {layout.dtype} (contiguous)"
        )
    if out.device.type != "cpu":
        raise LayoutError(f"out tensor must be in host memory, got {out.device}")


def check_chunk_buffers(layout: PageLayout, out: tuple[torch.Tensor, ...], chunk_tokens: int) -> None:
    """Reject chunk buffers a streamed load cannot use (:meth:`PageStore.load_chunks
    <kvray.core.store.PageStore.load_chunks>`): two contiguous host tensors of one chunk each."""
    shape = layout.request_shape(chunk_tokens)
    if len(out) != 2 or any(
        b.shape != shape or b.dtype != torch_dtype(layout) or not b.is_contiguous() or b.device.type != "cpu" for b in out
    ):
        raise LayoutError(f"out must be two contiguous host tensors {shape} {layout.dtype}, one per chunk in flight")


def request_bytes(kv: torch.Tensor) -> np.ndarray:
    """A request's KV ``[layers, 2, tokens, ...]`` as host bytes ``[layers, 2, tokens, row_bytes]``.

    A view when ``kv`` is a contiguous CPU tensor (the usual case); a copy otherwise.
    """
    import torch

    host = kv.detach().cpu().contiguous()
    layers, kv_dim, tokens, *row = host.shape
    row_bytes = math.prod(row) * host.element_size() if tokens else 0  # shape arithmetic: no tensor op
    return host.view(torch.uint8).numpy().reshape(layers, kv_dim, tokens, row_bytes)


def request_page(layout: PageLayout, kv_bytes: np.ndarray, page_index: int) -> np.ndarray:
    """Page ``page_index`` of a request (see :func:`request_bytes`) as a strided byte view.

    The view's C-order bytes are exactly the page: ``[layers, 2, page_tokens, row_bytes]``
    sliced out of the request, so a tier copies it with one strided copy, or writes its
    contiguous runs (:func:`runs`) straight to disk: no staging buffer.
    """
    start = page_index * layout.page_tokens
    return kv_bytes[:, :, start : start + layout.page_tokens]


def request_runs(layout: PageLayout, kv_bytes: np.ndarray, pages: int) -> list[list[np.ndarray]]:
    """The contiguous byte runs (:func:`runs`) of the first ``pages`` pages of a request (see
    :func:`request_bytes`, C-contiguous), each page's runs in order, made for the whole
    request at once: one reshape, then numpy slicing the runs out in C, instead of a view and
    a layout check per page (a measurable share of a page-cache disk read of a 2 MiB page).
    """
    layers, kv, tokens, row_bytes = kv_bytes.shape
    run_bytes = layout.page_tokens * row_bytes
    flat = kv_bytes.reshape(layers * kv, tokens * row_bytes)  # a view: kv_bytes is contiguous
    blocks = flat[:, : pages * run_bytes].reshape(layers * kv, pages, run_bytes)
    if pages and not np.may_share_memory(blocks, kv_bytes):  # numpy copied: the runs would not be the request's
        raise LayoutError("request bytes cannot be split into page runs without a copy")
    return [list(page) for page in blocks.transpose(1, 0, 2)]


def runs(page: np.ndarray) -> list[np.ndarray]:
    """A page view's contiguous byte runs, in order (one for a contiguous page, one per
    layer and K/V for a page sliced out of a request). A view whose blocks are not
    contiguous raises :class:`LayoutError`: numpy would split it only by copying, and bytes
    read into a copy would never reach the page."""
    if page.flags.c_contiguous:
        return [page.reshape(-1)]
    if page.ndim >= 2:  # one row per run when numpy can view it so (a request's page can): ~4x faster
        rows = page.reshape(-1, page.shape[-2] * page.shape[-1])
        if rows.strides[-1] == rows.itemsize and np.may_share_memory(rows, page):
            return list(rows)
    blocks = [block.reshape(-1) for layer in page for block in layer] if page.ndim >= 3 else []
    if not blocks or not all(block.flags.c_contiguous and np.may_share_memory(block, page) for block in blocks):
        raise LayoutError(f"a page view of shape {page.shape}, strides {page.strides} cannot be split into contiguous byte runs")
    return blocks


def copy_page(dst: np.ndarray | torch.Tensor, src: np.ndarray | torch.Tensor) -> None:
    """Copy one page between a page view and a flat slot (either side) in one call.

    The slot is reshaped to the view's shape, so the copy is a single strided
    ``np.copyto`` (numpy on the host: a plain memcpy per contiguous run, free of torch's
    thread-pool stalls on a busy machine) or ``Tensor.copy_`` when a side is on an accelerator.
    """
    if dst.ndim > src.ndim:
        src = src.reshape(dst.shape)
    elif src.ndim > dst.ndim:
        dst = dst.reshape(src.shape)
    if isinstance(dst, np.ndarray) and isinstance(src, np.ndarray):
        np.copyto(dst, src)
    else:
        import torch  # a side is a tensor: torch is loaded already

        torch.as_tensor(dst).copy_(torch.as_tensor(src))


UNHASHED = 0  # the checksum of a memory page stored without one (``checksum_memory`` off)


def hash_page(page: np.ndarray) -> int:
    """xxh3-64 of a page view's bytes, run by run: what stored pages carry and reads check."""
    return hash_runs(runs(page))


def hash_runs(chunks: list[np.ndarray] | list[bytearray]) -> int:
    """xxh3-64 of contiguous byte runs, in order, as if they were one buffer.

    :mod:`kvray.core._pagecopy` hashes them in one call with the GIL released (the same
    values as xxhash's: it computes XXH3 as specified, tests/core/test_pagecopy.py); xxhash's
    streaming hasher takes inputs of 240 bytes or fewer and any build without the extension.
    """
    if _pagecopy is not None and (digest := _pagecopy.hash_runs(chunks)) is not None:
        return digest
    hasher = xxhash.xxh3_64()
    for chunk in chunks:
        hasher.update(chunk)
    return hasher.intdigest()
