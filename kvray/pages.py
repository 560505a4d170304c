"""Page buffers and the copies between engine tensors and pages.

A page is ``page_nbytes`` raw bytes; :func:`page_view` reinterprets those bytes, without a
copy, as a tensor of :attr:`PageLayout.page_shape`. Engines hand kvray the KV of a request
as one tensor ``[layers, 2, tokens, kv_heads, head_dim]``; :func:`check_request_kv`
validates it once, and storing or loading page ``i`` is then a single strided copy between
the request tensor's token slice and a page view of the slot's memory (no staging buffer).
"""

from __future__ import annotations

import numpy as np
import xxhash
import torch

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


def checksum(page: torch.Tensor | np.ndarray) -> int:
    """xxh3-64 of a page's bytes: what stored pages carry and every verified read checks."""
    if isinstance(page, torch.Tensor):
        page = page.detach().cpu().contiguous().view(torch.uint8).numpy()
    return xxhash.xxh3_64_intdigest(memoryview(np.ascontiguousarray(page)).cast("B"))
