"""The Ray Serve deployment of vLLM with kvray (kvray.engines.vllm.serve), served over HTTP.

Runs in a subprocess of vLLM's environment (see kvray.harness.vllm_runs): a local Ray, a
kvray runtime, Serve on a free port and one replica of the tiny seeded Llama with vLLM's
own prefix cache off. The same prompt twice: the second answer's prefix comes from kvray
and its tokens equal the first's, which vLLM computed alone (nothing was cached yet).
"""

from __future__ import annotations

import random

import pytest

from kvray.harness.tiny import seeded_checkpoint
from kvray.harness.vllm_env import run_in_vllm_env

BLOCK = 64

pytestmark = pytest.mark.slow


def test_serve_deployment_answers_over_http_and_reuses_kv(tmp_path):
    rng = random.Random(2)
    prefix, other, suffix = ([rng.randrange(3, 1000) for _ in range(n)] for n in (512, 512, 30))
    spec = {
        "run": "serve_on_ray",
        "model": str(seeded_checkpoint(tmp_path / "tiny-llama-seeded")),
        "block_size": BLOCK,
        "max_tokens": 8,
        "runtime": "kvray-serve-test",
        "prompts": [prefix + suffix, prefix + suffix, other + suffix],
    }
    cold, warm, different = run_in_vllm_env(spec, timeout=900)["answers"]
    assert cold["num_cached_tokens"] == 0 and len(cold["token_ids"]) == 8
    assert warm["num_cached_tokens"] == 512  # the 8 full pages before the last token's, from kvray
    assert warm["token_ids"] == cold["token_ids"]
    assert different["token_ids"] != cold["token_ids"]  # outputs depend on the prefix: the check can fail
