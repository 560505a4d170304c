"""A vLLM engine serving requests as they come: the served benchmark's engine, in a Ray actor.

:class:`ServingEngine` is the body of a threaded actor that runs vLLM's environment's
interpreter (Ray's ``runtime_env={"py_executable": ...}``; see :mod:`kvray.bench.serve`),
so the engine lives in the actor's process on the actor's node, and a connector that names
a kvray runtime uses that process's Ray connection and node. One thread owns the engine
and steps it whenever it has work; the driver, a closed-loop client
(:mod:`kvray.bench.serve_loop`), calls :meth:`~ServingEngine.submit` to add requests and
:meth:`~ServingEngine.drain` to collect the ones answered, from other threads of the actor.

Times are wall-clock (``time.time()``) on both sides: the driver stamps ``sent_at`` when it
sends, the engine the moment a request's first token is out, so a TTFT includes the call
that carried the request and its queueing, as a front end's would. Each answer splits its
TTFT (``ttft_parts_s``): ``transit`` (sent until added to the engine: the call and the
step in progress), ``wait`` (added until the step that produced its first token began:
other requests' steps, an asynchronous KV load) and ``step`` (that step: its prefill,
with whatever else the step batched, and the connector's lookup and copy).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections import Counter

from kvray.harness.vllm_engine import close_llm, connector_of, counters_of, make_llm, wake_on_kv

# where a runtime connector's pages came from (its load paths, kvray.cluster.client) -> tier label
PATH_TIERS = {"mapped": "host", "local": "local store", "tcp": "remote", "collective": "remote", "object_store": "remote"}
IDLE_WAIT_S = 0.2  # how long an idle engine thread sleeps between looks at the stop flag (a request wakes it at once)
# After a step that computed nothing (every unfinished request waits for its KV: a lookup or
# a load), the engine thread waits before stepping again, rather than spinning on the GIL
# that the connector's threads need: in vLLM's own server the worker, and so the I/O
# thread, is another process. A request arriving wakes it, and so does the end of a kvray
# runtime connector's lookup or load (vllm_engine.wake_on_kv), after which it steps
# WOKEN_STEPS times before it waits again (the step that learns a load ended computes
# nothing; the next one prefills); it then waits up to KV_WAIT_S, a bound for what nothing
# wakes it for (the cluster policy's verbs). Other connectors' engines step again after
# LOAD_POLL_S. Polling every 2 ms took 9.5 empty steps a request on the served benchmark's
# agents, 3.4 CPU-ms of the engine's ~153.
LOAD_POLL_S = 0.002
KV_WAIT_S = 0.02
WOKEN_STEPS = 2
WAKE = None  # in the inbox: a lookup or load ended


def kvray_hits(llm, connector) -> tuple[dict[str, int], Counter]:
    """The connector's counters (both halves) and the pages kvray served so far by tier:
    an in-process store's own tier counts, or a runtime client's load paths (pages from
    this node's mapped host tier, from its store actor, from another node)."""
    if connector is None:
        return {}, Counter()
    counters, store = counters_of(llm), connector.scheduler.store
    if store is not None:
        return counters, Counter(store.stats().get("hit_pages_by_tier", {}))
    tiers: Counter = Counter()
    for path, tier in PATH_TIERS.items():
        tiers[tier] += counters.get(f"{path}_pages", 0)
    return counters, tiers


def lmcache_failure() -> str | None:
    """Why LMCache's connector runs "in degraded mode (recompute)", or None: it logs the
    failure to make its engine (on a CPU: no connector for the device) and then serves with
    every lookup timing out, which would be measured as LMCache's figure."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    manager = getattr(getattr(get_kv_transfer_group(), "_lmcache_engine", None), "_manager", None)
    return getattr(manager, "_init_failed_reason", None) if getattr(manager, "_init_failed", False) else None


class ServingEngine:
    """One vLLM engine (see the module docstring); ``spec`` holds :func:`make_llm`'s settings.

    Example::

        engine = ray.remote(num_cpus=0, max_concurrency=4)(ServingEngine).options(
            runtime_env={"py_executable": vllm_python}).remote(
            {"model": "bench-llama", "block_size": 64, "kv_cache_bytes": 32 << 20, "max_model_len": 1088,
             "prefix_caching": True, "kvray": {"host_pages": 512}, "max_tokens": 4})
        engine.submit.remote([{"id": "0", "tokens": [5] * 100, "sent_at": time.time()}])
        ray.get(engine.drain.remote(5.0))   # [{"id": "0", "ttft_s": ..., "cached_tokens": 0, ...}]
    """

    def __init__(self, spec: dict) -> None:
        # Ray starts workers at niceness 15 (RAY_worker_niceness): an engine serving requests
        # would then yield its cores to any other process on the node. Back to normal where
        # this process may raise its priority; as it is elsewhere.
        with contextlib.suppress(PermissionError):
            os.setpriority(os.PRIO_PROCESS, 0, 0)
        os.environ.update(spec.get("env", {}))  # read by a connector (LMCache's) when the engine starts
        self.llm = make_llm(
            spec["model"],
            spec.get("kvray"),
            spec["prefix_caching"],
            spec["block_size"],
            kv_cache_bytes=spec["kv_cache_bytes"],
            max_model_len=spec["max_model_len"],
            transfer=spec.get("transfer"),
        )
        if spec.get("transfer") is not None and (reason := lmcache_failure()):
            close_llm(self.llm)
            raise RuntimeError(f"LMCache's connector could not start its engine:\n{reason}")
        self.connector = connector_of(self.llm) if spec.get("kvray") is not None else None
        from vllm import SamplingParams

        self.params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, detokenize=False, ignore_eos=True)
        self.inbox: queue.Queue = queue.Queue()  # batches of requests, and WAKE
        self.steps = Counter(steps=0, empty_steps=0, wakes=0)  # engine steps, those that computed nothing, wake-ups
        self.kv_wait_s = LOAD_POLL_S
        if self.connector is not None and self.connector.scheduler.runtime is not None:
            wake_on_kv(self.llm, lambda: self.inbox.put(WAKE))
            self.kv_wait_s = KV_WAIT_S
        self.answered: list[dict] = []
        self.ready = threading.Condition()
        self.engine_lock = threading.Lock()  # the engine: its thread steps it, stats and reset wait for a step
        self.error: str | None = None
        self.stopped = False
        self.thread = threading.Thread(target=self._serve, name="engine", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        """Add what arrived, step, record first tokens and finished requests; until closed."""
        from vllm.inputs import TokensPrompt

        engine = self.llm.llm_engine
        sent: dict[str, dict] = {}
        added: dict[str, float] = {}
        first: dict[str, tuple[float, float]] = {}  # request -> (its first token's step began, ended)
        computed = True  # the last step produced output
        free_steps = 0  # steps to take without waiting, after a wake-up
        try:
            while not self.stopped:
                busy = engine.has_unfinished_requests()
                batch, woken = self._arrived(IDLE_WAIT_S if not busy else 0 if computed or free_steps else self.kv_wait_s)
                free_steps = WOKEN_STEPS - 1 if woken else max(0, free_steps - 1)  # this step is the first
                with self.engine_lock:
                    for r in batch:
                        sent[r["id"]] = r
                        engine.add_request(r["id"], TokensPrompt(prompt_token_ids=r["tokens"]), self.params)
                        added[r["id"]] = time.time()
                    if not engine.has_unfinished_requests():
                        continue
                    began = time.time()
                    outputs = engine.step()
                now = time.time()
                computed = bool(outputs)
                self.steps["steps"] += 1
                self.steps["empty_steps"] += not computed
                self.steps["wakes"] += woken
                finished = []
                for out in outputs:
                    if out.request_id not in first and out.outputs and out.outputs[0].token_ids:
                        first[out.request_id] = (began, now)
                    if out.finished:
                        r = sent.pop(out.request_id)
                        step_began, first_at = first.pop(out.request_id)
                        queued_at = added.pop(out.request_id)
                        finished.append(
                            {
                                "id": out.request_id,
                                "sent_at": r["sent_at"],
                                "ttft_s": first_at - r["sent_at"],
                                "ttft_parts_s": {
                                    "transit": queued_at - r["sent_at"],
                                    "wait": step_began - queued_at,
                                    "step": first_at - step_began,
                                },
                                "done_at": now,
                                "prompt_tokens": len(r["tokens"]),
                                "cached_tokens": int(out.num_cached_tokens or 0),
                            }
                        )
                if finished:
                    with self.ready:
                        self.answered.extend(finished)
                        self.ready.notify_all()
        except Exception as exc:  # reported by drain: the driver must not wait for answers that never come
            with self.ready:
                self.error = f"{type(exc).__name__}: {exc}"
                self.ready.notify_all()

    def _arrived(self, wait_s: float) -> tuple[list[dict], bool]:
        """Every request queued so far, waiting up to ``wait_s`` for the first batch or a
        wake-up, and whether a wake-up came."""
        batch: list[dict] = []
        woken = False
        try:
            item = self.inbox.get(timeout=wait_s) if wait_s > 0 else self.inbox.get_nowait()
            while True:
                if item is WAKE:
                    woken = True
                else:
                    batch.extend(item)
                item = self.inbox.get_nowait()
        except queue.Empty:
            return batch, woken

    def submit(self, requests: list[dict]) -> None:
        """Queue ``requests`` (``id``, ``tokens``, ``sent_at``) for the engine's next step."""
        self.inbox.put(requests)

    def drain(self, wait_s: float) -> list[dict]:
        """The requests answered since the last call, waiting up to ``wait_s`` for one."""
        with self.ready:
            if not self.answered and self.error is None:
                self.ready.wait(wait_s)
            if self.error is not None:
                raise RuntimeError(f"the engine's thread stopped: {self.error}")
            answered, self.answered = self.answered, []
        return answered

    def stats(self) -> dict:
        """The connector's counters, kvray's hit pages by tier and the engine's steps so far (call when idle)."""
        with self.engine_lock:
            counters, tiers = kvray_hits(self.llm, self.connector)
        return {"counters": counters, "pages_by_tier": dict(tiers), "steps": dict(self.steps)}

    def fingerprint(self):
        """The model fingerprint the connector keys pages with (None: no kvray runtime), for a
        router that asks the runtime where a prompt's pages are."""
        runtime = self.connector.scheduler.runtime if self.connector is not None else None
        return None if runtime is None else runtime.fingerprint

    def reset(self) -> bool:
        """Empty vLLM's own prefix cache (kvray's tiers keep their pages)."""
        with self.engine_lock:
            return bool(self.llm.reset_prefix_cache())

    def close(self) -> None:
        self.stopped = True
        self.thread.join(timeout=60)
        close_llm(self.llm)
