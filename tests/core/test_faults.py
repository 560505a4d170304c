"""Faults of the in-process store with real processes and real files: a full disk, a
process killed in the middle of a move, concurrent clients, and hostile input."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from contextlib import suppress
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvray.core.config import PageLayout, StoreConfig, TierSizes, load_yaml
from kvray.core.errors import KvrayError
from kvray.core.store import PageStore
from kvray.traces import read_trace
from tests.conftest import TINY, prefix_kv
from tests.properties import examples

ROOT_DIR = Path(__file__).parents[2]
pytestmark = pytest.mark.fault


def run_python(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True, cwd=ROOT_DIR, timeout=120
    )


DISK_FULL = """
    import resource, signal, sys, torch
    from kvray.core.config import StoreConfig, TierSizes
    from kvray.core.errors import StorageError
    from kvray.core.store import PageStore
    from tests.conftest import TINY, prefix_kv
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)        # get EFBIG instead of a kill
    store = PageStore(StoreConfig(layout=TINY, tiers=TierSizes(disk=64), disk_dir=sys.argv[1]))
    stride = store.pools[2].stride
    resource.setrlimit(resource.RLIMIT_FSIZE, (stride * 5, stride * 5))  # room for 5 pages
    first = list(range(12))
    assert store.store(first, prefix_kv(TINY, first)) == 3
    second = list(range(100, 132))
    try:
        store.store(second, prefix_kv(TINY, second))
    except StorageError as exc:
        print("ERROR", exc)
    hit = store.load(first)
    assert hit.tokens == 12 and torch.equal(hit.kv, prefix_kv(TINY, first)), "stored pages were harmed"
    print("KEPT", store.lookup(second), store.stats()["tiers"]["disk"]["used"])
"""


def test_disk_full_fails_cleanly_and_keeps_what_was_stored(tmp_path):
    out = run_python(DISK_FULL, str(tmp_path / "disk"))
    assert out.returncode == 0, out.stderr
    error = next(line for line in out.stdout.splitlines() if line.startswith("ERROR"))
    assert "disk tier" in error and "no space left" in error and "slots in use" in error
    kept, used = map(int, out.stdout.split("KEPT")[1].split())
    assert kept == 8 and used == 5  # the two pages that fitted stay, as a valid prefix
    store = PageStore(StoreConfig(layout=TINY, tiers=TierSizes(disk=64), disk_dir=tmp_path / "disk"))
    assert store.lookup(list(range(12))) == 12 and store.lookup(list(range(100, 132))) == 8


KILLED_MID_MOVE = """
    import os, sys
    from kvray.core.config import StoreConfig, TierSizes
    from kvray.core.store import PageStore
    from kvray.core.tiers import Tier
    from tests.conftest import TINY, prefix_kv
    store = PageStore(StoreConfig(layout=TINY, tiers=TierSizes(host=4, disk=8), disk_dir=sys.argv[1]))
    tokens = list(range(16))
    keys = store.keys(tokens)
    store.store(tokens, prefix_kv(TINY, tokens))
    # demote everything to disk first, so the disk copy is the only one
    for handle in [store.manager.index.handle_of(k) for k in keys]:
        assert store.manager.relocate(handle, Tier.DISK, store._move)
    copy = store._move
    def copy_then_die(*move):
        copy(*move)          # the bytes reached the host slot...
        os._exit(9)          # ...and the process dies before the move is published
    handle = store.manager.index.handle_of(keys[2])
    store.manager.relocate(handle, Tier.HOST, copy_then_die)
