"""Page copies between a request's KV and flat slots: bit-exact both ways, for host
(numpy) slots and tensor slots (the path an accelerator pool takes, run here on CPU)."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvray.core.config import PageLayout
from kvray.core.pages import copy_page, hash_page, request_bytes, request_page, runs


@settings(max_examples=60, deadline=None)
@given(
    layers=st.integers(1, 3),
    page_tokens=st.integers(1, 5),
    pages=st.integers(1, 4),
    dtype=st.sampled_from(["float32", "float16", "bfloat16"]),
    tensor_slot=st.booleans(),
    data=st.data(),
)
def test_copy_page_round_trips_bit_exact(layers, page_tokens, pages, dtype, tensor_slot, data):
    layout = PageLayout(layers=layers, kv_heads=2, head_dim=3, page_tokens=page_tokens, dtype=dtype)
    tokens = pages * page_tokens
    kv = torch.randn(layout.request_shape(tokens)).to(getattr(torch, dtype))
    kv_bytes = request_bytes(kv)
    index = data.draw(st.integers(0, pages - 1))
    page = request_page(layout, kv_bytes, index)
    expected = np.concatenate(runs(page))  # the page's bytes in C order
    assert expected.size == layout.page_nbytes

    slot = torch.zeros(layout.page_nbytes, dtype=torch.uint8) if tensor_slot else np.zeros(layout.page_nbytes, np.uint8)
    copy_page(slot, page)
    got = slot.numpy() if tensor_slot else slot
    assert np.array_equal(got, expected)

    out = torch.zeros_like(kv)
    out_page = request_page(layout, request_bytes(out), index)
    copy_page(out_page, slot)
    start = index * page_tokens
    assert torch.equal(
        out[:, :, start : start + page_tokens].view(torch.uint8), kv[:, :, start : start + page_tokens].view(torch.uint8)
    )
    assert not out[:, :, :start].view(torch.uint8).any() and not out[:, :, start + page_tokens :].view(torch.uint8).any()
    assert hash_page(out_page) == hash_page(page)
