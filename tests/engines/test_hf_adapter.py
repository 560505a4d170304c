"""The transformers adapter on a real (tiny, random-weight) Llama with grouped-query attention.

Every hit is checked against a full recompute of the same prompt by the same model.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from kvray import PageStore, StoreConfig, TierSizes
from kvray.core.errors import LayoutError, RequestError
from kvray.core.tiers import Tier
from kvray.engines.hf import CachedCausalLM, model_layout
from kvray.harness.faults import break_store

PAGE = 16
FP32_TOL = 1e-4


def prompt(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 1000, n)


def recompute(model, tokens) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.from_numpy(np.asarray(tokens, dtype=np.int64))[None]).logits[0, -1]


def make_store(model, tiers: TierSizes, tmp_path=None, name="tiny-llama", page=PAGE) -> PageStore:
    layout = model_layout(model.config, model.dtype, page)
    return PageStore(StoreConfig(layout=layout, model_name=name, tiers=tiers, disk_dir=tmp_path))


@pytest.mark.parametrize("tier", ["device", "host", "disk"])
def test_hit_logits_equal_full_recompute_from_each_tier(llama_fp32, tier, tmp_path):
    tiers = TierSizes(**{tier: 64})
    tokens = prompt(150)
    writer = CachedCausalLM(llama_fp32, make_store(llama_fp32, tiers, tmp_path))
    cold = writer.prefill(tokens)
    assert (cold.cached_tokens, cold.stored_pages) == (0, 150 // PAGE)
    store = writer.store
    if tier == "disk":  # read back from a store reopened on the same directory: the bytes come off disk
        store.close()
        store = make_store(llama_fp32, tiers, tmp_path)
    hit = CachedCausalLM(llama_fp32, store).prefill(tokens)
    assert hit.cached_tokens == 144 and hit.computed_tokens == 6
    assert hit.pages_by_tier == {tier: 9}
    assert (hit.logits - recompute(llama_fp32, tokens)).abs().max().item() <= FP32_TOL
    store.close()


def test_prompt_of_whole_pages_keeps_its_last_token_uncached(llama_fp32):
    lm = CachedCausalLM(llama_fp32, make_store(llama_fp32, TierSizes(host=64)))
    tokens = prompt(4 * PAGE, seed=1)
    lm.prefill(tokens)
    hit = lm.prefill(tokens)
    assert hit.cached_tokens == 3 * PAGE and hit.computed_tokens == PAGE
    assert (hit.logits - recompute(llama_fp32, tokens)).abs().max().item() <= FP32_TOL


def test_shared_prefix_then_divergent_suffix(llama_fp32):
    lm = CachedCausalLM(llama_fp32, make_store(llama_fp32, TierSizes(host=64)))
    shared = prompt(5 * PAGE, seed=2)
    lm.prefill(np.concatenate([shared, prompt(20, seed=3)]))
    other = np.concatenate([shared, prompt(30, seed=4)])
    hit = lm.prefill(other)
    assert hit.cached_tokens == 5 * PAGE
    assert (hit.logits - recompute(llama_fp32, other)).abs().max().item() <= FP32_TOL


def test_bfloat16_hit_matches_recompute_within_bf16_rounding(llama_bf16):
    """bfloat16 keeps 8 mantissa bits: the suffix-only forward multiplies in other block
    shapes than the full one, so logits agree to bf16 rounding (1/64 of their scale),
    not to 1e-4. The loaded KV bytes themselves are exact."""
    lm = CachedCausalLM(llama_bf16, make_store(llama_bf16, TierSizes(host=64)))
    assert lm.layout.dtype == "bfloat16"
    tokens = prompt(150, seed=5)
    lm.prefill(tokens)
    hit = lm.prefill(tokens)
    full = recompute(llama_bf16, tokens).float()
    assert hit.cached_tokens == 144 and hit.logits.dtype == torch.bfloat16
    assert (hit.logits.float() - full).abs().max().item() <= full.abs().max().item() / 64


def test_conversation_turn_finds_prompt_and_reply_cached(llama_fp32):
    lm = CachedCausalLM(llama_fp32, make_store(llama_fp32, TierSizes(host=64)))
    first_turn = prompt(40, seed=6)
    reply, _ = lm.generate(first_turn, max_new_tokens=30)
    second_turn = np.concatenate([first_turn, reply, prompt(10, seed=7)])
    hit = lm.prefill(second_turn)
    assert hit.cached_tokens == (40 + 30 - 1) // PAGE * PAGE
    assert (hit.logits - recompute(llama_fp32, second_turn)).abs().max().item() <= FP32_TOL


@pytest.mark.parametrize("change", [{"layers": 3}, {"kv_heads": 4}, {"head_dim": 16}, {"dtype": "bfloat16"}])
def test_store_of_another_layout_is_a_logged_miss_and_never_loaded(llama_fp32, change, caplog):
    other = model_layout(llama_fp32.config, llama_fp32.dtype, PAGE).model_copy(update=change)
    store = PageStore(StoreConfig(layout=other, model_name="tiny-llama", tiers=TierSizes(host=64)))
    tokens = prompt(100, seed=8)
    store.store(tokens[:96], torch.zeros(other.request_shape(96), dtype=getattr(torch, other.dtype)))
    with caplog.at_level(logging.WARNING, logger="kvray.engines.hf"):
        result = CachedCausalLM(llama_fp32, store).prefill(tokens)
    field = next(iter(change))
    assert result.cached_tokens == 0 and result.stored_pages == 0 and len(store) == 6
    assert field in result.miss_reason and field in caplog.text
    assert (result.logits - recompute(llama_fp32, tokens)).abs().max().item() <= FP32_TOL


@pytest.mark.parametrize("reader", [{"name": "model-b"}, {"page": 2 * PAGE}, {"dtype": torch.bfloat16}])
def test_fingerprint_separates_models_sharing_a_disk_directory(llama_fp32, llama_bf16, reader, tmp_path):
    """Pages on disk carry the writer's fingerprint (model name and full layout, page size
    included): a store for another model, page size or dtype finds none of them."""
    tokens = prompt(100, seed=9)
    writer = make_store(llama_fp32, TierSizes(disk=64), tmp_path, name="model-a")
    CachedCausalLM(llama_fp32, writer).prefill(tokens)
    writer.close()
    same = make_store(llama_fp32, TierSizes(disk=64), tmp_path, name="model-a")
    assert same.lookup(tokens) == 96
    same.close()
    model = llama_bf16 if "dtype" in reader else llama_fp32
    other = make_store(model, TierSizes(disk=64), tmp_path, name=reader.get("name", "model-a"), page=reader.get("page", PAGE))
    result = CachedCausalLM(model, other).prefill(tokens)
    assert result.cached_tokens == 0 and result.miss_reason is None
    other.close()


def test_corrupt_disk_page_shortens_the_hit_and_logits_stay_exact(llama_fp32, tmp_path):
    tokens = prompt(100, seed=10)
    store = make_store(llama_fp32, TierSizes(disk=64), tmp_path)
    lm = CachedCausalLM(llama_fp32, store)
    lm.prefill(tokens)
    disk = store.pools[Tier.DISK]
    third = int(store.manager.lookup(store.keys(tokens)).slots[2])
    with disk.path.open("r+b") as f:  # flip payload bytes of the third page on disk
        f.seek(third * disk.stride + disk.stride // 2)
        f.write(b"\xff" * 64)
    hit = lm.prefill(tokens)
    assert hit.cached_tokens == 2 * PAGE
    assert store.stats()["corrupt_pages"] == 1
    assert (hit.logits - recompute(llama_fp32, tokens)).abs().max().item() <= FP32_TOL


@pytest.mark.parametrize("fault", ["wipe", "io-error"])
def test_failing_disk_tier_means_recompute_not_a_failed_request(llama_fp32, tmp_path, fault):
    tokens = prompt(100, seed=11)
    store = make_store(llama_fp32, TierSizes(disk=64), tmp_path)
    lm = CachedCausalLM(llama_fp32, store)
    lm.prefill(tokens)
    break_store(store, fault)
    result = lm.prefill(tokens)
    assert result.cached_tokens == 0
    assert (result.logits - recompute(llama_fp32, tokens)).abs().max().item() <= FP32_TOL


def test_bad_requests_raise_clear_errors(llama_fp32):
    lm = CachedCausalLM(llama_fp32, make_store(llama_fp32, TierSizes(host=8)))
    with pytest.raises(RequestError, match="empty"):
        lm.prefill([])
    with pytest.raises(RequestError, match="integers"):
        lm.prefill([0.5, 1.5])
    with pytest.raises(LayoutError, match="dtype"):
        model_layout(llama_fp32.config, torch.int8, PAGE)
