"""Trace replay on the Ray runtime: what ``kvray run`` and ``kvray demo`` do.

Requests of a trace (:func:`kvray.traces.read_trace`) arrive in order, round-robin, at one
:class:`~kvray.apps.replay_engine.ReplayEngine` per node (the front end), so a conversation's
next turn often lands on another node and its prefix must come from there (or be
recomputed). Before each request the runtime's cluster policy decides (``Controller.decide``:
``route``, ``load_pages``, ``prefetch``, ``replicate``, from the views the simulator builds);
the engine of the node it routed to serves it and executes the rest. What the verbs did
is counted in ``cluster_verbs`` (``kvray run --json``). Each
engine measures its own time to first token: lookup + pin, loading the hit pages with
their real bytes, and computing the missed tokens (a calibrated matmul, see
:mod:`~kvray.apps.prefill`). Page keys come from the trace's block ids; only full
512-token pages get keys (a partial last block is recomputed, as in vLLM).

``bytes_moved`` counts page bytes moved between tiers inside the nodes plus page bytes
moved between nodes. A node that disappears mid-replay costs the requests routed to it a
retry on another engine and its pages become misses; a page whose bytes are wrong is
counted in ``wrong_pages`` (``kvray run`` fails if any is).

Example::

    result = run_replay("data/traces/conversation_trace_first30min.jsonl", ReplaySettings(limit=200, nodes=2))
    print(result.as_dict()["token_hit_rate"])
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import ray
from pydantic import Field, model_validator
from rich.console import Console

from kvray.apps.replay_engine import ReplayEngineActor
from kvray.cluster.config import RuntimeConfig
from kvray.cluster.runtime import RayConnection, Runtime, alive_nodes, free_name, on_node
from kvray.core.config import FrozenModel, read_yaml, validate
from kvray.core.errors import ClusterError, ConfigError
from kvray.core.keys import pack_keys, trace_page_keys
from kvray.core.tiers import TIER_BY_LABEL
from kvray.policy import make_policy
from kvray.policy.cluster import ClusterPolicy
from kvray.progress import progress_bar
from kvray.report import ReplayResult, ReplayTally, policy_stats_since
from kvray.scenario import Scenario, TierSpec
from kvray.sim.cost import CostModel
from kvray.sim.simulator import fast_capacity
from kvray.traces import MOONCAKE_BLOCK_TOKENS, TraceRequest, cacheable_pages, full_blocks, read_trace, session_end_hints

# What ``cluster_verbs`` counts: requests decided, served on another node than their front
# end's, split (part of the hit recomputed), prefetched and replicated; pages of the last three
# (and ``replicated_pages_by_node``: the pages copied to each node the policy named);
# decisions that changed the serving node's NVMe write budget.
VERBS = (
    "decisions",
    "routed_elsewhere",
    "load_splits",
    "recomputed_hit_pages",
    "prefetches",
    "prefetched_pages",
    "replications",
    "replicated_pages",
    "budget_changes",
)
ENGINE_ERRORS = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)
# Bounds on waiting for an actor: a request (its engine's client waits at most its own
# timeout per Ray call, a few calls per request), and a metadata call.
REQUEST_TIMEOUT_S = 600.0
CALL_TIMEOUT_S = 120.0
# An engine's first answer waits for its worker process: a raylet starts them one at a time
# per CPU it has (one on the test clusters' nodes), each importing Ray and kvray, so on a
# loaded machine starting takes minutes where a call takes seconds.
ENGINE_START_TIMEOUT_S = 300.0


class ReplaySettings(FrozenModel):
    """A replay's shape: the runtime, the nodes, the prefill cost, how much of the trace.

    A ``--scenario`` YAML file holds these fields (``runtime`` nested) or is a simulator
    scenario (:func:`settings_of_sim_scenario`); the CLI's options override them.
    ``cache=False`` replays without kvray (every prompt recomputed): the baseline.
    ``capacity_fraction`` / ``capacity`` size each node's tiers as ``kvray sim`` sizes its
    node's (:func:`~kvray.sim.simulator.fast_capacity`): device + host = that share of the
    trace's unique pages / that many pages, every tier keeping its ratio to them.
    """

    name: str = "default"
    nodes: int = Field(default=1, ge=1, le=16)
    runtime: RuntimeConfig = RuntimeConfig()
    prefill_us_per_token: float = Field(default=5.0, ge=0)
    limit: int | None = Field(default=None, gt=0)
    object_store_mb: int = Field(default=150, ge=80)
    cache: bool = True
    capacity_fraction: float | None = Field(default=None, gt=0, le=100)
    capacity: int | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _one_capacity(self) -> ReplaySettings:
        if self.capacity_fraction is not None and self.capacity is not None:
            raise ValueError("give capacity_fraction or capacity, not both")
        return self

    @model_validator(mode="after")
    def _pages_are_trace_blocks(self) -> ReplaySettings:
        if self.runtime.layout.page_tokens != MOONCAKE_BLOCK_TOKENS:
            raise ValueError(f"runtime.layout.page_tokens must be {MOONCAKE_BLOCK_TOKENS}: one page per trace block")
        return self


def settings_of_sim_scenario(scenario: Scenario) -> dict:
    """What a ``kvray sim`` scenario (e.g. from ``kvray calibrate``) means for ``kvray run``:
    one node with the scenario's page layout and device/host/disk sizes, prefill at its
    ``prefill_us_per_token``. Replaying one trace both ways then compares the simulator with
    the runtime (docs/sim-eval/README.md); the runtime's stand-in prefill has no fixed cost
    and serves requests back to back, so a comparison scenario sets ``prefill_overhead_ms: 0``
    and enough ``servers`` that no request queues. A ``remote`` tier has no meaning on one node.
    The nodes' placement policies are told the scenario's tier costs, page prefill time and
    engines (as the simulator tells its policy), calibrated for this machine by ``kvray calibrate``,
    and the scenario's ``links.window_ms`` is the window the controller measures link use over
    (its drive's read and write rates, what the controller's utilisations and a write budget
    are shares of);
    its cluster policy keeps a request on one node up to the simulator's limit
    (``ClusterPolicy.local_limit``), not the runtime's (a node's host tier).
    A cluster scenario of identical nodes is that many nodes (its front end must be
    ``round-robin``, as the replay's), so ``kvray sim`` and ``kvray run`` replay the same cluster.
    """
    nodes, name, cluster = scenario.node_scenarios(), scenario.name, scenario
    if scenario.nodes is not None:
        alike = all(node.model_copy(update={"name": nodes[0].name}) == nodes[0] for node in nodes)
        if not alike or scenario.router.kind != "round-robin":
            raise ConfigError(
                f"scenario {scenario.name!r}: kvray run replays a cluster of identical nodes behind a round-robin "
                "front end; this one has other kinds of node or another router"
            )
        scenario = nodes[0]
    tiers = {name: spec.capacity_pages for name, spec in scenario.tiers.items() if name != "remote"}
    model = CostModel(scenario)
    costs = model.tier_cost(TIER_BY_LABEL[name] for name in tiers)
    base = ReplaySettings().model_dump()
    base["runtime"] |= {
        "layout": scenario.layout.model_dump(),
        "tiers": tiers,
        "tier_cost": {tier.label: cost for tier, cost in costs.items()},
        "page_prefill_ms": model.page_prefill_ms(),
        "prefill_engines": scenario.compute.servers,
    }
    if cluster.links is not None:  # the window policies see link utilisation over, in both worlds
        base["runtime"]["observe_window_s"] = cluster.window_ms / 1e3
    disk = scenario.tiers.get("disk")
    if disk is not None:  # the drive's rates, what its utilisations and a write budget are shares of
        base["runtime"]["links"] = base["runtime"]["links"] | {
            "disk_read_gbps": disk.read_gbps,
            "disk_write_gbps": disk.write_gbps,
        }
    if cluster.nodes is not None:  # the simulator's cluster policies keep requests of up to this many pages on one node
        base["runtime"]["local_pages_limit"] = ClusterPolicy.local_limit
    return base | {"name": name, "nodes": len(nodes), "prefill_us_per_token": scenario.compute.prefill_us_per_token}


# The settings `kvray run` and `kvray up` take as flags, so their errors name the flag typed
FLAGS = {
    "policy": "--policy",
    "cluster_policy": "--cluster-policy",
    "disk_root": "--disk-root",
    "host": "--host-pages",
    "disk": "--disk-pages",
    "nodes": "--nodes",
    "limit": "--limit",
    "prefill_us_per_token": "--prefill-us-per-token",
    "capacity_fraction": "--capacity-fraction",
    "capacity": "--capacity",
    "controller_shards": "--controller-shards",
    "name": "--name",
}


def settings_from(scenario: str | Path | None, runtime: dict, tiers: dict, replay: dict) -> ReplaySettings:
    """A scenario file's settings (or the defaults) with the given options laid over them.

    The file holds replay settings or a simulator scenario (see :func:`settings_of_sim_scenario`).
    ``None`` values leave the scenario's value; the result is validated once, and errors
    name the scenario file.
    """
    if scenario is None:
        base = ReplaySettings().model_dump()
    elif isinstance(data := read_yaml(scenario), dict) and "compute" in data:  # a simulator scenario
        base = settings_of_sim_scenario(validate(Scenario, data, source=str(scenario)))
    else:
        base = validate(ReplaySettings, data, source=str(scenario)).model_dump()
        base["name"] = data.get("name", Path(scenario).stem)  # reported by its name, or its file's
    base["runtime"]["tiers"].update({k: v for k, v in tiers.items() if v is not None})
    base["runtime"].update({k: v for k, v in runtime.items() if v is not None})
    base.update({k: v for k, v in replay.items() if v is not None})
    if scenario is None:  # every setting came from a flag, so the error names the flag
        return validate(ReplaySettings, base, source="command-line options", flags=FLAGS)
    return validate(ReplaySettings, base, source=str(scenario))


class Replay:
    """Engines on every store node of a started runtime, and the loop that feeds them."""

    def __init__(self, runtime: Runtime, settings: ReplaySettings) -> None:
        self.runtime = runtime
        self.settings = settings
        self.engines = {
            node: ReplayEngineActor.options(num_cpus=0, scheduling_strategy=on_node(node)).remote(
                runtime.config.name, settings.prefill_us_per_token, settings.cache
            )
            for node in runtime.stores
        }
        self._await_engines()
        self.fingerprint = runtime.config.fingerprint()
        self.page_tokens = runtime.config.layout.page_tokens
        self.verbs = dict.fromkeys(VERBS, 0)
        self.replicated_by_node: dict[str, int] = {}  # node -> pages the replicate verb copied there

    def _await_engines(self) -> None:
        """Wait until every engine answers; otherwise a ClusterError names each node whose
        engine died starting (and why) or did not answer, and every engine is stopped."""
        answers = {e.node_id.remote(): node for node, e in self.engines.items()}
        ready, late = ray.wait(list(answers), num_returns=len(answers), timeout=ENGINE_START_TIMEOUT_S)
        problems, started = [], set()
        for ref in ready:
            try:
                ray.get(ref)
                started.add(answers[ref])
            except ray.exceptions.RayError as e:  # the cause's line, not Ray's traceback
                problems.append(f"the engine on node {answers[ref]} died starting: {str(e).strip().splitlines()[-1]}")
        if late:
            nodes = ", ".join(answers[r] for r in late)
            problems.append(f"the engine on node(s) {nodes} did not answer within {ENGINE_START_TIMEOUT_S:g} s")
        if problems:
            # The error's traceback keeps these handles (a test report keeps it to the end): an
            # engine that started closes its landing buffer and is killed, the others are killed,
            # so none goes on starting, or holding a worker, behind the error.
            self._close(self.engines[node] for node in started)
            for node in self.engines.keys() - started:
                ray.kill(self.engines[node])
            raise ClusterError(f"engines starting: {'; '.join(problems)}")

    def run(
        self, trace: list[TraceRequest], progress: bool = True, on_request: Callable[[int], None] | None = None
    ) -> ReplayResult:
        """Replay ``trace``; ``on_request(i)`` runs before request ``i`` (fault injection).
        Bytes moved count this replay's only: a runtime kept up may have moved some before."""
        policy = self.runtime.config.policy if self.settings.cache else "none"
        # each session's last request carries its client's hint where the stores' policy takes one, as in the simulator
        hints = (
            session_end_hints(trace, self.page_tokens) if self.settings.cache and make_policy(policy).needs_session_ends else {}
        )
        moved_before, policy_before = self._counters()
        tally = ReplayTally(self.settings.runtime.layout.page_tokens)
        wrong_pages, lost_nodes = 0, []
        compute_s, computed_tokens = 0.0, 0
        with progress_bar(len(trace), f"replay {policy}", enabled=progress) as tick:
            for i, request in enumerate(trace):
                if on_request is not None:
                    on_request(i)
                outcome = self._serve(i, request, lost_nodes, hints.get(i, -1))
                tally.add(outcome["tokens"], outcome["hit_tokens_by_tier"], outcome["ttft_s"] * 1e3)
                wrong_pages += outcome["wrong_pages"]
                compute_s += outcome["compute_s"]
                computed_tokens += outcome["tokens"] - sum(outcome["hit_tokens_by_tier"].values())
                if tick:
                    tick(i)
        moved, policy_after = self._counters()
        return tally.result(
            policy,
            self.settings.name,
            moved - moved_before,
            cluster_policy=self.runtime.config.cluster_policy,
            cluster_verbs={**self.verbs, "replicated_pages_by_node": dict(self.replicated_by_node)},
            policy_stats=policy_stats_since(policy_before, policy_after),
            wrong_pages=wrong_pages,
            lost_nodes=lost_nodes,
            prefill_us_per_token_measured=compute_s * 1e6 / computed_tokens if computed_tokens else 0.0,
        )

    def _counters(self) -> tuple[int, dict[str, dict[str, int]]]:
        """Page bytes moved so far (between tiers inside the nodes and between nodes) and each
        store's policy counters."""
        stats = self.runtime.store_stats()
        between = _bounded(self.runtime.shards.broadcast("snapshot"), CALL_TIMEOUT_S, "the controller's snapshot")
        moved = sum(s["bytes_moved"] for s in stats.values()) + sum(snap["bytes_between_nodes"] for snap in between)
        return moved, {node: s["policy"] for node, s in stats.items()}

    def _serve(self, i: int, request: TraceRequest, lost_nodes: list[str], ends_session_from: int) -> dict:
        while self.engines:
            nodes = list(self.engines)
            front = nodes[i % len(nodes)]
            node, verbs = self._decide(request, front)
            try:
                outcome = _bounded(
                    self.engines[node].serve.remote(
                        list(request.hash_ids),
                        request.input_length,
                        arrival_ms=request.timestamp_ms,
                        ends_session_from=ends_session_from,
                        **verbs,
                    ),
                    REQUEST_TIMEOUT_S,
                    f"request {i} on node {node[:12]}",
                )
            except ENGINE_ERRORS:
                self._lose_node(node, lost_nodes)
                continue
            self._count(front, node, verbs, outcome.get("verbs", {}))
            return outcome
        raise ClusterError("every replay engine is gone: no node left to serve requests")

    def _decide(self, request: TraceRequest, front: str) -> tuple[str, dict]:
        """The node that serves ``request`` (arriving at ``front``) and the engine's verbs
        for it, as the runtime's cluster policy decides (``Controller.decide``, at the shard
        owning the request's chain); a request with no full page, or a replay without the
        cache, is served where it arrived."""
        keys = trace_page_keys(self.fingerprint, full_blocks(request.hash_ids, request.input_length, self.page_tokens))
        if not (keys and self.settings.cache):
            return front, {}
        shards = self.runtime.shards
        decision = _bounded(shards.handles[shards.of(keys)].decide.remote(pack_keys(keys), front), CALL_TIMEOUT_S, "decide")
        decision.wait_for_budget(CALL_TIMEOUT_S)  # the request's writes go under the budget decided with it
        self.verbs["budget_changes"] += decision.budget_set is not None
        if decision.node not in self.engines:
            return front, {}  # its engine was lost since the controller last heard
        verbs = {"load_pages": decision.load_pages, "prefetch": decision.prefetch, "replicate": decision.replicate}
        return decision.node, verbs

    def _count(self, front: str, node: str, verbs: dict, done: dict) -> None:
        counts = self.verbs
        counts["decisions"] += bool(verbs)
        counts["routed_elsewhere"] += node != front
        counts["load_splits"] += done.get("recomputed_hit_pages", 0) > 0
        counts["prefetches"] += done.get("prefetched_pages", 0) > 0
        counts["replications"] += done.get("replicated_pages", 0) > 0
        for key in ("recomputed_hit_pages", "prefetched_pages", "replicated_pages"):
            counts[key] += done.get(key, 0)
        for copied_to, pages in done.get("replicated_pages_by_node", {}).items():
            if pages:
                self.replicated_by_node[copied_to] = self.replicated_by_node.get(copied_to, 0) + pages

    def _lose_node(self, node: str, lost_nodes: list[str]) -> None:
        """A node's engine died: drop the node's locations and let the others re-route."""
        self.engines.pop(node)
        lost_nodes.append(node)
        self.runtime.node_lost(node)
        for gone in set(self.runtime.stores) - set(alive_nodes()):
            self.runtime.node_lost(gone)
        _bounded([e.refresh.remote() for e in self.engines.values()], CALL_TIMEOUT_S, "engines re-reading the members")

    def close(self) -> None:
        self._close(self.engines.values())

    @staticmethod
    def _close(engines: Iterable[ray.actor.ActorHandle]) -> None:
        for engine in engines:
            try:
                ray.get(engine.close.remote(), timeout=30)
            except (*ENGINE_ERRORS, TimeoutError):
                pass  # died with its node; its buffer went with it
            ray.kill(engine)


def _bounded(refs, timeout_s: float, what: str):
    """``ray.get`` that ends a hung replay with a ClusterError saying what did not answer."""
    try:
        return ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise ClusterError(f"{what}: no answer within {timeout_s:g} s") from None


def replay_on_runtime(
    trace: list[TraceRequest], settings: ReplaySettings, progress: bool = True, notify: Callable[[str], None] | None = None
) -> ReplayResult:
    """Start a runtime on the connected Ray, replay ``trace`` on it, and tear it down.

    A runtime of the settings' name already up on the cluster (``kvray up``'s default is
    ``kvray`` too) is left alone: this one takes the first free name beside it and tells
    ``notify`` which, so ``kvray run`` works on a cluster that also keeps a runtime up.
    """
    name = free_name(settings.runtime.name)
    if name != settings.runtime.name:
        if notify is not None:
            notify(
                f"a kvray runtime named {settings.runtime.name!r} is up on this cluster (`kvray run --name "
                f"{settings.runtime.name}` replays on it); this replay starts its own as {name!r}"
            )
        settings = settings.model_copy(update={"runtime": settings.runtime.model_copy(update={"name": name})})
    runtime = Runtime.start(settings.runtime)
    try:
        return replay_with(runtime, trace, settings, progress)
    finally:
        runtime.close()


def replay_with(runtime: Runtime, trace: list[TraceRequest], settings: ReplaySettings, progress: bool = True) -> ReplayResult:
    """Replay ``trace`` on a started ``runtime`` with engines of its own; the runtime stays."""
    replay = Replay(runtime, settings)
    try:
        return replay.run(trace, progress=progress)
    finally:
        replay.close()


def capacity_warning(runtime: Runtime, trace: list[TraceRequest]) -> str | None:
    """What to say when ``trace`` has more distinct pages than ``runtime`` holds on all its
    nodes (None when they fit): replayed again, it finds only the pages still cached, and
    under LRU, which keeps the last requests' pages, the first requests evict them before
    they are reached."""
    tiers = runtime.config.tiers
    held = (tiers.device + tiers.host + tiers.disk) * len(runtime.stores)
    pages = cacheable_pages(trace, runtime.config.layout.page_tokens)
    if pages <= held:
        return None
    return (
        f"this trace has {pages} distinct pages and runtime {runtime.config.name!r} holds {held} "
        f"({len(runtime.stores)} node{'' if len(runtime.stores) == 1 else 's'}): a run after this one finds only "
        "the pages still cached, not all of this run's (`kvray up --host-pages` sizes a runtime)"
    )


def sized_for(settings: ReplaySettings, trace: list[TraceRequest]) -> ReplaySettings:
    """``settings`` with each node's tiers sized by ``capacity_fraction`` or ``capacity``
    for ``trace``, by the simulator's rule (unchanged when neither is given)."""
    if settings.capacity_fraction is None and settings.capacity is None:
        return settings
    tiers = settings.runtime.tiers.model_dump()
    # The runtime's tiers as a scenario, for its sizing rule only (no speeds are read).
    scenario = Scenario.model_construct(
        name=settings.name, tiers={name: TierSpec.model_construct(capacity_pages=n) for name, n in tiers.items() if n}
    )
    sized = fast_capacity(scenario, trace, settings.capacity_fraction, settings.capacity)
    data = settings.model_dump()
    data["runtime"]["tiers"] = {tier.label: pages for tier, pages in sized.items()}
    return validate(ReplaySettings, data, source="--capacity-fraction / --capacity")


def run_replay(
    trace_path: str | Path,
    settings: ReplaySettings,
    address: str | None = None,
    progress: bool = True,
    runtime_name: str | None = None,
    notify: Callable[[str], None] | None = None,
) -> ReplayResult:
    """``kvray run``: read the trace, connect to (or start) Ray, replay, report.

    With ``runtime_name`` the replay uses that runtime, already up on the cluster
    (``kvray up``), with its own settings, and leaves it running and warm; ``notify`` is
    told when the trace has more distinct pages than the runtime holds, since a second
    run then finds only the pages still cached, not all of the first run's. Without
    ``runtime_name`` it replays on a runtime of its own (:func:`replay_on_runtime`: ``notify``
    hears which name that took when the settings' one was taken).
    """
    trace = read_trace(trace_path, limit=settings.limit)
    settings = sized_for(settings, trace)
    if runtime_name is not None:  # it runs on an existing cluster: never start one
        if settings.capacity_fraction is not None or settings.capacity is not None:
            raise ConfigError(f"--capacity-fraction and --capacity size a new runtime; runtime {runtime_name!r} is sized already")
        address = address or "auto"
    with RayConnection(address=address, nodes=settings.nodes, object_store_mb=settings.object_store_mb):
        if runtime_name is None:
            return replay_on_runtime(trace, settings, progress=progress, notify=notify)
        runtime = Runtime.attach(runtime_name)
        if notify is not None and (warning := capacity_warning(runtime, trace)):
            notify(warning)
        return replay_with(runtime, trace, settings.model_copy(update={"runtime": runtime.config}), progress)


def print_run(result: ReplayResult, settings: ReplaySettings, table: Console, console: Console) -> None:
    """What ``kvray run`` prints: the results ``table``, then how far this machine's prefill ran
    from its calibration (which ``kvray sim`` assumes) on ``console``."""
    from kvray.apps.results import print_results

    print_results({result.policy: result}, table, title=f"kvray run: measured replay ({result.scenario} settings)")
    if settings.prefill_us_per_token > 0:
        console.print(
            f"prefill: {result.prefill_us_per_token_measured:.2f} us per missed token measured, "
            f"{settings.prefill_us_per_token:g} calibrated"
        )
