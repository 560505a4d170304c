"""vLLM's paged KV cache seen as kvray pages, per attention backend.

Imports no vLLM, so that the block layout arithmetic is testable anywhere torch is: it is
the part that differs between CPU and GPU backends.
"""

from __future__ import annotations

import numpy as np
import torch

from kvray.core.config import PageLayout
from kvray.core.errors import ConfigError
from kvray.core.pages import torch_dtype


class BlockCodec:
    """Moves pages between kvray's ``[layers, 2, block, kv_heads, head_dim]`` and vLLM's
    per-layer caches, viewed as ``[num_blocks, kv_heads, block, 2, head_dim]`` (K then V)
    whatever the backend stores physically.

    ``CPU_ATTN`` keeps, per block and head, ``block`` K rows then ``block`` V rows;
    ``FLASH_ATTN`` keeps K and V side by side in the last dimension of each token.

    Example::

        codec = BlockCodec("CPU_ATTN", [kv_caches[name] for name in layer_names], layout)
        codec.write([7, 8], pages)          # pages: [2, layers, 2, block, kv_heads, head_dim]
        codec.read([7, 8])                  # the same pages back
        codec.write_bytes([7, 8], rows)     # rows: [2, page_nbytes] uint8, as kvray stores pages
    """

    BACKENDS = ("CPU_ATTN", "FLASH_ATTN")

    def __init__(self, backend: str, layers: list[torch.Tensor], layout: PageLayout) -> None:
        if backend not in self.BACKENDS:
            raise ConfigError(f"KVRayConnector supports attention backends {self.BACKENDS}, not {backend}")
        expected = (layout.kv_heads, layout.page_tokens, 2 * layout.head_dim)
        for cache in layers:
            if cache.dim() != 4 or tuple(cache.shape[1:]) != expected or cache.dtype != torch_dtype(layout):
                raise ConfigError(
                    f"vLLM KV cache {tuple(cache.shape)} {cache.dtype} is not [blocks, {', '.join(map(str, expected))}] "
                    f"{layout.dtype}: it does not match the page layout {layout}"
                )
        self.layout = layout
        self.views = [self._view(backend, cache) for cache in layers]

    def _view(self, backend: str, cache: torch.Tensor) -> torch.Tensor:
        blocks, heads, tokens, _ = cache.shape
        if backend == "CPU_ATTN":  # [B, H, N, 2D] memory is [B, H, {K,V}, N, D]
            return cache.view(blocks, heads, 2, tokens, self.layout.head_dim).transpose(2, 3)
        return cache.unflatten(-1, (2, self.layout.head_dim))  # [B, H, N, {K,V}, D]

    def read(self, block_ids: list[int]) -> torch.Tensor:
        """Pages of ``block_ids``: ``[n, layers, 2, block, kv_heads, head_dim]`` on the CPU."""
        index = torch.tensor(block_ids, device=self.views[0].device)
        # per layer [n, H, N, 2, D] -> [n, 2, N, H, D]
        pages = torch.stack([view[index].permute(0, 3, 2, 1, 4) for view in self.views], dim=1)
        return pages.cpu()

    def write(self, block_ids: list[int], pages: torch.Tensor) -> None:
        """Copy ``pages`` (``[n, layers, 2, block, kv_heads, head_dim]``) into ``block_ids``."""
        index = torch.tensor(block_ids, device=self.views[0].device)
        pages = pages.to(self.views[0].device)
        for layer, view in enumerate(self.views):
            view[index] = pages[:, layer].permute(0, 3, 2, 1, 4)

    def read_bytes(self, block_ids: list[int]) -> np.ndarray:
        """Pages of ``block_ids`` as kvray stores them: ``[n, page_nbytes]`` uint8, a copy
        of its own (the blocks may be reused once it is taken)."""
        return self.read(block_ids).contiguous().view(torch.uint8).reshape(len(block_ids), -1).numpy()

    def write_bytes(self, block_ids: list[int], rows: np.ndarray) -> None:
        """Copy pages as kvray stores them (``[n, page_nbytes]`` uint8) into ``block_ids``."""
        pages = torch.from_numpy(rows).view(torch_dtype(self.layout))
        self.write(block_ids, pages.view(len(block_ids), *self.layout.page_shape))

    def wait_for_writes(self) -> None:
        """Wait until the copies this thread queued on its accelerator stream are done. On CUDA
        vLLM runs its forward on a stream of its own, which does not wait for another thread's
        (default) stream: a load reported done before this could be read half-written. On a
        CPU the copies are done when ``write`` returns."""
        if self.views[0].is_cuda:
            torch.cuda.current_stream(self.views[0].device).synchronize()
