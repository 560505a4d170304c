"""Fair CPU timings of model forwards on a small, shared machine.

On 2 cores that other work also uses, a 2-thread forward stalls at every OpenMP barrier
while a core is taken. The stall is paid per operation, so it costs a short forward (a
256-token suffix, a 2-layer model) far more than a long one with the same number of
operations, and TTFT comparisons swing run to run (a hit/recompute ratio measured 0.15
to 0.45 here). With one intra-op thread both sides pay the same per-op cost and the
ratio measures the work saved.

Example::
    import time, torch
    from kvray.engines.timing import torch_threads

    with torch_threads(1):
        start = time.perf_counter()
        torch.randn(256, 256) @ torch.randn(256, 256)
        seconds = time.perf_counter() - start
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run the block with ``count`` intra-op threads; restore the previous count after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
