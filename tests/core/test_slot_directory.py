"""The shared slot directory: its key -> slot table against a dict model, optimistic
reads racing a real PageStore that keeps overwriting, demoting and evicting host slots,
the clean-up of a killed store's segments (never another user's), and the machines on
which engines may read it at all."""

from __future__ import annotations

import multiprocessing
import os
import secrets
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvray.core.config import PageLayout, StoreConfig, TierSizes
from kvray.core.errors import StorageError
from kvray.core.store import PageStore
from kvray.core.tiers.directory import (
    CLOSED,
    EMPTY,
    MAGIC,
    OPEN,
    SHM_DIR,
    SharedHostTier,
    SlotDirectory,
    directory_name,
    retire,
    retire_predecessors,
)
from tests.properties import examples

CAPACITY = 6
# Keys share their low bits in small groups, so probe runs collide, wrap around the table
# (16 entries for 6 slots) and must survive deletions in their middle.
KEYS = [(hi << 64) | low for low in (3, 19, 35, 15, 31) for hi in (1, 2, 7)]


def _name() -> str:
    return f"kvt_{secrets.token_hex(6)}"


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, CAPACITY - 1), st.sampled_from(KEYS)), max_size=60))
def test_the_key_to_slot_table_matches_a_dict_model(ops):
    directory = SlotDirectory.create(_name(), CAPACITY)
    model: dict[int, int] = {}  # key -> slot, as the store would keep it
    try:
        for publish, slot, key in ops:
            held = next((k for k, s in model.items() if s == slot), None)
            if publish and key not in model:  # a store publishes a key in one slot at a time
                if held is not None:
                    del model[held]  # publishing over a slot replaces its page
                directory.publish(slot, key, checksum=key % 997)
                model[key] = slot
            elif not publish and held is not None:
                directory.free(slot)
                del model[held]
            elif not publish:
                directory.free(slot)  # freeing a free slot (an aborted store) changes nothing
            for k in KEYS:
                slot_found = directory.find(k)
                assert slot_found == model.get(k, EMPTY)
                if k in model:
                    assert directory.stable(slot_found, k)[1] == k % 997
            assert sorted(int(s) for s in directory.table if s != EMPTY) == sorted(model.values())
            assert all(directory.generations[s] % 2 == 0 for s in model.values())
    finally:
        directory.close()


def test_a_closed_directory_says_so_and_a_foreign_segment_is_refused():
    directory = SlotDirectory.create(_name(), 2)
    reader = SlotDirectory(directory._shm, owner=False)  # a second view of the same mapping
    assert reader.open
    directory._header[3] = 2  # what close() writes before unlinking
    assert not reader.open
    directory.close()
    with pytest.raises(StorageError):
        SlotDirectory.attach(_name())
    store = PageStore(StoreConfig(layout=LAYOUT, tiers=TierSizes(host=2), host_shared_memory=_name()))
    try:
        with pytest.raises(StorageError, match="not a kvray slot directory"):
            SlotDirectory.attach(store.config.host_shared_memory)  # the host pool, not its directory
    finally:
        store.close()


def test_a_dead_stores_segments_are_retired_closed_and_unlinked():
    name = _name()
    store = PageStore(StoreConfig(layout=LAYOUT, tiers=TierSizes(host=2), host_shared_memory=name))
    reader = SlotDirectory(store.directory._shm, owner=False)  # what an engine has mapped
    retire(name)  # as a successor does with segments a killed store left behind
    assert not reader.open
    assert not (SHM_DIR / name).exists() and not (SHM_DIR / directory_name(name)).exists()
    store.close()  # a store that was not dead after all still closes cleanly


OTHER_UID = 12345  # a uid nobody on the test machine is; segments are given to it with os.chown (root)


def _foreign_segments(prefix: str) -> tuple[Path, Path]:
    """A host tier and an open slot directory under a store's prefix that another user made."""
    host = SHM_DIR / f"{prefix}{secrets.token_hex(4)}"
    directory = SHM_DIR / directory_name(host.name)
    host.write_bytes(b"\7" * 4096)
    directory.write_bytes(np.array([MAGIC, 1, 2, OPEN, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], np.uint64).tobytes())
    for path in (host, directory):
        os.chown(path, OTHER_UID, OTHER_UID)
    return host, directory


def test_another_users_segments_under_a_stores_prefix_are_left_alone():
    """They must neither stop the store from starting (a PermissionError, as a plain user)
    nor, as root, be marked closed and unlinked."""
    assert os.geteuid() == 0, "the test suite runs as root (os.chown to another uid)"
    prefix = f"kvray_t{secrets.token_hex(3)}_node_"
    host, directory = _foreign_segments(prefix)
    mine = f"{prefix}{secrets.token_hex(4)}"
    killed = PageStore(StoreConfig(layout=LAYOUT, tiers=TierSizes(host=2), host_shared_memory=mine))  # never closed
    try:
        retire(host.name)
        assert retire_predecessors(prefix) == [mine]
        assert host.read_bytes() == b"\7" * 4096 and directory.exists()
        assert int(np.frombuffer(directory.read_bytes(), np.uint64)[3]) == OPEN
        assert not (SHM_DIR / mine).exists() and not (SHM_DIR / directory_name(mine)).exists()
        assert int(killed.directory._header[3]) == CLOSED
    finally:
        killed.close()
        host.unlink()
        directory.unlink()


