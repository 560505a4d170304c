"""One vLLM engine in this process, as every harness run makes it (runs in vLLM's environment).

Every engine uses a model config from data/models/ with ``load_format="dummy"``, or a
seeded random checkpoint of one (see :func:`kvray.harness.tiny.seeded_checkpoint`:
correctness tests need outputs that depend on the whole prompt, which vLLM's dummy
weights in +-1e-3 do not give), ``skip_tokenizer_init=True``, ``enforce_eager=True`` and
the engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), greedy sampling; the
connector, when asked for, is ``KVRayConnector`` (:mod:`kvray.engines.vllm`).
"""

from __future__ import annotations

import os
import time

from kvray.harness.tiny import model_path


def engine_args(
    model: str,
    prefix_caching: bool,
    block_size: int,
    dtype: str = "float32",
    kv_cache_bytes: int = 256 << 20,
    max_model_len: int = 4096,
) -> dict:
    """``vllm.LLM`` arguments of every run (see the module docstring), but the connector.

    ``model`` is a data/models/ name (dummy weights) or a directory holding a checkpoint,
    such as :func:`kvray.harness.tiny.seeded_checkpoint` writes (its weights are loaded).
    ``kv_cache_bytes`` is vLLM's own KV space (its running requests and prefix cache).
    """
    path = model_path(model)
    return {
        "model": str(path),
        "load_format": "safetensors" if any(path.glob("*.safetensors")) else "dummy",
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "dtype": dtype,
        "max_model_len": max_model_len,
        "block_size": block_size,
        "enable_prefix_caching": prefix_caching,
        "kv_cache_memory_bytes": kv_cache_bytes,
        "seed": 0,
    }


def make_llm(
    model: str,
    kvray: dict | None,
    prefix_caching: bool,
    block_size: int,
    dtype: str = "float32",
    kv_cache_bytes: int = 256 << 20,
    max_model_len: int = 4096,
    transfer: dict | None = None,
):
    """A vLLM engine of :func:`engine_args` with ``KVRayConnector`` when ``kvray`` is given,
    or another connector's ``kv_transfer_config`` (``transfer``, LMCache's for the served
    benchmark's contender)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    from kvray.engines.vllm.connector import kv_transfer_config

    if kvray is not None:
        transfer = kv_transfer_config(kvray)
    elif transfer is not None:
        from vllm.config import KVTransferConfig

        transfer = KVTransferConfig(**transfer)
    args = engine_args(model, prefix_caching, block_size, dtype, kv_cache_bytes, max_model_len)
    return LLM(**args, kv_transfer_config=transfer)


def connector_of(llm):
    """The scheduler's ``KVRayConnector`` of an in-process engine (for counters and faults)."""
    return llm.llm_engine.engine_core.engine_core.scheduler.get_kv_connector()


def wake_on_kv(llm, callback) -> None:
    """Have the connector of an in-process engine on a kvray runtime call ``callback()``
    whenever a lookup or a load of its ends (from the thread that ran it), so a loop that
    steps the engine can sleep while every request waits for its KV
    (:mod:`kvray.harness.vllm_serving`). No-op for an in-process store, which looks up and
    loads on vLLM's own thread."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    lookups = connector_of(llm).scheduler.lookups
    if lookups is not None:
        lookups.on_done = callback
        get_kv_transfer_group().worker.on_load_end = callback


def generate(llm, prompt: list[int] | dict, max_tokens: int) -> tuple[list[int], float]:
    """Greedy output tokens of one prompt (token ids, or ``{"tokens": [...]}`` with a
    ``"cache_salt"`` and/or the client's ``"kv_transfer_params"``) and the wall time of the call."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    transfer = None
    if isinstance(prompt, dict):
        request = TokensPrompt(prompt_token_ids=prompt["tokens"])
        if "cache_salt" in prompt:
            request["cache_salt"] = prompt["cache_salt"]
        transfer = prompt.get("kv_transfer_params")
    else:
        request = TokensPrompt(prompt_token_ids=prompt)
    extra = {"kv_transfer_params": transfer} if transfer is not None else None
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False, ignore_eos=True, extra_args=extra)
    t0 = time.perf_counter()
    out = llm.generate([request], params, use_tqdm=False)
    return list(out[0].outputs[0].token_ids), time.perf_counter() - t0


def counters_of(llm) -> dict[str, int]:
    """The connector's counters, both sides summed (in-process engine): the scheduler
    counts lookups and hits, the worker what it loaded and stored on a kvray runtime, once
    its loads and stores in flight have ended."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    scheduler, worker = connector_of(llm).scheduler, get_kv_transfer_group().worker
    worker.flush()
    return {k: v + worker.counters[k] for k, v in scheduler.counters.items()}


def close_llm(llm) -> None:
    """Shut an engine down (its connector closes its store) so another can start here."""
    import gc

    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()
