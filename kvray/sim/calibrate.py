"""Measuring this machine for the cost model: memory copies, disk, loopback network and
the prefill of a real (small, random-weight) Llama model, written out as a scenario.

On a CPU-only machine the "device" tier is host memory standing in for accelerator
memory (as :class:`~kvray.core.tiers.DevicePool` does), so both take the memcpy figure.
Every figure is a median of a few runs; the YAML says what was measured and when.

Example::
    from pathlib import Path
    from kvray.sim.calibrate import calibrate, write_scenario

    scenario = calibrate(Path("."), repeats=1, size_mib=1)   # measures here: takes a few seconds
    write_scenario(scenario, Path("this-machine.yaml"))
"""

from __future__ import annotations

import os
import platform
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import yaml

from kvray.core.config import PageLayout
from kvray.scenario import ComputeSpec, Scenario, TierSpec

MIB = 1 << 20


def _median_s(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def memcpy_gbps(nbytes: int, repeats: int) -> float:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    return nbytes / _median_s(lambda: np.copyto(dst, src), repeats) / 1e9


def disk_gbps(folder: Path, nbytes: int, repeats: int) -> tuple[float, float, float]:
    """(read GB/s with the page cache dropped for the file, write GB/s with fsync, 4 KiB read latency us)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "kvray-calibrate.bin"
    data = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8).tobytes()

    def write() -> None:
        with open(path, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())

    def read(size: int) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.read(fd, size)
        finally:
            os.close(fd)

    try:
        write_s = _median_s(write, repeats)
        read_s = _median_s(lambda: read(nbytes), repeats)
        latency_s = _median_s(lambda: read(4096), repeats)
    finally:
        path.unlink(missing_ok=True)
    return nbytes / read_s / 1e9, nbytes / write_s / 1e9, latency_s * 1e6


def loopback_gbps(nbytes: int, repeats: int) -> float:
    """TCP over the loopback interface: what a second node on this machine would see."""
    payload = b"\0" * nbytes
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def sink() -> None:
        conn, _ = server.accept()
        with conn:
            while conn.recv(4 * MIB):  # drain until the sender closes
                continue

    def send() -> None:
        receiver = threading.Thread(target=sink)
        receiver.start()
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.sendall(payload)
        receiver.join()

    try:
        return nbytes / _median_s(send, repeats) / 1e9
    finally:
        server.close()


def llama_prefill(layers: int, hidden: int, heads: int, kv_heads: int, repeats: int) -> tuple[float, float]:
    """(us per prompt token, fixed ms per prefill) of a random-weight Llama built from a
    config (no model hub), fitted over prompts of 256 and 1024 tokens."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
    )
    model = LlamaForCausalLM(config).eval()
    times = {}
    with torch.inference_mode():
        for tokens in (256, 1024):
            ids = torch.randint(0, config.vocab_size, (1, tokens))
            times[tokens] = _median_s(lambda ids=ids: model(ids, use_cache=True), repeats)
    per_token = (times[1024] - times[256]) / 768
    if per_token <= 0:  # the machine was busier for the short run: no fixed cost to fit
        per_token = times[1024] / 1024
    overhead = max(times[256] - 256 * per_token, 0.0)
    return per_token * 1e6, overhead * 1e3


def calibrate(disk_dir: Path | None = None, repeats: int = 3, size_mib: int = 64) -> Scenario:
    """Measure this machine and return a scenario of a small Llama served on it."""
    layers, hidden, heads, kv_heads = 4, 256, 8, 4
    layout = PageLayout(layers=layers, kv_heads=kv_heads, head_dim=hidden // heads, page_tokens=512, dtype="float32")
    nbytes = size_mib * MIB
    mem = memcpy_gbps(nbytes, repeats)
    with tempfile.TemporaryDirectory(dir=disk_dir) as tmp:
        disk_read, disk_write, disk_latency = disk_gbps(Path(tmp), nbytes, repeats)
    net = loopback_gbps(nbytes, repeats)
    us_per_token, overhead_ms = llama_prefill(layers, hidden, heads, kv_heads, repeats)
    return Scenario(
        name=f"calibrated-{platform.node() or 'host'}",
        description=f"measured by kvray calibrate on {platform.node()} at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}",
        layout=layout,
        tiers={
            "device": TierSpec(capacity_pages=256, read_gbps=mem, write_gbps=mem, latency_us=0),
            "host": TierSpec(capacity_pages=1024, read_gbps=mem, write_gbps=mem, latency_us=0),
            "disk": TierSpec(capacity_pages=4096, read_gbps=disk_read, write_gbps=disk_write, latency_us=disk_latency),
        },
        network_gbps=net,
        network_latency_us=0,
        compute=ComputeSpec(prefill_us_per_token=us_per_token, prefill_overhead_ms=overhead_ms, servers=1),
    )


def write_scenario(scenario: Scenario, path: Path) -> None:
    header = (
        f"# {scenario.description}\n"
        "# device/host: numpy memcpy of 64 MiB (CPU stand-in for accelerator memory); disk: fsync'd\n"
        "# write and a read with the file's page cache dropped; network: TCP over loopback;\n"
        "# compute: a random-weight Llama (4 layers, hidden 256) prefill, fitted over 256/1024 tokens.\n"
        "# Capacities are defaults: size them for your deployment.\n"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + yaml.safe_dump(scenario.model_dump(), sort_keys=False))
