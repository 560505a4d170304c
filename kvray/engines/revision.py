"""What names a checkpoint beyond its model name: the ``model_revision`` of its pages.

A persistent disk tier outlives the weights that filled it. If a checkpoint is replaced
under the same name (a fine-tune, a re-quantisation, a new download of a moving branch),
pages keyed by name and layout alone would hand the new weights the old weights' KV.
The engines therefore put a revision into the model fingerprint: the hub commit the
weights came from when the engine knows it (vLLM's ``revision``), a value the user gives
(the only thing that tells two local fine-tunes with one config apart), and a hash of the
model config, which changes with any architecture or hyperparameter edit.

Example::

    import torch
    from kvray import StoreConfig
    from kvray.engines.hf import model_layout
    from kvray.engines.revision import checkpoint_revision
    from kvray.harness.tiny import tiny_llama

    model = tiny_llama()
    revision = checkpoint_revision(model.config, "v2")   # "v2+config-<hash of the config>"
    layout = model_layout(model.config, torch.float32, page_tokens=16)
    config = StoreConfig(layout=layout, model_name="tiny-llama", model_revision=revision)
"""

from __future__ import annotations

import json
from typing import Any

import xxhash

# Keys of a transformers config that name where and with what it was loaded, not the model.
_NOT_THE_MODEL = ("_name_or_path", "transformers_version")


def checkpoint_revision(config: Any, revision: str | None = None, quantization: Any = None) -> str:
    """``<revision or "unversioned">+config-<hash>`` for a transformers config (``to_dict``),
    and ``+quant-<hash>`` of ``quantization`` (the method the engine runs the weights with,
    and its settings) when there is one.

    The hash covers every setting of the model but not its path or the transformers
    version, so moving a checkpoint or upgrading the library keeps its pages. A method
    the engine applies at load (vLLM's ``quantization="fp8"`` on a bf16 checkpoint) is in
    no config file, yet the KV it computes differs from the unquantized model's, so it is
    named apart (without one the revision is what it was before). A hash, not the name, so
    that the revision stays within its length however long the method's settings.
    """
    settings = {k: v for k, v in config.to_dict().items() if k not in _NOT_THE_MODEL}
    quantized = f"+quant-{_digest(quantization)}" if quantization else ""
    return f"{revision or 'unversioned'}+config-{_digest(settings)}{quantized}"


def _digest(value: Any) -> str:
    return xxhash.xxh3_64_hexdigest(json.dumps(value, sort_keys=True, default=str).encode())
