"""Real vLLM engine runs with and without ``KVRayConnector``: what the engine tests and the
TTFT benchmark ask of vLLM's environment (:func:`kvray.harness.vllm_env.run_in_vllm_env`
starts this module there). Inside the vLLM environment::

    python -m kvray.harness.vllm_runs '{"run": "serve", "model": "tiny-llama", "block_size": 64, "max_tokens": 8,
                                        "engines": [{"kvray": {"host_pages": 256}, "prompts": [[1, 2, 3]]}]}'

Each run (:data:`RUNS`) takes a JSON spec and prints one JSON object; its engines are made
by :mod:`kvray.harness.vllm_engine`, and faults are injected with
:mod:`kvray.harness.faults`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from kvray.harness.faults import break_store
from kvray.harness.tiny import model_path
from kvray.harness.vllm_engine import close_llm, connector_of, counters_of, engine_args, generate, make_llm


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
    ``kvray_runtime``; the actor is connected to Ray already. The runtime has
    ``spec["controller_shards"]`` controller shards (default 1), ``spec["cluster_policy"]``
    (default ``local-first``) and node policy ``spec["policy"]`` (default ``lru``). Reports
    each step's node and engine results (a step with ``policy_stats`` true: each store's
    policy counters after it too), and each shard's lookups and leases still open at the
    end; with ``spec["compare_copies"]``, also what :func:`copies_on_both` finds.
    """
    import ray
    from ray.cluster_utils import Cluster

    from kvray.cluster import Runtime, RuntimeConfig
    from kvray.cluster.runtime import on_node
    from kvray.core.config import TierSizes
    from kvray.engines.hf import checkpoint_layout
    from kvray.harness import vllm_runs  # by name, not __main__, so Ray workers import it

    cluster = Cluster(initialize_head=True, head_node_args={**NODE_ARGS, "include_dashboard": False})
    cluster.add_node(**NODE_ARGS)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    runtime = None
    try:
        layout = checkpoint_layout(model_path(spec["model"]), spec["block_size"])
        config = RuntimeConfig(
            name=spec["runtime"],
            layout=layout,
            tiers=TierSizes(host=spec["host_pages"]),
            controller_shards=spec.get("controller_shards", 1),
            cluster_policy=spec.get("cluster_policy", "local-first"),
            policy=spec.get("policy", "lru"),
        )
        runtime = Runtime.start(config)
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
            if step.get("policy_stats"):
                steps[-1]["policy_stats"] = {node: s["policy"] for node, s in runtime.store_stats().items()}
        for host in hosts.values():
            ray.kill(host)
        snapshots = ray.get([shard.snapshot.remote() for shard in runtime.shards.handles], timeout=60)
        shards = [{"lookups": s["lookups"], "open_leases": s["open_leases"]} for s in snapshots]
        copies = {"copies": copies_on_both(runtime, nodes)} if spec.get("compare_copies") else {}
        return {"nodes": nodes, "steps": steps, "shards": shards, **copies}
    finally:
        if runtime is not None:
            runtime.close()
        ray.shutdown()
        cluster.shutdown()


NODE_ARGS = {"num_cpus": 1, "object_store_memory": 100 << 20}


def copies_on_both(runtime, nodes: list[str]) -> dict:
    """The pages each node's store holds, how many both hold, and how many of those read
    back byte for byte the same from each: a page one node copied (``replicate``) from the
    other is exact there only if every byte is."""
    import numpy as np
    import ray

    held = [ray.get(runtime.stores[node].info.remote(), timeout=60)["keys"] for node in nodes]
    both = sorted(set(held[0]).intersection(*held[1:]))
    rows = [ray.get(runtime.stores[node].get_pages.remote(both), timeout=60) for node in nodes]
    whole = all(len(r) == len(both) for r in rows)  # a store that ends its prefix early read some page as bad
    equal = sum(all(np.array_equal(row[i], rows[0][i]) for row in rows) for i in range(len(both))) if whole else 0
    return {"held": [len(keys) for keys in held], "on_both": len(both), "equal": equal}


class EngineHost:
    """A Ray actor's body: vLLM engines served one after another on its node."""

    def serve(self, spec: dict, engines: list[dict]) -> dict:
        import ray

        return {"node": ray.get_runtime_context().get_node_id(), "engines": [serve_prompts(spec, e) for e in engines]}


