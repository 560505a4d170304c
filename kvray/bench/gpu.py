"""Benchmarks that need a CUDA device (``kvray bench --only gpu``; ``make gpu-check`` runs them).

- ``gpu_device_tier_write_vs_pinned_memcpy`` / ``..._read_...``: a request's pages into and
  out of the device tier through ``PageStore.store`` / ``load`` (keys, index, slots, the
  pinned staging rows of :class:`~kvray.core.tiers.DevicePool`, asynchronous copies on its
  stream, waited for at the end), against ``cudaMemcpyAsync`` (torch's ``copy_`` with
  ``non_blocking=True``) of the same number of bytes between a pinned host buffer and
  device memory, one call per page, then a synchronize. ``params`` carries the one-call
  copy of the whole request, the primitive's best case.
- ``gpu_vllm_ttft_kvray_hit_vs_vllm_prefix_cache``: :func:`kvray.bench.engines.vllm_ttft_row`
  on the GPU (bfloat16: vLLM's FLASH_ATTN backend has no float32), in the environment
  ``KVRAY_VLLM_PYTHON`` names (``make gpu-check`` builds one with vLLM's CUDA build).

Without CUDA each prints one line saying so and reports nothing.
"""

from __future__ import annotations

import sys

import torch

from kvray.bench import BenchResult, benchmark
from kvray.bench.core import PAGE_LAYERS, _TierCase
from kvray.bench.engines import vllm_ttft_row
from kvray.core.tiers import Tier


def cuda_or_say_why(name: str) -> bool:
    if torch.cuda.is_available():
        return True
    print(f"kvray bench: {name} not run: no CUDA device (torch {torch.__version__} sees none)", file=sys.stderr)
    return False


@benchmark("gpu_device_tier")
def device_tier(quick: bool) -> list[BenchResult]:
    if not cuda_or_say_why("gpu_device_tier"):
        return []
    results = []
    repeats = 7 if quick else 21
    for label, layers in PAGE_LAYERS.items():
        case = _TierCase(layers, "device", None, quick)
        pool = case.store.pools[Tier.DEVICE]
        pinned = torch.empty((case.pages, case.layout.page_nbytes), dtype=torch.uint8, pin_memory=True)
        device = torch.empty((case.pages, case.layout.page_nbytes), dtype=torch.uint8, device="cuda")

        def kvray_write() -> None:
            case.write()
            pool.synchronize()

        def kvray_read() -> None:
            case.read()

        def h2d() -> None:
            for i in range(case.pages):
                device[i].copy_(pinned[i], non_blocking=True)
            torch.cuda.synchronize()

        def d2h() -> None:
            for i in range(case.pages):
                pinned[i].copy_(device[i], non_blocking=True)
            torch.cuda.synchronize()

        def h2d_one_call() -> None:
            device.copy_(pinned, non_blocking=True)
            torch.cuda.synchronize()

        def d2h_one_call() -> None:
            pinned.copy_(device, non_blocking=True)
            torch.cuda.synchronize()

        gpu = torch.cuda.get_device_name()
        results += [
            case.result(f"gpu_device_tier_write_vs_pinned_memcpy[{label}]", kvray_write, h2d, h2d_one_call, repeats, gpu=gpu),
            case.result(f"gpu_device_tier_read_vs_pinned_memcpy[{label}]", kvray_read, d2h, d2h_one_call, repeats, gpu=gpu),
        ]
        case.store.close()
    return results


@benchmark("gpu_vllm_ttft")
def vllm_ttft_on_gpu(quick: bool) -> list[BenchResult]:
    if not cuda_or_say_why("gpu_vllm_ttft"):
        return []
    return [vllm_ttft_row("gpu_vllm_ttft_kvray_hit_vs_vllm_prefix_cache", quick, dtype="bfloat16", cpu_core=None)]
