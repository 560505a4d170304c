"""A checkpoint swapped under the same model name must not inherit its predecessor's KV:
the model revision (hub commit or user value, plus a hash of the config) is part of the
fingerprint, and a fingerprint without one is what it was before revisions existed."""

from __future__ import annotations

import torch
import xxhash
from transformers import LlamaConfig

from kvray.core.config import StoreConfig, TierSizes
from kvray.core.keys import ModelFingerprint
from kvray.core.store import PageStore
from kvray.engines.revision import checkpoint_revision
from kvray.engines.vllm.settings import connector_settings, store_config
from tests.conftest import TINY, prefix_kv


def llama(**changes) -> LlamaConfig:
    settings = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100}
    return LlamaConfig(**{**settings, **changes})


def test_a_fingerprint_without_revision_is_unchanged_and_revisions_separate_models():
    legacy = xxhash.xxh3_128_digest(f"tiny|{TINY.model_dump_json()}".encode())
    assert ModelFingerprint.of(TINY, "tiny").digest == legacy  # disk tiers written before stay readable
    digests = {ModelFingerprint.of(TINY, "tiny", r).digest for r in (None, "a", "b")}
    assert len(digests) == 3


def test_the_checkpoint_revision_follows_the_model_not_its_path_or_library():
    base = checkpoint_revision(llama())
    moved = llama()
    moved._name_or_path = "/elsewhere/llama"
    moved.transformers_version = "0.0.1"
    assert checkpoint_revision(moved) == base == checkpoint_revision(llama())
    assert checkpoint_revision(llama(rope_theta=20000.0)) != base
    assert checkpoint_revision(llama(), "abc123") != base and checkpoint_revision(llama(), "abc123").startswith("abc123+")


def test_weights_quantized_at_load_are_a_checkpoint_of_their_own():
    """vLLM's online quantization (``quantization="fp8"``) is in no config file; its KV differs."""
    base = checkpoint_revision(llama(), "v1")
    assert checkpoint_revision(llama(), "v1", None) == base  # unquantized: the revision as before
    fp8 = checkpoint_revision(llama(), "v1", ("fp8", None))
    assert fp8 != base and fp8.startswith(base + "+quant-") and fp8 == checkpoint_revision(llama(), "v1", ("fp8", None))
    assert fp8 != checkpoint_revision(llama(), "v1", ("awq", None))
    online = [checkpoint_revision(llama(), "v1", ("online", {"ignore": ignore})) for ignore in (["lm_head"], [])]
    assert online[0] != online[1]  # the method's settings count too
    assert len(checkpoint_revision(llama(), "r" * 200, ("online", {"ignore": ["x" * 500]}))) <= 256  # StoreConfig's bound


def test_a_checkpoint_swapped_under_its_name_gets_no_hits_from_a_persistent_disk_tier(tmp_path):
    def store(revision: str) -> PageStore:
        config = StoreConfig(
            layout=TINY, model_name="llama", model_revision=revision, tiers=TierSizes(disk=8), disk_dir=tmp_path / "disk"
        )
        return PageStore(config)

    tokens = list(range(12))
    old, new = checkpoint_revision(llama(), "ft-1"), checkpoint_revision(llama(), "ft-2")
    first = store(old)
    first.store(tokens, prefix_kv(TINY, tokens))
    first.close()
    assert store(new).lookup(tokens) == 0
    hit = store(old).load(tokens)
    assert hit.tokens == 12 and torch.equal(hit.kv, prefix_kv(TINY, tokens))


def test_the_vllm_connector_takes_a_revision_setting():
    settings = connector_settings({"model_revision": "my-finetune-3"})
    assert settings.model_revision == "my-finetune-3"
    config = store_config(settings, TINY, "served", checkpoint_revision(llama(), settings.model_revision))
    assert config.model_revision.startswith("my-finetune-3+config-")


def test_the_ray_runtime_binds_its_model_revision_in_clients_and_stores_alike(tmp_path):
    """RuntimeConfig.model_revision reaches every node store, and the fingerprint clients key
    pages with is the stores' own: a runtime over a swapped checkpoint shares nothing."""
    from kvray.cluster.config import RuntimeConfig

    configs = [RuntimeConfig(layout=TINY, model_revision=r, tiers=TierSizes(host=4)) for r in ("a", "b")]
    stores = [PageStore(c.store_config("node-1")) for c in configs]
    try:
        assert [s.fingerprint for s in stores] == [c.fingerprint() for c in configs]
        assert configs[0].fingerprint().digest != configs[1].fingerprint().digest
    finally:
        for store in stores:
            store.close()
