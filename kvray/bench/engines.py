"""Time to first token with real engines: kvray's hit against the engine's best and worst case.

Model: ``bench-llama`` (data/models/): 4 layers, hidden 1,024, 8 query / 2 KV heads
(grouped-query attention), head dim 128, FFN 3,584 (Llama-3 proportions: FFN 3.5x hidden,
4 query heads per KV head), vocab 8,192, ~71 M parameters, float32, random weights. Its
per-layer compute mix (projections and MLP dominate, attention grows with context) is a
real Llama's, and a 2,048-token prefill takes 2-4 s on a CPU core.

- ``hf_ttft_hit_vs_suffix_only``: a 2,048-token prompt whose first 1,792 tokens are in
  kvray's host tier (7 pages of 256 tokens) against computing only the 256-token suffix
  with the prefix KV already in the model's cache: kvray's overhead over a perfect cache.
- ``hf_ttft_hit_vs_recompute``: the same hit against a full 2,048-token prefill.
- ``vllm_ttft_kvray_hit_vs_vllm_prefix_cache``: vLLM with kvray loading a 1,792-token
  prefix against vLLM's own in-memory prefix cache hit on prompts of the same shape, paired
  request by request in one engine (see :func:`kvray.harness.vllm_runs.run_ttft`). Runs in the vLLM environment (see the Makefile's ``vllm-env``), its OpenMP
  threads bound to one core (see :mod:`kvray.engines.timing`).
"""

from __future__ import annotations

import statistics

import numpy as np
import torch

from kvray.bench import BenchResult, benchmark, paired_medians
from kvray.core.config import StoreConfig, TierSizes
from kvray.core.store import PageStore
from kvray.engines.hf import CachedCausalLM, model_layout
from kvray.engines.timing import torch_threads
from kvray.harness.tiny import tiny_llama
from kvray.harness.vllm_env import run_in_vllm_env

MODEL = "bench-llama"
PROMPT, PREFIX, PAGE = 2048, 1792, 256
# One intra-op thread: see kvray.engines.timing for why.
HF_THREADS = 1
SHAPE = {"model": MODEL, "layers": 4, "hidden": 1024, "ffn": 3584, "heads": 8, "kv_heads": 2, "head_dim": 128, "dtype": "float32"}


def _prompt(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 8000, n)


def _hf_figures(quick: bool) -> tuple[tuple[float, float], tuple[float, float]]:
    """Paired median seconds of (kvray hit, suffix only with the prefix KV in the model's
    cache) and of (kvray hit, full prefill)."""
    model = tiny_llama(MODEL)
    layout = model_layout(model.config, model.dtype, PAGE)
    store = PageStore(StoreConfig(layout=layout, model_name=MODEL, tiers=TierSizes(host=64)))
    lm = CachedCausalLM(model, store)
    prompt = _prompt(PROMPT, seed=0)
    lm.prefill(prompt[: PREFIX + 1])  # puts the 1,792-token prefix (7 pages) in the host tier
    repeats = 3 if quick else 7

    def kvray_hit() -> None:
        result = lm.prefill(prompt)
        assert result.cached_tokens == PREFIX and result.pages_by_tier == {"host": PREFIX // PAGE}

    with torch.inference_mode():
        prefix_cache = model(input_ids=torch.from_numpy(prompt[:PREFIX])[None], use_cache=True).cache
        suffix = torch.from_numpy(prompt[PREFIX:])[None]
        whole = torch.from_numpy(prompt)[None]

        def suffix_only() -> None:
            model(input_ids=suffix, cache=prefix_cache, use_cache=True, logits_to_keep=1)
            prefix_cache.crop(-(PROMPT - PREFIX))  # back to the prefix alone

        def recompute() -> None:
            model(input_ids=whole, use_cache=True, logits_to_keep=1)

        against_suffix = paired_medians(kvray_hit, suffix_only, repeats)
        against_full = paired_medians(kvray_hit, recompute, max(2, repeats // 2))
    store.close()
    return against_suffix, against_full


@benchmark("hf_ttft")
def hf_ttft(quick: bool) -> list[BenchResult]:
    with torch_threads(HF_THREADS):
        (hit, suffix_s), (hit_again, full_s) = _hf_figures(quick)
    params = {
        **SHAPE,
        "prompt_tokens": PROMPT,
        "cached_tokens": PREFIX,
        "page_tokens": PAGE,
        "tier": "host",
        "torch_threads": HF_THREADS,
    }
    return [
        BenchResult("hf_ttft_hit_vs_suffix_only", hit * 1e3, suffix_s * 1e3, "ms", "<= 1.3", params),
        BenchResult("hf_ttft_hit_vs_recompute", hit_again * 1e3, full_s * 1e3, "ms", "<= 0.25", params),
    ]


def vllm_ttft_row(name: str, quick: bool, dtype: str = "float32", cpu_core: str | None = "0") -> BenchResult:
    """kvray's 1,792-token hit against vLLM's own prefix-cache hit, paired in one engine
    (``cpu_core``: the core vLLM's CPU worker binds its OpenMP threads to; None on a GPU)."""
    block = 64
    pairs = 3 if quick else 8
    suffixes = [_prompt(PROMPT - PREFIX, seed=2 + i).tolist() for i in range(1 + 2 * pairs)]
    spec = {
        "run": "ttft",
        "model": MODEL,
        "block_size": block,
        "dtype": dtype,
        "kvray": {"host_pages": 256},
        "prefix": _prompt(PREFIX, seed=1).tolist(),
        "suffixes": suffixes,
    }
    if cpu_core is not None:
        spec["omp_threads_bind"] = cpu_core
    run = run_in_vllm_env(spec, timeout=600)
    loaded, expected = run["counters"]["loaded_pages"], pairs * PREFIX // block
    if loaded != expected:
        raise AssertionError(f"kvray loaded {loaded} pages, expected {expected}: the figure would not be a hit")
    params = {**SHAPE, "dtype": dtype, "prompt_tokens": PROMPT, "cached_tokens": PREFIX, "block_tokens": block, "tier": "host"}
    if cpu_core is not None:
        params["omp_threads"] = 1
    return BenchResult(
        name,
        statistics.median(run["times_s"]["kvray"]) * 1e3,
        statistics.median(run["times_s"]["vllm"]) * 1e3,
        "ms",
        "<= 1.5",
        params,
    )


@benchmark("vllm_ttft_kvray_hit_vs_vllm_prefix_cache")
def vllm_ttft(quick: bool) -> list[BenchResult]:
    return [vllm_ttft_row("vllm_ttft_kvray_hit_vs_vllm_prefix_cache", quick)]
