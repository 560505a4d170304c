"""BlockCodec: kvray pages <-> vLLM paged KV caches, checked against how each attention
backend itself reads its cache (the expressions below mirror vLLM 0.32's kernels' Python
side: cpu_attn.py and flash_attn.py), including FLASH_ATTN's token-major physical layout
that GPUs use. Runs without vLLM installed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvray import PageLayout
from kvray.core.errors import ConfigError
from kvray.engines.vllm.codec import BlockCodec

LAYOUT = PageLayout(layers=3, kv_heads=2, head_dim=8, page_tokens=32, dtype="float32")
BLOCKS = 10


def cpu_attn_kv(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V as ``[block, head, token, dim]`` the way CPU_ATTN reads them."""
    blocks, heads, tokens, _ = cache.shape
    return cache.view(blocks, heads, tokens * 2, -1).chunk(2, dim=2)


def flash_attn_kv(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    key, value = cache.transpose(1, 2).split(LAYOUT.head_dim, dim=-1)  # [block, token, head, dim]
    return key.transpose(1, 2), value.transpose(1, 2)


def caches(backend: str) -> list[torch.Tensor]:
    shape = (BLOCKS, LAYOUT.kv_heads, LAYOUT.page_tokens, 2 * LAYOUT.head_dim)
    if backend == "FLASH_ATTN":  # physically [block, token, head, 2*dim], viewed [B, H, N, C]
        return [
            torch.randn(BLOCKS, LAYOUT.page_tokens, LAYOUT.kv_heads, 2 * LAYOUT.head_dim).transpose(1, 2)
            for _ in range(LAYOUT.layers)
        ]
    return [torch.randn(shape) for _ in range(LAYOUT.layers)]


@pytest.mark.parametrize("backend, reader", [("CPU_ATTN", cpu_attn_kv), ("FLASH_ATTN", flash_attn_kv)])
def test_written_pages_are_what_the_backend_reads_and_read_back_exactly(backend, reader):
    layers = caches(backend)
    before = [c.clone() for c in layers]
    codec = BlockCodec(backend, layers, LAYOUT)
    pages = torch.randn(2, *LAYOUT.page_shape)  # [n, layers, 2, token, head, dim]
    codec.write([7, 3], pages)
    for layer, cache in enumerate(layers):
        key, value = reader(cache)
        for n, block in enumerate([7, 3]):
            assert torch.equal(key[block], pages[n, layer, 0].transpose(0, 1))
            assert torch.equal(value[block], pages[n, layer, 1].transpose(0, 1))
        untouched = [b for b in range(BLOCKS) if b not in (7, 3)]
        assert torch.equal(cache[untouched], before[layer][untouched])
    assert torch.equal(codec.read([7, 3]), pages)


@pytest.mark.parametrize("backend", ["CPU_ATTN", "FLASH_ATTN"])
def test_page_bytes_as_kvray_stores_them_round_trip_through_blocks(backend):
    codec = BlockCodec(backend, caches(backend), LAYOUT)
    pages = torch.randn(2, *LAYOUT.page_shape)
    rows = pages.view(torch.uint8).reshape(2, -1).numpy()  # [n, page_nbytes], a store's rows
    assert rows.shape == (2, LAYOUT.page_nbytes)
    codec.write_bytes([4, 9], rows)
    assert torch.equal(codec.read([4, 9]), pages)
    back = codec.read_bytes([4, 9])
    assert back.dtype == np.uint8 and np.array_equal(back, rows)
    codec.write([4], torch.zeros(1, *LAYOUT.page_shape))  # the copy handed out is the caller's own
    assert np.array_equal(back, rows)


def test_unsupported_backend_and_mismatched_cache_are_refused():
    with pytest.raises(ConfigError, match="TRITON_ATTN"):
        BlockCodec("TRITON_ATTN", caches("CPU_ATTN"), LAYOUT)
    wrong_heads = LAYOUT.model_copy(update={"kv_heads": 4})
    with pytest.raises(ConfigError, match="does not match the page layout"):
        BlockCodec("CPU_ATTN", caches("CPU_ATTN"), wrong_heads)
    with pytest.raises(ConfigError, match="bfloat16"):
        BlockCodec("CPU_ATTN", caches("CPU_ATTN"), LAYOUT.model_copy(update={"dtype": "bfloat16"}))