def run_serve_on_ray(spec: dict) -> dict:
    """The Ray Serve deployment of :mod:`kvray.engines.vllm.serve` on ``spec["nodes"]``
        local Ray nodes (``ray.cluster_utils.Cluster``, one CPU each; default 1) with a kvray
        runtime: ``spec["replicas"]`` engine replicas (at most one per node; vLLM's prefix cache
        off, so every reused token is kvray's) routed by ``spec["router"]`` (default ``kvray``,
    with ``spec["router_settings"]``).
        Each of ``spec["steps"]`` is a list of prompts POSTed at once to the HTTP endpoint
        (one thread each), the steps one after another; reports each step's answers (each
        with the node that served it) and the nodes, head first. The worker stores pages on
        its I/O thread, off the request's path, so an answer can arrive before its pages are
        stored: the next step starts once the runtime holds every full block before the last
        token of the prompts so far (or after 60 s), so that the run measures reuse, not that
        race."""
    from concurrent.futures import ThreadPoolExecutor

    import ray
    from ray import serve

    from kvray.engines.vllm.serve import start_runtime_for, vllm_app

    with serve_cluster(spec.get("nodes", 1)) as port:
        runtime = None
        try:
            args = engine_args(spec["model"], False, spec["block_size"])
            model, block_size, dtype = args.pop("model"), args.pop("block_size"), args.pop("dtype")
            runtime = start_runtime_for(model, block_size, dtype, name=spec["runtime"], host_pages=64, detached=False)
            nodes = sorted(runtime.stores, key=lambda n: n != ray.get_runtime_context().get_node_id())  # head first
            app = vllm_app(
                model,
                block_size,
                dtype,
                runtime=spec["runtime"],
                num_replicas=spec.get("replicas", 1),
                kvray={"host_pages": 0},
                engine=args,
                router=spec.get("router", "kvray"),
                router_settings=spec.get("router_settings"),
                replica_options={"max_replicas_per_node": 1},
            )
            serve.run(app, name="kvray-vllm")
            steps = []
            blocks: set[tuple[int, ...]] = set()  # distinct full blocks before each prompt's last token
            with ThreadPoolExecutor(max_workers=max(len(step) for step in spec["steps"])) as pool:
                for step in spec["steps"]:
                    steps.append(list(pool.map(lambda prompt: _post(port, prompt, spec["max_tokens"]), step)))
                    for prompt in step:
                        blocks.update(tuple(prompt[:end]) for end in range(block_size, len(prompt), block_size))
                    deadline = time.monotonic() + 60
                    while sum(s["pages"] for s in runtime.store_stats().values()) < len(blocks) and time.monotonic() < deadline:
                        time.sleep(0.05)
            return {"nodes": nodes, "steps": steps}
        finally:
            if runtime is not None:
                runtime.close()


@contextmanager
def serve_cluster(nodes: int) -> Iterator[int]:
    """``nodes`` local Ray nodes (``ray.cluster_utils.Cluster``, one CPU each) joined by this
    process, with Ray Serve's HTTP proxy on a free port of the head (yielded); all shut
    down on exit."""
    import socket

    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    with socket.socket() as probe:  # a free port: other Serve instances may hold 8000
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # Serve kills a proxy that is not ready within 5 s and then fails serve.start: on a
    # machine busy with vLLM engines the proxy's start-up alone can take longer. The Serve
    # controller reads these when it starts, from the environment this local Ray inherits.
    for setting in ("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S"):
        os.environ.setdefault(setting, "120")
    cluster = Cluster(initialize_head=True, head_node_args={**NODE_ARGS, "include_dashboard": False})
    for _ in range(nodes - 1):
        cluster.add_node(**NODE_ARGS)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


def _post(port: int, prompt: list[int], max_tokens: int) -> dict:
    """One request to the Serve endpoint on ``port``; its answer."""
    import urllib.request

    body = json.dumps({"prompt_token_ids": prompt, "max_tokens": max_tokens}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


RUNS = {"serve": run_serve, "ttft": run_ttft, "ray_nodes": run_on_ray_nodes, "serve_on_ray": run_serve_on_ray}


def main(argv: list[str]) -> None:
    spec = json.loads(argv[1])
    result = RUNS[spec["run"]](spec)
    sys.stdout.flush()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv)
