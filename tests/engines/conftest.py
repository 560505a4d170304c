"""Fixtures for the engine tests: a tiny Llama with grouped-query attention, random weights."""

from __future__ import annotations

import pytest
import torch

from kvray.harness.tiny import tiny_llama


@pytest.fixture(scope="session")
def llama_fp32():
    return tiny_llama(dtype=torch.float32)


@pytest.fixture(scope="session")
def llama_bf16():
    return tiny_llama(dtype=torch.bfloat16)
