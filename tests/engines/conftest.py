"""Fixtures for the engine tests: a tiny Llama with grouped-query attention, random weights."""

from __future__ import annotations

import pytest
import torch

from kvray.harness.tiny import seeded_checkpoint, tiny_llama

RUNTIME_BLOCK = 64  # tokens per page of the engines on a runtime (ray_nodes_spec)


@pytest.fixture(scope="session")
def llama_fp32():
    return tiny_llama(dtype=torch.float32)


@pytest.fixture(scope="session")
def llama_bf16():
    return tiny_llama(dtype=torch.bfloat16)


def runtime_engine(runtime: str) -> dict:
    """An engine's kvray settings on ``runtime``: no in-process tier, so every hit is the
    runtime's; a fixed model name (not the temporary path) fixes the prompts' page keys."""
    return {"kvray_runtime": runtime, "host_pages": 0, "model_name": "tiny-llama-seeded"}


def ray_nodes_spec(tmp_path_factory, runtime: str, steps: list[dict], **fields) -> dict:
    """The spec of a ``ray_nodes`` run (:func:`kvray.harness.vllm_runs.run_on_ray_nodes`) of
    the seeded tiny Llama on a runtime named ``runtime`` (64 host pages a node), 12 greedy
    output tokens a prompt; ``fields`` add to it or override it."""
    model = str(seeded_checkpoint(tmp_path_factory.mktemp("tiny-llama-seeded")))
    spec = {"run": "ray_nodes", "model": model, "block_size": RUNTIME_BLOCK, "max_tokens": 12, "runtime": runtime}
    return {**spec, "host_pages": 64, "steps": steps, **fields}