"""


def test_move_interrupted_between_copy_and_publish_leaves_the_source_readable(tmp_path):
    out = run_python(KILLED_MID_MOVE, str(tmp_path / "disk"))
    assert out.returncode == 9, out.stderr
    store = PageStore(StoreConfig(layout=TINY, tiers=TierSizes(host=4, disk=8), disk_dir=tmp_path / "disk"))
    tokens = list(range(16))
    hit = store.load(tokens)
    assert hit.tokens == 16 and hit.pages_by_tier == {"disk": 4}
    assert torch.equal(hit.kv, prefix_kv(TINY, tokens))


def test_concurrent_clients_never_see_torn_pages_and_counters_add_up(tmp_path):
    """8 threads store and load overlapping prefixes through tight tiers (demotions and
    evictions race with reads); every load is checked bit for bit."""
    config = StoreConfig(layout=TINY, tiers=TierSizes(device=3, host=5, disk=12), disk_dir=tmp_path, checksum_memory=True)
    store = PageStore(config)
    shared = list(range(8))  # a system prompt every client shares
    seen = {"hit_pages": 0, "lookups": 0, "lookup_pages": 0}
    lock, errors = threading.Lock(), []

    def client(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(40):
                tokens = shared + rng.integers(0, 4, size=int(rng.integers(0, 4)) * 4 + 3).tolist()
                if rng.random() < 0.5:
                    store.store(tokens, prefix_kv(TINY, tokens))
                hit = store.load(tokens)
                assert torch.equal(hit.kv, prefix_kv(TINY, tokens)[:, :, : hit.tokens]), "torn or wrong page"
                with lock:
                    seen["hit_pages"] += hit.tokens // TINY.page_tokens
                    seen["lookups"] += 1
                    seen["lookup_pages"] += len(tokens) // TINY.page_tokens
        except Exception as exc:  # surfaced below with the thread's seed
            errors.append((seed, exc))

    threads = [threading.Thread(target=client, args=(seed,)) for seed in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "deadlock: a client never finished"
    assert not errors, errors
    stats = store.stats()
    assert stats["corrupt_pages"] == 0
    assert (stats["lookups"], stats["lookup_pages"], stats["hit_pages"]) == (
        seen["lookups"],
        seen["lookup_pages"],
        seen["hit_pages"],
    )
    assert sum(t["used"] for t in stats["tiers"].values()) == len(store)


# -- hostile input: only kvray errors, and stored pages never change ----------------------
@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(st.binary(max_size=60) | st.text(max_size=60).map(str.encode), max_size=5))
def test_fuzzed_trace_files_raise_only_trace_errors(tmp_path, lines):
    path = tmp_path / "fuzz.jsonl"
    path.write_bytes(b"\n".join(lines))
    with suppress(KvrayError):  # anything else escaping fails the test
        read_trace(path)


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=12,
)
LAYOUT_FIELDS = st.fixed_dictionaries(
    {},
    optional={k: JSONISH | st.integers(-5, 100) for k in ("layers", "kv_heads", "head_dim", "page_tokens", "dtype", "extra")},
)


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=JSONISH | LAYOUT_FIELDS.map(lambda layout: {"layout": layout, "tiers": {"host": 1}}))
def test_fuzzed_config_files_raise_only_config_errors(tmp_path, doc):
    path = tmp_path / "store.yaml"
    path.write_text(yaml.safe_dump(doc))
    try:
        config = load_yaml(path, StoreConfig)
    except KvrayError:
        return
    assert isinstance(config.layout, PageLayout)


@settings(max_examples=examples(150), deadline=None)
@given(
    tokens=st.lists(st.integers(-(2**33), 2**33) | st.floats(allow_nan=True), max_size=30),
    pages=st.integers(0, 3),
    width=st.integers(0, 2 * TINY.page_nbytes),
    fingerprint=st.binary(min_size=0, max_size=20),
)
def test_fuzzed_page_api_never_changes_stored_pages(tokens, pages, width, fingerprint):
    store = FUZZ_STORE
    before = store.load(FUZZ_TOKENS).kv.clone()
    for action in (
        lambda: store.store(tokens, torch.zeros(TINY.request_shape(len(tokens)))),
        lambda: store.load(tokens),
        lambda: store.put_pages(list(range(1, pages + 1)), np.zeros((pages, width), np.uint8), fingerprint),
    ):
        with suppress(KvrayError):
            action()
    after = store.load(FUZZ_TOKENS)
    assert after.tokens == 16 and torch.equal(after.kv, before)


FUZZ_TOKENS = list(range(16))
FUZZ_STORE = PageStore(StoreConfig(layout=TINY, tiers=TierSizes(host=64)))
FUZZ_STORE.store(FUZZ_TOKENS, prefix_kv(TINY, FUZZ_TOKENS))
