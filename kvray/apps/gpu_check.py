"""``make gpu-check``: the CUDA paths on a machine that has a GPU, in under 8 minutes.

The Makefile runs this with the interpreter of ``.venv-gpu`` (vLLM's CUDA build and kvray,
installed there first; installing is not counted in the 8 minutes) only where
``nvidia-smi`` lists a device; elsewhere it prints that there is none and exits 0.

It runs the device-tier tests (``tests/core/test_device_cuda.py`` and the core tests whose
pools or stores have a device tier, which is CUDA wherever torch sees it) and then
``kvray bench --only gpu --quick`` (:mod:`kvray.bench.gpu`), writing the bench's JSON to
``results/gpu-check.json``. The exit status is non-zero when torch sees no CUDA device
although the driver lists one, when a test fails, or when time runs out.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

DEADLINE_S = 8 * 60
# the core tests whose pools or stores have a device tier: on CUDA they all run on the GPU
TESTS = [
    f"tests/core/{name}.py"
    for name in ("test_device_cuda", "test_pools", "test_slots", "test_store", "test_store_chain", "test_store_properties")
]


def run(command: list[str], deadline: float, **kwargs) -> int:
    left = deadline - time.monotonic()
    if left <= 0:
        print(f"gpu-check: out of time before {' '.join(command)}")
        return 124
    try:
        return subprocess.run(command, timeout=left, **kwargs).returncode
    except subprocess.TimeoutExpired:
        print(f"gpu-check: {' '.join(command)} ran past the {DEADLINE_S} s budget")
        return 124


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print(f"gpu-check: the driver lists a GPU but torch {torch.__version__} sees no CUDA device: check the CUDA build")
        return 1
    print(f"gpu-check: {torch.cuda.get_device_name()} (torch {torch.__version__}, CUDA {torch.version.cuda})", flush=True)
    deadline = time.monotonic() + DEADLINE_S
    tests = run([sys.executable, "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider", *TESTS], deadline)
    out = Path("results")
    out.mkdir(exist_ok=True)
    with open(out / "gpu-check.json", "w") as sink:
        bench = run([sys.executable, "-m", "kvray", "bench", "--only", "gpu", "--quick", "--json"], deadline, stdout=sink)
    print(f"gpu-check: device-tier tests exit {tests}, kvray bench --only gpu exit {bench} ({out / 'gpu-check.json'})")
    return tests or bench


if __name__ == "__main__":
    sys.exit(main())
