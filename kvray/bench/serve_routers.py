"""Routing anchor (``kvray bench --only router_vs_prefix_affinity``): kvray's Ray Serve request
router against Ray Serve LLM's ``PrefixCacheAffinityRouter``, on the same engines.

Both routers run where they are deployed in practice, in Ray Serve's handle, in front of the
same deployment (:func:`kvray.engines.vllm.serve.vllm_app`): two replicas of the served
benchmark's engine (``bench-llama``, 64-token blocks, vLLM's prefix cache on and one
full-length prompt of KV space), one per local Ray node, each with kvray's connector on
one kvray runtime over both nodes. Only the router differs: kvray's
(:mod:`kvray.engines.vllm.router`: the replica whose node holds the prompt's cached pages,
weighed against queues by the cluster policy's ``route``) or ``PrefixCacheAffinityRouter``
(the replica whose earlier prompts share the longest text prefix, unless the queues are
unbalanced). The two deployments are up at once and the routers take turns at every rate.

The workload is the served benchmark's multi-round QA (:mod:`kvray.bench.serve`), closed loop
(:func:`~kvray.bench.serve_loop.run_closed_loop` over a Serve handle, :class:`HandlePool`),
swept at multiples of the prefix-affinity deployment's saturation; SLO, goodput and the
sweep's arithmetic are the served benchmark's. A Serve replica runs ``vllm.LLM.generate``
for one request at a time (no batching across requests), and the client sees the whole
answer (4 tokens) rather than its first token: the latency is the answer's, the same for
both routers.

Ray Serve's HTTP stack and ``ray.llm`` (its router needs pyarrow) live in vLLM's
environment, not kvray's, so the measurement runs there (:func:`main`, started by
:func:`~kvray.harness.vllm_env.run_in_vllm_env`).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from kvray.bench import BenchResult, benchmark
from kvray.bench.serve import FULL, QUICK, SLO_SCALE, Size, split_warmup, workloads
from kvray.bench.serve_engines import MAX_PAGES, MAX_TOKENS, MODEL, PAGE, VLLM_KV_PAGES
from kvray.bench.serve_loop import Answer, Router, goodput, is_lower_bound, run_closed_loop, summarize
from kvray.bench.serve_workload import Session, draw
from kvray.harness.vllm_env import run_in_vllm_env

ROUTERS = ("kvray", "prefix_affinity")  # kvray.engines.vllm.serve.ROUTERS: the contender, the anchor
RATES = {"quick": (0.5, 1.0, 2.0), "full": (0.5, 1.0, 1.5, 2.0, 3.0)}  # x the anchor's saturation
RUNTIME = "serve-routers"
HOST_PAGES = 48  # per node, as the served benchmark's runtime
COLD_PROBES = 3
# one replica of each deployment per node; both deployments' on the nodes' one CPU each
# kvray's router counts what each replica's own vLLM cache still holds (its KV space, less vLLM's null block)
ROUTER_SETTINGS = {"kvray": {"engine_cache_pages": VLLM_KV_PAGES - 1}}
REPLICA_OPTIONS = {"max_replicas_per_node": 1, "ray_actor_options": {"num_cpus": 0.5}}


class HandlePool:
    """A Serve deployment as the closed loop's :class:`~kvray.bench.serve_loop.Pool`: each
    request goes to the deployment's handle, whose request router picks the replica (the
    engine the client names is not used); an answer's time is when its result came back.
    ``request_of`` makes the deployment's request from a prompt's token ids."""

    def __init__(self, handle, request_of: Callable[[list[int]], object]) -> None:
        self.handle, self.request_of = handle, request_of
        self.waiters = ThreadPoolExecutor(max_workers=64, thread_name_prefix="answer")
        self.pending: set[Future] = set()

    def submit(self, engine: int, request: dict) -> None:
        response = self.handle.generate.remote(self.request_of(request["tokens"]))
        self.pending.add(self.waiters.submit(self._answer, request, response))

    @staticmethod
    def _answer(request: dict, response) -> dict:
        out = response.result(timeout_s=600)
        done = time.time()
        return {
            "id": request["id"],
            "sent_at": request["sent_at"],
            "done_at": done,
            "ttft_s": done - request["sent_at"],
            "prompt_tokens": len(request["tokens"]),
            "cached_tokens": out["num_cached_tokens"],
        }

    def drain(self, wait_s: float) -> list[dict]:
        done, self.pending = wait(self.pending, timeout=wait_s, return_when=FIRST_COMPLETED)
        return [f.result() for f in done]


class ServeRouted(Router):
    """The client's side of a Serve deployment: one handle; its own router picks the replica."""

    name = "serve"

    def pick(self, request_id: str, session: str, tokens) -> int:
        return 0


def play(sessions: list[Session], pool: HandlePool, rate: float) -> list[Answer]:
    """The sessions' warm-up prompts at full speed, then the measured ones at ``rate``."""
    warm, measured = split_warmup(sessions)
    if warm:
        run_closed_loop(warm, pool, ServeRouted(), float("inf"))
    return run_closed_loop(measured, pool, ServeRouted(), rate)


