"""Hugging Face transformers adapter: prefill from kvray's longest cached prefix.

A causal LM's prefill is the expensive part of time to first token. This adapter looks up
the longest cached prefix of a prompt in a :class:`~kvray.core.store.PageStore`, loads those
pages into a transformers ``DynamicCache``, runs the model on the uncached suffix only
(always at least the last prompt token, so that logits exist), and stores the full pages
that were computed. Loaded KV is bit-identical to what the model computed when the pages
were stored, so a hit changes time, never the logits beyond float rounding of the
suffix's attention.

The page layout comes from the model's config (layers, key/value heads, head dim, dtype)
and the store's ``page_tokens``. A store whose layout differs from the model's is never
read or written: every request is then a miss whose reason is logged and returned.

Only full-attention Llama-family decoders are supported (grouped-query attention
included); sliding-window or hybrid caches are refused with :class:`LayoutError`.

:meth:`CachedCausalLM.open` puts the pages on a shared kvray runtime when one is named
(``kvray_runtime`` / ``kvray_ray_address``, or ``$KVRAY_RUNTIME`` / ``$KVRAY_RAY_ADDRESS``)
and reachable, so adapters on every node of a Ray cluster share one cache
(:mod:`kvray.engines.runtime`); otherwise in an in-process store.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kvray.core.config import PageLayout, StoreConfig, TierSizes, validate
from kvray.core.errors import ConfigError, KvrayError, LayoutError
from kvray.core.keys import as_token_array
from kvray.core.pages import torch_dtypes
from kvray.core.store import PageStore
from kvray.engines.runtime import RuntimePages, runtime_target

log = logging.getLogger(__name__)

DTYPE_NAMES = {dtype: name for name, dtype in torch_dtypes().items()}


def model_layout(config, dtype: torch.dtype, page_tokens: int) -> PageLayout:
    """The :class:`PageLayout` of a transformers decoder config at ``dtype``."""
    text = config.get_text_config(decoder=True)
    kinds = set(getattr(text, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        raise LayoutError(f"only full-attention decoders are supported, this model has layers {sorted(kinds)}")
    if dtype not in DTYPE_NAMES:
        raise LayoutError(f"model dtype {dtype} has no page layout; use one of {sorted(torch_dtypes())}")
    heads = text.num_attention_heads
    fields = {
        "layers": text.num_hidden_layers,
        "kv_heads": getattr(text, "num_key_value_heads", None) or heads,
        "head_dim": getattr(text, "head_dim", None) or text.hidden_size // heads,
        "page_tokens": page_tokens,
        "dtype": DTYPE_NAMES[dtype],
    }
    return validate(PageLayout, fields, source=f"{type(config).__name__}")


def checkpoint_layout(path: str | Path, page_tokens: int, dtype: str = "float32") -> PageLayout:
    """The :class:`PageLayout` of the checkpoint (or bare config) directory ``path`` served
    in ``dtype`` (``float32``, ``float16``, ``bfloat16``), read from its config alone: for
    the runtime engines will share, before any engine starts."""
    from transformers import AutoConfig

    dtypes = torch_dtypes()
    if dtype not in dtypes:
        raise ConfigError(f"dtype {dtype!r} has no kvray page layout; use one of {sorted(dtypes)}")
    return model_layout(AutoConfig.from_pretrained(path), dtypes[dtype], page_tokens)


def layout_mismatch(model: PageLayout, stored: PageLayout) -> str | None:
    """Why pages of ``stored`` layout cannot serve ``model`` (``None`` when they can)."""
    diffs = [
        f"{name} {getattr(stored, name)} != model's {getattr(model, name)}"
        for name in PageLayout.model_fields
        if getattr(stored, name) != getattr(model, name)
    ]
    return "store layout differs: " + ", ".join(diffs) if diffs else None


@dataclass
class Prefill:
    """Outcome of one prefill: last-token logits, the KV cache, and where the KV came from."""

    logits: torch.Tensor  # [vocab] logits of the last prompt token
    cache: object  # transformers DynamicCache holding the whole prompt's KV
    cached_tokens: int  # leading tokens whose KV was loaded from kvray
    computed_tokens: int  # tokens the model ran on
    stored_pages: int  # new pages handed to kvray
    pages_by_tier: dict[str, int] = field(default_factory=dict)
    miss_reason: str | None = None  # why nothing could be loaded, when kvray was not usable
    seconds: float = 0.0  # wall time to the logits (the request's TTFT)


class CachedCausalLM:
    """A transformers causal LM whose prefills reuse and feed a kvray :class:`PageStore`.

    Example::

        model = LlamaForCausalLM(LlamaConfig(...)).eval()
        layout = model_layout(model.config, model.dtype, page_tokens=64)
        revision = checkpoint_revision(model.config, "my-weights-v1")   # see kvray.engines.revision
        lm = CachedCausalLM(model, PageStore(StoreConfig(layout=layout, model_name="tiny-llama", model_revision=revision)))
        first = lm.prefill(prompt)          # computes everything, stores full pages
        again = lm.prefill(prompt)          # loads all but the last partial page
        again.cached_tokens, again.logits.argmax()
    """

    def __init__(self, model: torch.nn.Module, store: PageStore | RuntimePages, salt: str = "") -> None:
        self.model = model
        self.store = store
        self.salt = salt
        self.layout = model_layout(model.config, model.dtype, store.layout.page_tokens)
        self.unusable = layout_mismatch(self.layout, store.layout)
        if self.unusable:
            log.warning("kvray store not used for %s: %s", type(model).__name__, self.unusable)

    @classmethod
    def open(
        cls,
        model: torch.nn.Module,
        model_name: str,
        page_tokens: int,
        tiers: TierSizes = TierSizes(host=1024),
        kvray_runtime: str | None = None,
        kvray_ray_address: str | None = None,
        model_revision: str | None = None,
        salt: str = "",
    ) -> CachedCausalLM:
        """An adapter on the kvray runtime named here or by the environment when it is
        reachable, otherwise on an in-process store of ``tiers``.

        Example::

            lm = CachedCausalLM.open(model, "tiny-llama", page_tokens=64, kvray_runtime="kvray")
            isinstance(lm.store, RuntimePages)   # True when the runtime answered
        """
        layout = model_layout(model.config, model.dtype, page_tokens)
        target = runtime_target(kvray_ray_address, kvray_runtime)
        pages = RuntimePages.open(target, layout, model_name, model_revision) if target else None
        if pages is None:
            pages = PageStore(StoreConfig(layout=layout, model_name=model_name, model_revision=model_revision, tiers=tiers))
        return cls(model, pages, salt)

    @torch.inference_mode()
    def prefill(self, tokens: Sequence[int] | np.ndarray) -> Prefill:
        """Serve a prompt's prefill from the longest cached prefix; store the new full pages."""
        t0 = time.perf_counter()
        arr = as_token_array(tokens, self.store.config.max_request_tokens)
        page = self.layout.page_tokens
        loadable = (arr.size - 1) // page * page  # keep the last token uncached: it yields the logits
        cached, by_tier, reason = 0, {}, self.unusable
        cache = self._empty_cache()
        if loadable and reason is None:
            try:
                full = self.store.keys(arr[: arr.size // page * page], salt=self.salt) if self._on_runtime else []
                hit = self.store.load(arr[:loadable], salt=self.salt, **self._route(full))
            except (KvrayError, OSError) as exc:  # a cache must never fail the request: recompute
                reason = f"kvray load failed: {exc!r}"
                log.warning("%s; recomputing the prompt", reason)
            else:
                cached, by_tier = hit.tokens, hit.pages_by_tier
                if cached:
                    cache = self._cache_from(hit.kv)
        out = self.model(
            input_ids=torch.from_numpy(arr[cached:].astype(np.int64))[None].to(self.model.device),
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        stored = 0 if reason else self._store_new_pages(arr, out.cache, cached // page)
        return Prefill(
            logits=out.logits[0, -1],
            cache=out.cache,
            cached_tokens=cached,
            computed_tokens=arr.size - cached,
            stored_pages=stored,
            pages_by_tier=by_tier,
            miss_reason=reason,
            seconds=time.perf_counter() - t0,
        )

    @torch.inference_mode()
    def generate(self, tokens: Sequence[int] | np.ndarray, max_new_tokens: int) -> tuple[list[int], Prefill]:
        """Greedy decode after a cached prefill; the pages of prompt + reply are stored too,
        so that the next turn of a conversation finds its whole history cached."""
        first = self.prefill(tokens)
        reply, cache = greedy_decode(self.model, first.logits, first.cache, max_new_tokens)
        if first.miss_reason is None:
            history = np.concatenate([as_token_array(tokens), np.asarray(reply[:-1], dtype=np.int32)])
            self._store_new_pages(history, cache, len(tokens) // self.layout.page_tokens)
        return reply, first

    @property
    def _on_runtime(self) -> bool:
        return isinstance(self.store, RuntimePages)

    def _route(self, keys: Sequence[int]) -> dict[str, int]:
        """On a runtime, the routing key of the chain of a prompt's full pages ``keys``, for
        the lookup (of one page fewer when the last token ends a page) and the store alike:
        both ask the controller shard that chain routes to (with ``controller_route_depth``
        d a prompt of at most d + 1 pages routes by its last page, so the lookup's own
        keys would ask another shard than the store commits to, and the prompt missed on
        every repeat). Nothing in process, or with no full page."""
        return {"route_key": self.store.route_key(keys)} if self._on_runtime and len(keys) else {}

    # -- between DynamicCache and pages ---------------------------------------------------
    def _empty_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def _cache_from(self, kv: torch.Tensor):
        """A DynamicCache holding ``kv`` ([layers, 2, tokens, kv_heads, head_dim])."""
        from transformers import DynamicCache

        device = self.model.device
        per_layer = [
            (kv[layer, 0].transpose(0, 1)[None].to(device), kv[layer, 1].transpose(0, 1)[None].to(device))
            for layer in range(self.layout.layers)
        ]
        return DynamicCache(ddp_cache_data=per_layer, config=self.model.config)

    def _store_new_pages(self, arr: np.ndarray, cache, first_page: int) -> int:
        """Pack the cache's full pages that kvray lacks (from ``first_page`` on) and store them
        as the continuation of the cached chain; pages loaded or stored before are skipped."""
        page = self.layout.page_tokens
        full_pages = min(arr.size, cache.get_seq_length()) // page
        if full_pages <= first_page:
            return 0
        keys = self.store.keys(arr[: full_pages * page], salt=self.salt)
        first = max(first_page, self.store.match(keys))
        if first == full_pages:
            return 0
        start, end = first * page, full_pages * page
        # [layers, 2, kv_heads, tokens, head_dim] -> [pages, layers, 2, page, kv_heads, head_dim]
        kv = torch.stack([torch.stack((layer.keys[0, :, start:end], layer.values[0, :, start:end])) for layer in cache.layers])
        pages = kv.unflatten(3, (full_pages - first, page)).permute(3, 0, 1, 4, 2, 5).contiguous().cpu()
        raw = pages.view(torch.uint8).reshape(full_pages - first, self.layout.page_nbytes).numpy()
        parent = keys[first - 1] if first else None
        try:
            return self.store.put_pages(keys[first:], raw, self.store.fingerprint.digest, parent_key=parent, **self._route(keys))
        except (KvrayError, OSError) as exc:
            log.warning("kvray could not store %d pages: %r", full_pages - first, exc)
            return 0


@torch.inference_mode()
def greedy_decode(model: torch.nn.Module, logits: torch.Tensor, cache, max_new_tokens: int) -> tuple[list[int], object]:
    """``max_new_tokens`` greedy tokens following a prefill's last ``logits`` and ``cache``;
    the cache comes back holding the KV of all but the last token."""
    reply = [int(logits.argmax())]
    for _ in range(max_new_tokens - 1):
        step = model(input_ids=torch.tensor([[reply[-1]]], device=model.device), cache=cache, use_cache=True)
        cache = step.cache
        reply.append(int(step.logits[0, -1].argmax()))
    return reply, cache
