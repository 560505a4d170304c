"""PageStore: round trips from every tier, placement, bad input, persistence, corruption."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from kvray.core.config import PageLayout, StoreConfig, TierSizes
from kvray.core.errors import ConfigError, FingerprintMismatch, KvrayError, LayoutError, RequestError, StorageError
from kvray.core.store import PageStore
from tests.conftest import TINY, prefix_kv

DTYPES = ["float32", "float16", "bfloat16"]


def make_store(tmp_path: Path | None = None, layout: PageLayout = TINY, **tiers) -> PageStore:
    disk_dir = tmp_path / "disk" if tmp_path is not None else None
    return PageStore(StoreConfig(layout=layout, tiers=TierSizes(**tiers), disk_dir=disk_dir))


def snapshot(store: PageStore, requests: list[list[int]]) -> list[torch.Tensor]:
    return [store.load(r).kv.clone() for r in requests]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tier", ["device", "host", "disk"])
def test_round_trip_is_bit_exact_from_each_tier(tmp_path, tier, dtype):
    layout = TINY.model_copy(update={"dtype": dtype})
    store = make_store(tmp_path, layout, **{tier: 8})
    tokens = list(range(100, 130))  # 7 full pages and 2 tokens of a partial one
    kv = prefix_kv(layout, tokens)
    assert store.store(tokens, kv) == 7
    hit = store.load(tokens)
    assert hit.tokens == 28 and hit.pages_by_tier == {tier: 7}
    assert torch.equal(hit.kv.view(torch.uint8), kv[:, :, :28].contiguous().view(torch.uint8))
    if tier == "device":
        assert store.stats()["tiers"]["device"]["stand_in"] is (not torch.cuda.is_available())


def test_full_tiers_demote_down_and_everything_stays_exact(tmp_path):
    store = make_store(tmp_path, device=2, host=2, disk=8)
    tokens = list(range(32))
    kv = prefix_kv(TINY, tokens)
    assert store.store(tokens, kv) == 8
    stats = store.stats()
    assert {t: v["used"] for t, v in stats["tiers"].items()} == {"device": 2, "host": 2, "disk": 4}
    assert stats["moved_pages"] == {"device->host": 6, "host->disk": 4}
    assert stats["bytes_moved"] == 10 * TINY.page_nbytes
    hit = store.load(tokens)
    assert hit.tokens == 32 and sum(hit.pages_by_tier.values()) == 8
    assert torch.equal(hit.kv, kv)
    assert stats["swap_latency"]["device->host"]["count"] == 6


def test_lru_evicts_the_least_recently_used_request():
    store = make_store(host=4)
    a, b, c = ([base + i for i in range(8)] for base in (0, 1000, 2000))
    for tokens in (a, b):
        store.store(tokens, prefix_kv(TINY, tokens))
    assert store.load(a).tokens == 8  # a is now more recent than b
    store.store(c, prefix_kv(TINY, c))
    assert store.lookup(a) == 8 and store.lookup(b) == 0 and store.lookup(c) == 8


def test_request_larger_than_the_cache_keeps_its_prefix():
    store = make_store(host=3)
    tokens = list(range(40))
    assert store.store(tokens, prefix_kv(TINY, tokens)) == 3
    assert store.lookup(tokens) == 12
    assert torch.equal(store.load(tokens).kv, prefix_kv(TINY, tokens)[:, :, :12])


def test_shared_prefix_is_stored_once_and_served_to_both():
    store = make_store(host=16)
    system = list(range(8))
    a, b = system + [50, 51, 52, 53], system + [60, 61, 62, 63]
    assert store.store(a, prefix_kv(TINY, a)) == 3
    assert store.store(b, prefix_kv(TINY, b)) == 1  # only b's own page is new
    assert torch.equal(store.load(b).kv, prefix_kv(TINY, b))


def test_tenant_salt_isolates_pages():
    store = make_store(host=8)
    tokens = list(range(16))
    store.store(tokens, prefix_kv(TINY, tokens), salt="tenant-a")
    assert store.lookup(tokens, salt="tenant-b") == 0
    assert store.lookup(tokens, salt="tenant-a") == 16


def test_pages_api_round_trips_and_checks_fingerprint():
    store = make_store(host=8)
    other = PageStore(StoreConfig(layout=TINY, model_name="other-model", tiers=TierSizes(host=8)))
    tokens = list(range(12))
    store.store(tokens, prefix_kv(TINY, tokens))
    keys, pages = store.get_pages(store.keys(tokens))
    assert len(keys) == 3 and pages.shape == (3, TINY.page_nbytes)
    with pytest.raises(FingerprintMismatch, match="model fingerprint"):
        other.put_pages(keys, pages, store.fingerprint.digest)
    assert len(other) == 0
    copy = make_store(host=8)
    assert copy.put_pages(keys, pages, copy.fingerprint.digest) == 3
    assert torch.equal(copy.load(tokens).kv, store.load(tokens).kv)


# -- bad input: a kvray error naming the problem, and nothing stored is lost or changed --
BAD_INPUTS = {
    "wrong dtype": (lambda s, t: s.store(t, prefix_kv(TINY, t).to(torch.float16)), LayoutError, "dtype"),
    "wrong shape": (lambda s, t: s.store(t, prefix_kv(TINY, t)[:, :, :-1]), LayoutError, "shape"),
    "wrong layers": (lambda s, t: s.store(t, prefix_kv(TINY.model_copy(update={"layers": 3}), t)), LayoutError, "shape"),
    "not a tensor": (lambda s, t: s.store(t, np.zeros(3)), LayoutError, "torch.Tensor"),
    "empty request": (lambda s, t: s.store([], prefix_kv(TINY, t)[:, :, :0]), RequestError, "empty"),
    "over-long request": (
        lambda s, t: s.store(list(range(70)), prefix_kv(TINY, list(range(70)))),
        RequestError,
        "max_request_tokens",
    ),
    "bad out tensor": (lambda s, t: s.load(t, out=torch.empty(2, 2, 1, 2, 4)), LayoutError, "cannot hold"),
    "other fingerprint": (
        lambda s, t: s.put_pages([1], np.zeros((1, TINY.page_nbytes), np.uint8), b"x" * 16),
        FingerprintMismatch,
        "fingerprint",
    ),
    "page bytes of wrong size": (
        lambda s, t: s.put_pages([1], np.zeros((1, 8), np.uint8), s.fingerprint.digest),
        LayoutError,
        "uint8",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_raises_and_loses_nothing(tmp_path, case):
    action, error, message = BAD_INPUTS[case]
    store = PageStore(
        StoreConfig(layout=TINY, tiers=TierSizes(device=1, host=2, disk=8), disk_dir=tmp_path, max_request_tokens=64)
    )
    stored = [list(range(i * 100, i * 100 + 12)) for i in range(3)]
    for tokens in stored:
        store.store(tokens, prefix_kv(TINY, tokens))
    before = snapshot(store, stored)
    with pytest.raises(error, match=message) as info:
        action(store, stored[0])
    assert isinstance(info.value, KvrayError)
    after = snapshot(store, stored)
    assert all(torch.equal(x, y) for x, y in zip(before, after)) and all(x.shape[2] == 12 for x in after)


def test_unusable_disk_directory_is_a_storage_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(StorageError, match="disk tier"):
        make_store(blocker, disk=4)
    with pytest.raises(StorageError, match="disk tier"):
        PageStore(StoreConfig(layout=TINY, tiers=TierSizes(disk=4), disk_dir="/proc/kvray-cannot-be-here"))


def test_invalid_config_names_the_field():
    with pytest.raises(ConfigError, match="tiers.disk > 0 needs disk_dir"):
        from kvray.core.config import validate

        validate(StoreConfig, {"layout": TINY.model_dump(), "tiers": {"disk": 4}})
    from kvray.core.config import validate

    with pytest.raises(ConfigError, match=r"layout\.layers"):
        validate(StoreConfig, {"layout": {**TINY.model_dump(), "layers": 0}})
    with pytest.raises(ConfigError, match="every tier has 0 pages"):
        validate(TierSizes, {})


# -- persistence and corruption of the disk tier ------------------------------------------
WRITER = textwrap.dedent(
    """
    import sys
    from kvray.core.config import StoreConfig, TierSizes
    from kvray.core.store import PageStore
    from tests.conftest import TINY, prefix_kv
    store = PageStore(StoreConfig(layout=TINY, tiers=TierSizes(host=1, disk=16), disk_dir=sys.argv[1]))
    for base in (0, 500):
        tokens = list(range(base, base + 20))
        store.store(tokens, prefix_kv(TINY, tokens))
    print(len(store))
    """
)


def test_disk_tier_survives_a_new_process(tmp_path):
    disk = tmp_path / "disk"
    out = subprocess.run(
        [sys.executable, "-c", WRITER, str(disk)], capture_output=True, text=True, check=True, cwd=Path(__file__).parents[2]
    )
    assert out.stdout.strip() == "10"
    store = make_store(tmp_path, disk=16)  # a new process' view: only what is on disk
    assert len(store) == 9  # the writer's last page lived in its host tier and died with it
    for base, expected in ((0, 20), (500, 16)):
        tokens = list(range(base, base + 20))
        hit = store.load(tokens)
        assert hit.tokens == expected
        assert torch.equal(hit.kv, prefix_kv(TINY, tokens)[:, :, :expected])
    files = list(disk.iterdir())
    assert oct(disk.stat().st_mode & 0o777) == "0o700" and all(oct(f.stat().st_mode & 0o777) == "0o600" for f in files)


def _stored_disk(tmp_path) -> tuple[PageStore, list[int], Path]:
    store = make_store(tmp_path, disk=8)
    tokens = list(range(24))
    store.store(tokens, prefix_kv(TINY, tokens))
    (path,) = (tmp_path / "disk").iterdir()
    return store, tokens, path


def _page_offset(store: PageStore, tokens: list[int], page: int) -> int:
    from kvray.core.tiers.disk import HEADER_BYTES

    handle = store.manager.index.handle_of(store.keys(tokens)[page])
    return int(store.manager.index.slot[handle]) * store.pools[2].stride + HEADER_BYTES


def test_flipped_bits_are_detected_dropped_and_never_returned(tmp_path):
    store, tokens, path = _stored_disk(tmp_path)
    offset = _page_offset(store, tokens, 3)
    with open(path, "r+b") as fh:
        fh.seek(offset + 5)
        byte = fh.read(1)
        fh.seek(offset + 5)
        fh.write(bytes([byte[0] ^ 0x10]))
    hit = store.load(tokens)
    assert hit.tokens == 12  # pages 0-2; page 3 is corrupt, so 4 and 5 are unreachable
    assert torch.equal(hit.kv, prefix_kv(TINY, tokens)[:, :, :12])
    stats = store.stats()
    assert stats["corrupt_pages"] == 1 and stats["tiers"]["disk"]["used"] == 3
    assert store.lookup(tokens) == 12
    restarted = make_store(tmp_path, disk=8)  # the dropped pages do not come back
    assert restarted.lookup(tokens) == 12


@pytest.mark.parametrize("first_copy", ["intact", "torn"])
def test_a_page_found_in_two_slots_after_a_crash_is_kept_once_and_the_store_starts(tmp_path, first_copy):
    """A slot freed without fsync can survive a crash beside the slot the page went to next:
    the restart keeps one copy whose bytes verify, frees the other, and serves the chain exact
    (it raised before). A first copy whose slot was partly rewritten before the crash is the
    one let go."""
    from kvray.core.tiers.disk import HEADER_BYTES

    store, tokens, path = _stored_disk(tmp_path)
    disk = store.pools[2]
    source = _page_offset(store, tokens, 2) - HEADER_BYTES
    spare = disk.stride * (disk.capacity - 1)  # 6 pages in 8 slots: the last is free
    with open(path, "r+b") as fh:
        fh.seek(source)
        whole = fh.read(disk.stride)
        fh.seek(spare)
        fh.write(whole)
        if first_copy == "torn":
            fh.seek(source + HEADER_BYTES + 5)
            fh.write(b"\xff\x00")
    store.close()
    restarted = make_store(tmp_path, disk=8)
    hit = restarted.load(tokens)
    assert hit.tokens == 24 and torch.equal(hit.kv, prefix_kv(TINY, tokens))
    assert len(restarted) == 6 and restarted.stats()["tiers"]["disk"]["used"] == 6
    again = make_store(tmp_path, disk=8)  # the repeat's slot was freed: a second restart finds it once too
    assert len(again) == 6 and again.load(tokens).tokens == 24


def test_truncated_file_loses_only_the_cut_pages(tmp_path):
    store, tokens, path = _stored_disk(tmp_path)
    os.truncate(path, _page_offset(store, tokens, 4) + 10)
    hit = store.load(tokens)
    assert hit.tokens == 16 and store.stats()["corrupt_pages"] == 1
    assert torch.equal(hit.kv, prefix_kv(TINY, tokens)[:, :, :16])
    assert make_store(tmp_path, disk=8).lookup(tokens) == 16


def test_corrupt_host_page_is_caught_when_memory_is_checksummed():
    store = PageStore(StoreConfig(layout=TINY, tiers=TierSizes(host=4), checksum_memory=True))
    tokens = list(range(16))
    store.store(tokens, prefix_kv(TINY, tokens))
    handle = store.manager.index.handle_of(store.keys(tokens)[1])
    store.pools[1].view(int(store.manager.index.slot[handle]))[0] ^= 0xFF
    assert store.load(tokens).tokens == 4
    assert store.stats()["corrupt_pages"] == 1


def test_memory_page_gets_its_checksum_when_demoted_to_disk(tmp_path):
    store = make_store(tmp_path, host=1, disk=8)  # memory pages unhashed (the default)
    tokens = list(range(12))
    store.store(tokens, prefix_kv(TINY, tokens))  # pages 0 and 1 demoted to disk
    index = store.manager.index
    first = index.handle_of(store.keys(tokens)[0])
    assert int(index.tier[first]) == 2 and int(index.checksum[first]) != 0
    (path,) = (tmp_path / "disk").iterdir()
    with open(path, "r+b") as fh:
        fh.seek(_page_offset(store, tokens, 1))
        fh.write(b"\xff\xff")
    assert store.load(tokens).tokens == 4 and store.stats()["corrupt_pages"] == 1


# -- a read that fails for another reason than its bytes drops nothing ----------------------
@pytest.mark.parametrize("tiers", [{"host": 8}, {"disk": 8}], ids=["host", "disk"])
@pytest.mark.parametrize("row", [1, 3], ids=["buffer-one-row-short", "row-past-the-buffer"])
def test_a_target_buffer_too_small_raises_before_any_page_is_touched(tmp_path, tiers, row):
    """What ``NodeStore.read_into`` hands the store: rows ``row..`` of a caller's landing buffer."""
    store = make_store(tmp_path, **tiers)
    tokens = list(range(12))
    store.store(tokens, prefix_kv(TINY, tokens))
    buffer = np.zeros((3, TINY.page_nbytes), np.uint8)
    with pytest.raises(LayoutError, match=f"no room for page {3 - row} of 3") as info:
        store.read_pages(store.keys(tokens), lambda i: buffer[row + i])
    assert isinstance(info.value, KvrayError)
    assert not buffer.any()  # validated before the first copy
    hit = store.load(tokens)
    assert hit.tokens == 12 and torch.equal(hit.kv, prefix_kv(TINY, tokens))
    assert store.stats()["corrupt_pages"] == 0 and not store.manager.index.pins.any()


