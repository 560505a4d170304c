"""kvray.core._pagecopy computes XXH3-64 itself, fused with the copy: its values must be
xxhash's for any bytes split into any runs (the disk format's checksum; files written
before it existed must still verify), on both its AVX2 and its scalar stripes, and its
copies must be exact."""

import mmap

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvray.core import _pagecopy, pages
from kvray.core.tiers import DiskPool
from kvray.core.tiers import disk as disk_module
from tests.properties import examples

# Lengths around XXH3's edges: the short-input limit (240), a stripe (64), a block (1,024)
# and _pagecopy's copy block (16 KiB), and a few large ones.
EDGES = [241, 255, 256, 257, 1023, 1024, 1025, 1088, 2047, 2048, 2049, 16383, 16384, 16385, 65536 + 63, 1 << 20]


@pytest.fixture(params=[True, False], ids=["avx2", "scalar"], scope="module")
def stripes(request):
    """Each test runs on both stripe implementations (AVX2 only where the CPU has it)."""
    _pagecopy.use_avx2(request.param)
    yield request.param
    _pagecopy.use_avx2(True)


@st.composite
def split_bytes(draw, min_size: int = 0):
    """Bytes (often around XXH3's edges) and cut points splitting them into runs."""
    size = draw(st.one_of(st.sampled_from(EDGES), st.integers(min_size, 5000)))
    seed = draw(st.integers(0, 2**32 - 1))
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    cuts = sorted(draw(st.lists(st.integers(0, size), max_size=8)))
    return data, cuts


@settings(max_examples=examples(200))
@given(case=split_bytes())
def test_hash_runs_is_xxh3_64_of_the_bytes_however_they_are_split(stripes, case):
    data, cuts = case
    runs = np.split(data, cuts)
    want = xxhash.xxh3_64_intdigest(data)
    assert pages.hash_runs(runs) == want
    assert _pagecopy.hash_runs(runs) == (want if data.size > 240 else None)  # short inputs go to xxhash


@settings(max_examples=examples(200))
@given(case=split_bytes(), offset=st.integers(0, 100))
def test_copy_hash_copies_exactly_and_hashes_as_xxh3(stripes, case, offset):
    data, cuts = case
    source = np.zeros(offset + data.size, dtype=np.uint8)
    source[offset:] = data
    out = np.full(data.size + 1, 7, dtype=np.uint8)[1:]  # an unaligned destination
    digest = _pagecopy.copy_hash(np.split(out, cuts), source, offset, False)
    if data.size <= 240:
        assert digest is None
    else:
        assert digest == xxhash.xxh3_64_intdigest(data) and np.array_equal(out, data)


def test_copy_hash_refuses_a_range_outside_its_source():
    out = np.zeros(1000, dtype=np.uint8)
    with pytest.raises(ValueError, match="1000 bytes at offset 24 of a 1000-byte source"):
        _pagecopy.copy_hash([out], bytes(1000), 24, False)
    with pytest.raises(BufferError):
        _pagecopy.copy_hash([bytes(1000)], bytes(1000), 0, False)  # a destination must be writable


def test_a_truncated_mapping_is_not_copied(tmp_path):
    """A mapped source whose file was cut reads as absent (the pool then reads the slot by
    ``preadv`` and finds it torn), never as a crash on SIGBUS."""
    path = tmp_path / "f"
    path.write_bytes(bytes(range(256)) * 64)
    with open(path, "r+b") as fh:
        mapping = mmap.mmap(fh.fileno(), 16384, mmap.MAP_SHARED, mmap.PROT_READ)
        out = np.zeros(8192, dtype=np.uint8)
        assert _pagecopy.copy_hash([out], mapping, 4096, True) == xxhash.xxh3_64_intdigest(mapping[4096:12288])
        fh.truncate(4096)
        assert _pagecopy.copy_hash([out], mapping, 4096, True) is None
        mapping.close()


def test_a_pool_without_the_extension_reads_the_same(tmp_path, monkeypatch):
    """A checkout whose extension was not built reads page-cache hits by ``preadv`` and hashes
    with xxhash: the same bytes and checksums as the fused path."""
    page = np.random.default_rng(3).integers(0, 256, 3 * 4096, dtype=np.uint8)
    results = []
    for built in (True, False):
        if not built:
            monkeypatch.setattr(disk_module, "_pagecopy", None)
            monkeypatch.setattr(pages, "_pagecopy", None)
        pool = DiskPool(tmp_path / str(built), 2, page.size, fingerprint=b"f" * 16)
        assert pool._mapped == built
        digest = pool.write_runs(1, 5, None, [page[:100], page[100:]])
        out = np.zeros_like(page)
        ((stored, got),) = pool.read_many([(1, [out[:5000], out[5000:]])])
        assert stored is not None and got == digest == xxhash.xxh3_64_intdigest(page) and np.array_equal(out, page)
        results.append((stored, got))
        pool.close()
    assert results[0] == results[1]


def test_a_restart_finds_the_pages_of_a_sparse_slot_file(tmp_path):
    """Reads map the slot file ``capacity`` slots long (sparse); a restart's scan skips the
    holes and still finds exactly the slots written, freed ones excepted."""
    pool = DiskPool(tmp_path, 1000, 4096, fingerprint=b"f" * 16)
    page = np.random.default_rng(4).integers(0, 256, 4096, dtype=np.uint8)
    digests = {slot: pool.write_runs(slot, slot + 1, None, [page]) for slot in (3, 500, 999)}
    pool.write_runs(700, 701, None, [page])
    pool.free(700)
    ((stored, _),) = pool.read_many([(500, [np.zeros_like(page)])])  # maps the file: now 1000 slots long
    assert stored is not None and pool.path.stat().st_size == 1000 * pool.stride
    pool.close()
    again = DiskPool(tmp_path, 1000, 4096, fingerprint=b"f" * 16)
    assert {(p.slot, p.checksum) for p in again.scan()} == set(digests.items())
    again.close()
