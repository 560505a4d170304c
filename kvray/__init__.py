"""kvray: KV-cache offload and prefix reuse for LLM inference.

The core (keys, pages, index, tiers, the placement seam, the in-process :class:`PageStore`) imports
neither Ray nor an inference engine; Ray lives in :mod:`kvray.cluster`, engines in
:mod:`kvray.engines`.

Example::
    import torch
    from kvray import PageLayout, PageStore, StoreConfig, TierSizes

    layout = PageLayout(layers=2, kv_heads=2, head_dim=8, page_tokens=16, dtype="float32")
    store = PageStore(StoreConfig(layout=layout, tiers=TierSizes(host=64)))
    tokens = list(range(64))
    kv = torch.randn(layout.request_shape(64))
    store.store(tokens, kv)
    hit = store.load(tokens)          # 64 tokens come back bit-exact
    assert hit.tokens == 64 and torch.equal(hit.kv, kv)
"""

from typing import TYPE_CHECKING

from kvray.core.config import PageLayout, StoreConfig, TierSizes
from kvray.core.errors import KvrayError
from kvray.core.keys import ModelFingerprint, page_keys
from kvray.lazy import lazy_attributes

if TYPE_CHECKING:  # what type checkers and IDEs see
    from kvray.core.request_kv import LoadResult
    from kvray.core.store import PageStore

# PageStore loads torch: imported on first use (kvray.lazy says why)
__getattr__ = lazy_attributes(__name__, {"LoadResult": "kvray.core.request_kv", "PageStore": "kvray.core.store"})

__all__ = [
    "KvrayError",
    "LoadResult",
    "ModelFingerprint",
    "PageLayout",
    "PageStore",
    "StoreConfig",
    "TierSizes",
    "page_keys",
]
