"""Page copies between a request's KV and flat slots: bit-exact both ways, for host
(numpy) slots and tensor slots (the path an accelerator pool takes, run here on CPU)."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvray.core.config import PageLayout
from kvray.core.pages import copy_page, hash_page, request_bytes, request_page, request_runs, runs
from tests.properties import examples


@settings(max_examples=examples(60), deadline=None)
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


@settings(max_examples=examples(60), deadline=None)
@given(
    layers=st.integers(1, 3),
    page_tokens=st.integers(1, 5),
    pages=st.integers(0, 4),
    spare_tokens=st.integers(0, 7),
    dtype=st.sampled_from(["float32", "float16", "bfloat16"]),
)
def test_request_runs_are_each_pages_runs_in_the_request_itself(layers, page_tokens, pages, spare_tokens, dtype):
    """The runs made for a whole request at once are, page by page, that page's bytes in
    order (as the runs of its view are; a page that happens to be contiguous may come in
    more runs), and writing into them writes into the request's tensor (no copy in
    between), also when the tensor holds more tokens than the pages asked for."""
    layout = PageLayout(layers=layers, kv_heads=2, head_dim=3, page_tokens=page_tokens, dtype=dtype)
    kv = torch.randn(layout.request_shape(pages * page_tokens + spare_tokens)).to(getattr(torch, dtype))
    kv[:, :, pages * page_tokens :] = 0
    kv_bytes = request_bytes(kv)
    got = request_runs(layout, kv_bytes, pages)
    assert len(got) == pages
    for index, page_runs in enumerate(got):
        expected = np.concatenate(runs(request_page(layout, kv_bytes, index)))
        assert all(run.ndim == 1 and run.flags.c_contiguous for run in page_runs)
        assert np.array_equal(np.concatenate(page_runs), expected)
        for run in page_runs:
            run[:] = 0xFF
    if pages:  # every byte of the pages written through the runs, none past them
        written = kv_bytes[:, :, : pages * page_tokens]
        assert (written == 0xFF).all()
        assert (kv_bytes[:, :, pages * page_tokens :] == 0).all()