def test_a_link_under_a_stores_prefix_is_not_followed(tmp_path):
    prefix = f"kvray_t{secrets.token_hex(3)}_node_"
    victim = tmp_path / "victim"
    victim.write_bytes(np.array([MAGIC, 1, 2, OPEN, 0, 0, 0, 0], np.uint64).tobytes())
    before = victim.read_bytes()
    host, directory = SHM_DIR / f"{prefix}abcd", SHM_DIR / f"{prefix}abcd_dir"
    host.symlink_to(victim)
    directory.symlink_to(victim)
    try:
        assert retire_predecessors(prefix) == []
        retire(host.name)
        assert victim.read_bytes() == before and host.is_symlink() and directory.is_symlink()
    finally:
        host.unlink()
        directory.unlink()


# -- optimistic reads racing a writer process ---------------------------------------------------
LAYOUT = PageLayout(layers=2, kv_heads=4, head_dim=64, page_tokens=64, dtype="float16")  # 128 KiB pages
POOL = 24  # keys the writer cycles through, over 4 host slots and 6 disk slots


def page_of(key: int) -> np.ndarray:
    """A page whose every byte depends on its key, so bytes of another key show."""
    return np.random.default_rng(key).integers(0, 256, LAYOUT.page_nbytes, dtype=np.uint8)


def _writer(name: str, disk_dir: str, checksum_memory: bool, ready, stop) -> None:
    """The store side: keeps storing and reading pages so host slots are rewritten,
    demoted to disk, promoted back and evicted while the reader copies."""
    store = PageStore(
        StoreConfig(
            layout=LAYOUT,
            tiers=TierSizes(host=4, disk=6),
            disk_dir=disk_dir,
            host_shared_memory=name,
            checksum_memory=checksum_memory,
        )
    )
    pages = {key: page_of(key) for key in range(1, POOL + 1)}
    ready.set()
    rng = np.random.default_rng(0)
    try:
        while not stop.is_set():
            key = int(rng.integers(1, POOL + 1))
            store.put_pages([key], pages[key][None], store.fingerprint.digest)
            store.read_pages([int(rng.integers(1, POOL + 1))], lambda i: np.empty(LAYOUT.page_nbytes, np.uint8))
    finally:
        store.close()


@pytest.mark.parametrize("verify", [False, True])
def test_optimistic_reads_never_return_bytes_of_another_key(tmp_path, verify):
    ctx = multiprocessing.get_context("spawn")
    name, ready, stop = _name(), ctx.Event(), ctx.Event()
    writer = ctx.Process(target=_writer, args=(name, str(tmp_path), verify, ready, stop), daemon=True)
    writer.start()
    try:
        assert ready.wait(60)
        tier = SharedHostTier.attach(name, 4, LAYOUT.page_nbytes)
        rows = np.empty((1, LAYOUT.page_nbytes), dtype=np.uint8)
        expected = {key: page_of(key) for key in range(1, POOL + 1)}
        rng = np.random.default_rng(1)
        # Read until enough pages were found while the writer ran (the race was real): a
        # count of tries alone found too few on a loaded machine, where the writer holds
        # slots mid-write for longer.
        hits, tries, deadline = 0, 0, time.monotonic() + 60
        while (hits < 150 or tries < 3000) and time.monotonic() < deadline:
            tries += 1
            key = int(rng.integers(1, POOL + 1))
            if tier.read([key], rows, verify=verify):
                hits += 1
                assert np.array_equal(rows[0], expected[key]), f"page {key}: bytes of another page"
        assert hits >= 150, f"{hits} hits in {tries} reads: the writer never raced the reader"
        tier.close()
    finally:
        stop.set()
        writer.join(30)
    assert writer.exitcode == 0
    with pytest.raises(StorageError):
        SlotDirectory.attach(directory_name(name))  # the store unlinked its segments on close


# -- where mapped reads are allowed ------------------------------------------------------------
@pytest.mark.parametrize("machine", ["aarch64", "arm64", "ppc64le", "riscv64"])
@pytest.mark.parametrize("checksum_memory", [False, True])
def test_off_x86_64_the_host_tier_is_not_shared_and_pages_go_through_the_store(monkeypatch, machine, checksum_memory):
    """Without total store order a seqlock reader can pair a stale key with a new page and
    its new checksum, so neither mapped reads nor checksums make it sound there."""
    monkeypatch.setattr("platform.machine", lambda: machine)
    name = _name()
    store = PageStore(
        StoreConfig(layout=LAYOUT, tiers=TierSizes(host=4), host_shared_memory=name, checksum_memory=checksum_memory)
    )
    try:
        assert store.directory is None and store.pools[1].shared_name is None
        assert not (SHM_DIR / name).exists() and not (SHM_DIR / directory_name(name)).exists()
        with pytest.raises(StorageError, match="cannot be mapped"):
            SharedHostTier.attach(name, 4, LAYOUT.page_nbytes)
        page = page_of(5)
        store.put_pages([5], page[None], store.fingerprint.digest)
        assert np.array_equal(store.get_pages([5])[1][0], page)
    finally:
        store.close()


@pytest.mark.parametrize("machine", ["x86_64", "AMD64"])
def test_on_x86_64_the_host_tier_is_shared_with_its_directory(monkeypatch, machine):
    monkeypatch.setattr("platform.machine", lambda: machine)
    name = _name()
    store = PageStore(StoreConfig(layout=LAYOUT, tiers=TierSizes(host=4), host_shared_memory=name))
    try:
        store.put_pages([5], page_of(5)[None], store.fingerprint.digest)
        tier = SharedHostTier.attach(name, 4, LAYOUT.page_nbytes)
        rows = np.empty((1, LAYOUT.page_nbytes), np.uint8)
        assert tier.read([5], rows, verify=False) == 1 and np.array_equal(rows[0], page_of(5))
        tier.close()
    finally:
        store.close()