def measure(spec: dict) -> dict:
    """In vLLM's environment: both deployments up, the anchor's saturation and SLO, then
    every rate with the routers alternating (see the module docstring)."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # four engines on two cores: the OS spreads them
    from ray import serve

    from kvray.engines.hf import checkpoint_layout
    from kvray.engines.vllm.serve import GenerateRequest, start_runtime_for, vllm_app
    from kvray.harness.tiny import model_dir
    from kvray.harness.vllm_engine import engine_args
    from kvray.harness.vllm_runs import serve_cluster

    size = QUICK if spec["size"] == "quick" else FULL
    vocab = json.loads((model_dir(MODEL) / "config.json").read_text())["vocab_size"]
    page_bytes = checkpoint_layout(model_dir(MODEL), PAGE).page_nbytes
    args = engine_args(MODEL, True, PAGE, kv_cache_bytes=VLLM_KV_PAGES * page_bytes, max_model_len=(MAX_PAGES + 1) * PAGE)
    model, block_size, dtype = args.pop("model"), args.pop("block_size"), args.pop("dtype")
    began = time.monotonic()
    with serve_cluster(2):
        runtime = start_runtime_for(model, block_size, dtype, name=RUNTIME, host_pages=HOST_PAGES, detached=False)
        try:
            for router in ROUTERS:
                serve.run(
                    vllm_app(model, block_size, dtype, runtime=RUNTIME, num_replicas=2, engine=args, router=router,
                             router_settings=ROUTER_SETTINGS.get(router), replica_options=REPLICA_OPTIONS),
                    name=router, route_prefix=f"/{router}",
                )  # fmt: skip
            pools = {
                r: HandlePool(serve.get_deployment_handle("KvrayVllmServer", app_name=r),
                              lambda tokens: GenerateRequest(prompt_token_ids=tokens, max_tokens=MAX_TOKENS))
                for r in ROUTERS
            }  # fmt: skip
            started_s = time.monotonic() - began
            return sweep(size, RATES[spec["size"]], pools, vocab) | {"elapsed_s": {"start": started_s}}
        finally:
            runtime.close()


def sweep(size: Size, rates: tuple[float, ...], pools: dict[str, HandlePool], vocab: int) -> dict:
    """The anchor's cold latency (the SLO's base) and saturation, then both routers at every
    rate (multiples of that saturation), taking turns; fresh token ids per point."""
    factory = workloads(size, vocab, None)["multiround"]
    anchor = pools[ROUTERS[1]]
    probe = factory(0)
    median_len = int(statistics.median(len(p) for s in probe for p in s.prompts[s.warmup :]))
    cold = Session("cold", tuple(draw(vocab, median_len, 98, k) for k in range(COLD_PROBES)), 0.0)
    cold_s = statistics.median(a.ttft_s for a in run_closed_loop([cold], anchor, ServeRouted(), float("inf")))
    saturation = summarize(play(factory(1), anchor, float("inf")), float("inf"))["throughput_rps"]
    slo_s = SLO_SCALE * cold_s
    points: dict[str, dict[str, dict]] = {r: {} for r in ROUTERS}
    for p, m in enumerate(rates):
        for i, router in enumerate(ROUTERS if p % 2 == 0 else ROUTERS[::-1]):
            point = summarize(play(factory(100 * (p + 1) + i), pools[router], m * saturation), slo_s)
            points[router][str(m)] = point
            print(f"{router} at {m:g} x saturation: mean {point['mean_ttft_ms']:.0f} ms, "
                  f"{point['slo_attainment']:.0%} within the SLO", file=sys.stderr, flush=True)  # fmt: skip
    attainment = {r: {float(m) * saturation: v["slo_attainment"] for m, v in by.items()} for r, by in points.items()}
    return {
        "saturation_rps": saturation,
        "cold_latency_ms": cold_s * 1e3,
        "slo_latency_ms": slo_s * 1e3,
        "rates": {str(m): m * saturation for m in rates},
        "points": points,
        "goodput_rps": {r: goodput(a) for r, a in attainment.items()},
        "goodput_is_lower_bound": {r: is_lower_bound(a) for r, a in attainment.items()},
    }


@benchmark("router_vs_prefix_affinity")
def router_vs_prefix_affinity(quick: bool) -> list[BenchResult]:
    out = run_in_vllm_env(
        {"run": "router_vs_prefix_affinity", "size": "quick" if quick else "full"}, timeout=1800, module=__name__
    )
    return rows(out)


def rows(out: dict) -> list[BenchResult]:
    """kvray's router beside Ray Serve's prefix-aware router: goodput, and the mean latency
    at the anchor's saturation."""
    good = out["goodput_rps"]
    kvray, anchor = ROUTERS
    at = min(out["points"][anchor], key=lambda m: abs(float(m) - 1.0))
    params = {k: out[k] for k in ("saturation_rps", "slo_latency_ms", "rates", "goodput_is_lower_bound") if k in out}
    return [
        BenchResult("serve_router_goodput_vs_prefix_affinity", good[kvray], good[anchor], "req/s", ">= 1.0", params),
        BenchResult("serve_router_latency_vs_prefix_affinity", out["points"][kvray][at]["mean_ttft_ms"],
                    out["points"][anchor][at]["mean_ttft_ms"], "ms", "<= 1.0", {"rate_x_saturation": float(at)}),
    ]  # fmt: skip


def main(argv: list[str]) -> None:
    result = measure(json.loads(argv[1]))
    sys.stdout.flush()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv)