def test_a_target_of_the_wrong_size_is_a_layout_error(tmp_path):
    store = make_store(tmp_path, host=4)
    tokens = list(range(8))
    store.store(tokens, prefix_kv(TINY, tokens))
    with pytest.raises(LayoutError, match=f"target of page 0 of 2 is uint8 \\(8,\\), not the {TINY.page_nbytes} bytes"):
        store.read_pages(store.keys(tokens), lambda i: np.zeros(8, np.uint8))
    assert store.load(tokens).tokens == 8 and store.stats()["corrupt_pages"] == 0


@pytest.mark.parametrize("shape", ["rows-half-used", "flat-every-other-byte", "blocks-every-other-byte"])
def test_a_strided_target_a_disk_read_could_only_fill_a_copy_of_is_a_layout_error(tmp_path, shape):
    """Pages read from disk are written into the target's contiguous runs; a target numpy can
    split only by copying would get its bytes into the copies while the read counted as
    delivered (checksums pass: they cover the copies). It is refused before any page is pinned."""
    store = make_store(tmp_path, disk=8)
    tokens = list(range(8))
    store.store(tokens, prefix_kv(TINY, tokens))
    nbytes = TINY.page_nbytes
    if shape == "rows-half-used":
        wide = np.zeros((2, nbytes // 16, 32), np.uint8)
        target = lambda i: wide[i, :, :16]  # noqa: E731
    elif shape == "flat-every-other-byte":
        wide = np.zeros((2, 2 * nbytes), np.uint8)
        target = lambda i: wide[i, ::2]  # noqa: E731
    else:  # blocks numpy views without a copy, each strided: no run of them is contiguous
        wide = np.zeros((2, 2, 4, nbytes // 4), np.uint8)
        target = lambda i: wide[i, :, :, ::2]  # noqa: E731
    with pytest.raises(LayoutError, match="target of page 0 of 2: a page view .* cannot be split into contiguous byte runs"):
        store.read_pages(store.keys(tokens), target)
    assert not wide.any() and not store.manager.index.pins.any()
    hit = store.load(tokens)
    assert hit.tokens == 8 and torch.equal(hit.kv, prefix_kv(TINY, tokens))


def test_a_failing_disk_read_is_a_storage_error_and_drops_nothing(tmp_path):
    store = make_store(tmp_path, disk=8)
    tokens = list(range(12))
    store.store(tokens, prefix_kv(TINY, tokens))
    pool = store.pools[2]
    saved = os.dup(pool._fd)
    broken = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    os.dup2(broken, pool._fd)  # every pread now fails with EISDIR, as a failing device would with EIO
    try:
        with pytest.raises(StorageError, match="read of slot"):
            store.load(tokens)
    finally:
        os.dup2(saved, pool._fd)
        os.close(saved)
        os.close(broken)
    hit = store.load(tokens)
    assert hit.tokens == 12 and torch.equal(hit.kv, prefix_kv(TINY, tokens))
    assert store.stats()["corrupt_pages"] == 0


# -- state read while another thread changes it --------------------------------------------
def test_stats_wait_for_a_change_in_progress(tmp_path):
    """``stats`` reads the slot allocators and counters under the store's lock: a snapshot
    taken while another thread is between a slot's allocation and its bookkeeping would
    not add up (or fail: an allocator's bitmap and free list disagree for a moment)."""
    store = PageStore(StoreConfig(layout=TINY, tiers=TierSizes(host=4, disk=8), disk_dir=tmp_path))
    tokens = list(range(12))
    store.store(tokens, prefix_kv(TINY, tokens))
    done = threading.Event()
    with store._lock:  # a store in the middle of a change
        reader = threading.Thread(target=lambda: (store.stats(), done.set()))
        reader.start()
        assert not done.wait(0.3)
    reader.join(10)
    assert done.is_set() and store.stats()["stored_pages"] == 3
