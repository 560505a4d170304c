"""The Ray Serve deployment of vLLM with kvray (kvray.engines.vllm.serve), served over HTTP
and routed by kvray's request router (kvray.engines.vllm.router).

Runs in a subprocess of vLLM's environment (see kvray.harness.vllm_runs): two local Ray
nodes, a kvray runtime (a store per node), Serve on a free port and two replicas of the
tiny seeded Llama, one per node, with vLLM's own prefix cache off. Two prompts with
different long prefixes arrive at once, so they land on different replicas (each serves
one request at a time) and each prefix's pages are stored on its replica's node; vLLM
computed these answers alone (nothing was cached yet). Then each prompt comes back twice,
one at a time: kvray's router must send it to the node holding its pages (round-robin or
a random pick would split them), the prefix comes from kvray, and the answer equals the
cold one.
"""

from __future__ import annotations

import random

import pytest

from kvray.harness.tiny import seeded_checkpoint
from kvray.harness.vllm_env import run_in_vllm_env

BLOCK = 64

pytestmark = pytest.mark.slow


def test_kvray_router_sends_a_repeated_prefix_to_the_node_holding_its_pages(tmp_path):
    rng = random.Random(2)
    first, second, suffix = ([rng.randrange(3, 1000) for _ in range(n)] for n in (512, 512, 30))
    a, b = first + suffix, second + suffix
    spec = {
        "run": "serve_on_ray",
        "model": str(seeded_checkpoint(tmp_path / "tiny-llama-seeded")),
        "block_size": BLOCK,
        "max_tokens": 8,
        "runtime": "kvray-serve-test",
        "nodes": 2,
        "replicas": 2,
        "router": "kvray",
        "router_settings": {"lookup_timeout_s": 30.0},  # a loaded machine's slow answer is still a KV-aware route
        "steps": [[a, b], [a], [b], [b], [a]],
    }
    result = run_in_vllm_env(spec, timeout=900)
    (cold_a, cold_b), *repeats = result["steps"]
    assert {cold_a["node"], cold_b["node"]} == set(result["nodes"])  # one cold prefix per node
    for cold in (cold_a, cold_b):
        assert cold["num_cached_tokens"] == 0 and len(cold["token_ids"]) == 8
    assert cold_a["token_ids"] != cold_b["token_ids"]  # outputs depend on the prefix: the checks below can fail
    for (warm,), cold in zip(repeats, (cold_a, cold_b, cold_b, cold_a)):
        assert warm["node"] == cold["node"]  # routed to the pages
        assert warm["num_cached_tokens"] == 512  # the 8 full pages before the last token's, from kvray
        assert warm["token_ids"] == cold["token_ids"]
