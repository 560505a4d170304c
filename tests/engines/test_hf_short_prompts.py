"""The transformers adapter on a runtime whose shards route past the root finds the pages
it stored for short prompts.

The adapter looks up one page fewer than it stores when a prompt's last token ends a page
(that token is always computed, for the logits), and stores that page for the next turn.
With ``controller_route_depth`` 1 a chain of at most 2 pages routes by its last page, so
the lookup of a 2-page prompt's first page asked another shard than its store committed
to: the continuation it stored after a 1-page hit went to a shard that did not hold the
parent page and was dropped, and the next turn of the conversation missed everything.
The lookup now routes by the chain the adapter stores. The prompt is drawn so its first
two pages route to different shards.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvray.cluster import KvrayClient, Runtime, RuntimeConfig
from kvray.core.config import TierSizes
from kvray.core.partition import shard_of
from kvray.engines.hf import CachedCausalLM, model_layout
from kvray.engines.runtime import RuntimePages

pytestmark = pytest.mark.ray

PAGE = 16
SHARDS = 4
FP32_TOL = 1e-4


@pytest.fixture
def adapter(ray_cluster, llama_fp32):
    layout = model_layout(llama_fp32.config, torch.float32, PAGE)
    config = RuntimeConfig(
        name="kvray-hf-short", layout=layout, tiers=TierSizes(host=64), controller_shards=SHARDS, controller_route_depth=1
    )
    runtime = Runtime.start(config)
    lm = CachedCausalLM(llama_fp32, RuntimePages(KvrayClient.connect(config.name, mapped_reads=False), "tiny-llama"))
    yield lm
    lm.store.close()
    runtime.close()


def tokens_routed_apart(pages: RuntimePages) -> list[int]:
    """Three pages and a token whose first two pages' keys route to different shards."""
    for seed in range(1000):
        tokens = np.random.default_rng(seed).integers(3, 1000, 3 * PAGE + 1).tolist()
        keys = pages.keys(tokens[: 2 * PAGE])
        if shard_of(keys[0], SHARDS) != shard_of(keys[1], SHARDS):
            return tokens
    raise AssertionError("no prompt found whose first pages route apart")


def test_a_conversation_of_short_prompts_finds_the_page_each_turn_stored(adapter, llama_fp32):
    tokens = tokens_routed_apart(adapter.store)
    first = adapter.prefill(tokens[: PAGE + 1])  # a page and a token: stores that page
    assert (first.cached_tokens, first.stored_pages) == (0, 1)
    adapter.store.client.settle()
    adapter.prefill(tokens[: 2 * PAGE])  # two pages exactly: looks up one, stores both
    adapter.store.client.settle()
    third = adapter.prefill(tokens)  # the next turn: both pages cached
    assert third.cached_tokens == 2 * PAGE
    with torch.inference_mode():
        full = llama_fp32(input_ids=torch.tensor([tokens]))[0][0, -1]
    assert (third.logits - full).abs().max() <= FP32_TOL
    again = adapter.prefill(tokens[: 2 * PAGE])  # the short prompt itself, repeated
    assert again.cached_tokens == PAGE
