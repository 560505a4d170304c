"""Two transformers engines (``CachedCausalLM``) on two Ray nodes share KV through one kvray runtime.

Each engine is a Ray actor pinned to its node of the session's local cluster
(``ray.cluster_utils.Cluster``, see tests/conftest.py), holding the same tiny Llama
(seeded random weights) and opened on the runtime by name. Engine B's prompt shares its
first 9 pages with engine A's: B loads them from A's node and its logits equal a full
recompute of its prompt.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import ray
import torch

from kvray.cluster import Runtime, RuntimeConfig
from kvray.cluster.runtime import alive_nodes, on_node
from kvray.core.config import TierSizes
from kvray.core.store import PageStore
from kvray.engines.hf import CachedCausalLM, model_layout
from kvray.engines.runtime import ADDRESS_ENV, RUNTIME_ENV, RuntimePages, RuntimeTarget, runtime_target
from kvray.harness.tiny import tiny_llama

PAGE = 16
FP32_TOL = 1e-4
RUNTIME = "kvray-hf-nodes"

pytestmark = pytest.mark.ray


@ray.remote(num_cpus=0)
class HfEngine:
    """A transformers engine on one node, its pages on the runtime ``RUNTIME``."""

    def __init__(self) -> None:
        self.lm = CachedCausalLM.open(tiny_llama(), "tiny-llama", page_tokens=PAGE, kvray_runtime=RUNTIME)

    def prefill(self, tokens: list[int]) -> dict:
        result = self.lm.prefill(tokens)
        return {
            "node": ray.get_runtime_context().get_node_id(),
            "on_runtime": isinstance(self.lm.store, RuntimePages),
            "cached_tokens": result.cached_tokens,
            "stored_pages": result.stored_pages,
            "logits": result.logits.numpy(),
            "paths": dict(self.lm.store.pages_by_path),
        }


@pytest.fixture(scope="module")
def runtime(ray_cluster):
    layout = model_layout(tiny_llama().config, torch.float32, PAGE)
    runtime = Runtime.start(RuntimeConfig(name=RUNTIME, layout=layout, tiers=TierSizes(host=64)))
    yield runtime
    runtime.close()


def recompute(model, tokens) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens]))[0][0, -1]


def test_engine_on_another_node_loads_the_prefix_and_matches_recompute(runtime):
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 1000, 9 * PAGE).tolist()
    prompt_a, prompt_b = shared + rng.integers(3, 1000, 6).tolist(), shared + rng.integers(3, 1000, 10).tolist()
    node_a, node_b = alive_nodes()[:2]
    engine_a = HfEngine.options(scheduling_strategy=on_node(node_a)).remote()
    engine_b = HfEngine.options(scheduling_strategy=on_node(node_b)).remote()
    a = ray.get(engine_a.prefill.remote(prompt_a), timeout=300)
    b = ray.get(engine_b.prefill.remote(prompt_b), timeout=300)
    assert (a["node"], b["node"]) == (node_a, node_b) and a["on_runtime"] and b["on_runtime"]
    assert (a["cached_tokens"], a["stored_pages"]) == (0, 9)
    assert b["cached_tokens"] == 9 * PAGE and b["paths"] == {"tcp": 9}  # every page from A's node
    model = tiny_llama()
    assert np.abs(b["logits"] - recompute(model, prompt_b).numpy()).max() <= FP32_TOL
    assert np.abs(b["logits"] - recompute(model, prompt_a).numpy()).max() > FP32_TOL  # the check can fail
    for engine in (engine_a, engine_b):
        ray.kill(engine)


def test_runtime_not_running_falls_back_to_an_in_process_store(ray_cluster, caplog):
    with caplog.at_level(logging.WARNING, logger="kvray.engines.runtime"):
        lm = CachedCausalLM.open(tiny_llama(), "tiny-llama", page_tokens=PAGE, kvray_runtime="no-such-runtime")
    assert isinstance(lm.store, PageStore) and "no-such-runtime" in caplog.text
    tokens = list(range(3, 3 + 3 * PAGE + 1))
    lm.prefill(tokens)
    assert lm.prefill(tokens).cached_tokens == 3 * PAGE
    lm.store.close()


def test_settings_win_over_environment(monkeypatch):
    monkeypatch.delenv(ADDRESS_ENV, raising=False)
    monkeypatch.delenv(RUNTIME_ENV, raising=False)
    assert runtime_target() is None
    monkeypatch.setenv(ADDRESS_ENV, "10.0.0.1:6379")
    assert runtime_target() == RuntimeTarget("10.0.0.1:6379", "kvray")
    monkeypatch.setenv(RUNTIME_ENV, "from-env")
    assert runtime_target(name="from-setting") == RuntimeTarget("10.0.0.1:6379", "from-setting")
    assert runtime_target(address="auto") == RuntimeTarget("auto", "from-env")


READER = """
import json, sys
from kvray.engines.hf import CachedCausalLM
from kvray.harness.tiny import tiny_llama

lm = CachedCausalLM.open(tiny_llama(), "tiny-llama", page_tokens=int(sys.argv[1]))  # the runtime comes from the environment
result = lm.prefill(json.loads(sys.argv[2]))
print(json.dumps({"on_runtime": type(lm.store).__name__, "cached_tokens": result.cached_tokens, "logits": result.logits.tolist()}))
"""


def test_process_outside_ray_finds_the_runtime_by_environment(runtime, ray_cluster):
    """A plain process (no Ray connection of its own) named to the runtime by
    $KVRAY_RAY_ADDRESS and $KVRAY_RUNTIME loads the pages this test's engine stored."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    tokens = np.random.default_rng(1).integers(3, 1000, 5 * PAGE + 3).tolist()
    writer = CachedCausalLM.open(tiny_llama(), "tiny-llama", page_tokens=PAGE, kvray_runtime=RUNTIME)
    assert isinstance(writer.store, RuntimePages) and writer.prefill(tokens).stored_pages == 5
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, ADDRESS_ENV: ray_cluster.address, RUNTIME_ENV: RUNTIME, "PYTHONPATH": str(root)}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run(
        [sys.executable, "-c", READER, str(PAGE), json.dumps(tokens)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    read = json.loads(done.stdout.strip().splitlines()[-1])
    assert read["on_runtime"] == "RuntimePages" and read["cached_tokens"] == 5 * PAGE
    assert np.abs(np.asarray(read["logits"]) - recompute(tiny_llama(), tokens).numpy()).max() <= FP32_TOL
    writer.store.close()
