"""Small Llama models with seeded random weights, built from the configs in data/models/.

No model hub is reachable where kvray's tests and benchmarks run, and KV reuse does not
care whether weights were trained: what matters is a real Llama forward pass with
grouped-query attention. vLLM reads the same ``config.json`` with ``load_format="dummy"``.

Example::
    import tempfile, torch
    from kvray.harness.tiny import seeded_checkpoint, tiny_llama

    model = tiny_llama()                                  # 2 layers, 4 heads / 2 KV heads
    bench = tiny_llama("bench-llama", torch.bfloat16)
    path = seeded_checkpoint(tempfile.mkdtemp())          # the same model as files, for vLLM
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvray.core.errors import ConfigError
from kvray.resources import bundled


def model_dir(name: str) -> Path:
    """Directory holding ``config.json`` of the named model (what vLLM's ``model=`` takes)."""
    models = bundled("data/models")
    path = models / name
    if not (path / "config.json").is_file():
        known = sorted(p.name for p in models.iterdir() if (p / "config.json").is_file())
        raise ConfigError(f"no model config {path / 'config.json'}; known models: {known}")
    return path


def model_path(model: str | Path) -> Path:
    """``model`` if it is a directory (a checkpoint), else the data/models/ config it names."""
    return Path(model) if Path(model).is_dir() else model_dir(str(model))


def tiny_llama(name: str = "tiny-llama", dtype: torch.dtype = torch.float32, seed: int = 0):
    """A ``LlamaForCausalLM`` of the named config, random weights from ``seed``, in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**json.loads((model_dir(name) / "config.json").read_text()))
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(dtype).eval()


def seeded_checkpoint(out_dir: str | Path, name: str = "tiny-llama", std: float = 0.1, seed: int = 0) -> Path:
    """Write a safetensors checkpoint of the named config with seeded N(0, std) weights
    (norm weights 1) to ``out_dir``, for engines that load weights from files.

    Weights this large make attention sharp enough that output tokens depend on the
    whole prompt, so comparing tokens detects a wrong KV page; tiny uniform weights
    (vLLM's ``load_format="dummy"``) would hide one.
    """
    model = tiny_llama(name, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param_name, param in sorted(model.named_parameters()):
            if "norm" in param_name:
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    out = Path(out_dir)
    model.save_pretrained(out)
    return out
