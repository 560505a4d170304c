"""Page buffers and the copies between engine tensors and pages.

A page is ``page_nbytes`` raw bytes; :func:`page_view` reinterprets those bytes, without a
copy, as a tensor of :attr:`PageLayout.page_shape`. Engines hand kvray the KV of a request
as one tensor ``[layers, 2, tokens, kv_heads, head_dim]``; :func:`check_request_kv`
validates it once, and a page then moves as the byte runs it is made of in that tensor
(:func:`page_chunks`): one copy per run into a slot, or one ``pwritev``, no staging buffer.
The host data plane works on numpy byte views, which cost a fraction of a microsecond to
slice, where torch ops cost several: that keeps per-page overhead small next to the copy.
"""

from __future__ import annotations

import numpy as np
import torch
import xxhash

from kvray.config import PageLayout
from kvray.errors import LayoutError

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def torch_dtype(layout: PageLayout) -> torch.dtype:
    return TORCH_DTYPES[layout.dtype]


def page_view(layout: PageLayout, raw: np.ndarray | torch.Tensor) -> torch.Tensor:
    """View ``page_nbytes`` bytes (uint8, contiguous) as a page tensor; no copy."""
    tensor = torch.from_numpy(raw) if isinstance(raw, np.ndarray) else raw
    if tensor.dtype != torch.uint8 or tensor.numel() != layout.page_nbytes:
        raise LayoutError(
            f"page buffer must be {layout.page_nbytes} uint8 bytes, got {tensor.numel()} {tensor.dtype}"
        )
    return tensor.view(torch_dtype(layout)).view(layout.page_shape)


def check_request_kv(layout: PageLayout, kv: torch.Tensor, tokens: int) -> None:
    """Reject KV whose dtype or shape does not match ``layout`` for ``tokens`` tokens."""
    if not isinstance(kv, torch.Tensor):
        raise LayoutError(f"KV must be a torch.Tensor, got {type(kv).__name__}")
    if kv.dtype != torch_dtype(layout):
        raise LayoutError(f"KV dtype {kv.dtype} does not match the layout's {layout.dtype}")
    expected = layout.request_shape(tokens)
    if tuple(kv.shape) != expected:
        raise LayoutError(
            f"KV shape {tuple(kv.shape)} does not match [layers, 2, tokens, kv_heads, head_dim] = {expected}"
        )


def token_slice(layout: PageLayout, kv: torch.Tensor, page_index: int) -> torch.Tensor:
    """The part of a request's KV that page ``page_index`` holds (a strided view)."""
    start = page_index * layout.page_tokens
    return kv[:, :, start : start + layout.page_tokens]


def request_bytes(kv: torch.Tensor) -> np.ndarray:
    """A request's KV ``[layers, 2, tokens, ...]`` as host bytes ``[layers, 2, tokens, row_bytes]``.

    A view when ``kv`` is a contiguous CPU tensor (the usual case); a copy otherwise.
    """
    host = kv.detach().cpu().contiguous()
    row_bytes = host[0, 0, 0].numel() * host.element_size() if host.shape[2] else 0
    return host.view(torch.uint8).numpy().reshape(host.shape[0], host.shape[1], host.shape[2], row_bytes)


def page_chunks(layout: PageLayout, kv_bytes: np.ndarray, page_index: int) -> list[np.ndarray]:
    """Page ``page_index`` of a request (see :func:`request_bytes`) as its ``2 * layers`` byte runs.

    In ``[layers, 2, tokens, kv_heads, head_dim]`` the tokens of one page form one
    contiguous run per (layer, K/V); concatenated, the runs are exactly the page's bytes.
    Tiers copy or ``pwritev``/``preadv`` these runs directly: no staging buffer.
    """
    start = page_index * layout.page_tokens
    end = start + layout.page_tokens
    return [kv_bytes[layer, kind, start:end].reshape(-1) for layer in range(layout.layers) for kind in (0, 1)]


def slot_runs(slot: np.ndarray | torch.Tensor, chunks: list[np.ndarray]) -> list:
    """A slot's bytes split into runs the sizes of ``chunks``."""
    runs, offset = [], 0
    for chunk in chunks:
        runs.append(slot[offset : offset + chunk.size])
        offset += chunk.size
    return runs


def copy_bytes(dst: np.ndarray | torch.Tensor, src: np.ndarray | torch.Tensor) -> None:
    """Copy flat uint8 bytes: numpy on the host (a plain memcpy, free of torch's thread
    pool stalls on a busy machine), torch when one side lives on an accelerator."""
    if isinstance(dst, np.ndarray) and isinstance(src, np.ndarray):
        np.copyto(dst, src)
    else:
        as_tensor = lambda x: torch.from_numpy(x) if isinstance(x, np.ndarray) else x  # noqa: E731
        as_tensor(dst).copy_(as_tensor(src))


def checksum(chunks: list[np.ndarray]) -> int:
    """xxh3-64 of a page given as host byte runs: what stored pages carry and reads check."""
    hasher = xxhash.xxh3_64()
    for chunk in chunks:
        hasher.update(chunk)
    return hasher.intdigest()


def transfer(chunks: list[np.ndarray], runs: list, into_slot: bool) -> int:
    """Copy a page between the caller's host ``chunks`` and a slot's ``runs``; return the
    checksum of the bytes moved.

    Each run is hashed right after its copy, while it is still in cache, so a page
    crosses the memory bus once: storing and verifying cost little more than a memcpy.
    """
    hasher = xxhash.xxh3_64()
    for chunk, run in zip(chunks, runs):
        if into_slot:
            copy_bytes(run, chunk)
        else:
            copy_bytes(chunk, run)
        hasher.update(chunk)
    return hasher.intdigest()
