"""Shared fixtures: small page layouts and a deterministic 'model' whose KV for a token
depends on the whole prefix before it, so any KV returned for the wrong prefix shows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvray.config import PageLayout

TINY = PageLayout(layers=2, kv_heads=2, head_dim=4, page_tokens=4, dtype="float32")


def prefix_kv(layout: PageLayout, tokens) -> torch.Tensor:
    """KV of ``tokens`` where every value depends on the token's whole prefix."""
    tokens = np.asarray(tokens, dtype=np.int64)
    state = np.cumsum((tokens + 1) * 1_000_003 % 65_521) % 2**20  # rolling prefix digest
    per_token = layout.layers * 2 * layout.kv_heads * layout.head_dim
    grid = (state[:, None] * 7 + np.arange(per_token)[None, :]) % 1_000
    kv = torch.from_numpy(grid.astype(np.float32) / 8.0)  # exact in float16 and bfloat16 too
    kv = kv.view(len(tokens), layout.layers, 2, layout.kv_heads, layout.head_dim).permute(1, 2, 0, 3, 4)
    return kv.contiguous().to({"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[layout.dtype])


@pytest.fixture
def tiny_layout() -> PageLayout:
    return TINY
