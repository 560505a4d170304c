"""The disk tier trusts only a directory and a slot file that are this user's and private:
planted links, foreign owners, loose modes and extra hard links are refused by name."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kvray.core.config import StoreConfig, TierSizes
from kvray.core.errors import StorageError
from kvray.core.keys import ModelFingerprint
from kvray.core.store import PageStore
from tests.conftest import TINY, prefix_kv

OTHER_UID = 12345  # a uid nobody on the test machine is; files are given to it with os.chown (root)


def disk_store(directory: Path) -> PageStore:
    return PageStore(StoreConfig(layout=TINY, tiers=TierSizes(disk=8), disk_dir=directory))


def slot_file(directory: Path) -> Path:
    """Where the store will put its slot file: predictable from the model fingerprint."""
    return directory / f"{ModelFingerprint.of(TINY, 'model').hex}.kvpages"


def private_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "disk"
    directory.mkdir(mode=0o700)
    return directory


def test_a_link_planted_at_the_slot_file_is_refused_and_its_target_untouched(tmp_path):
    directory = private_dir(tmp_path)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    slot_file(directory).symlink_to(victim)
    with pytest.raises(StorageError, match=f"{slot_file(directory)}.*symbolic link"):
        store = disk_store(directory)
        tokens = list(range(12))
        store.store(tokens, prefix_kv(TINY, tokens))  # what the old code did: write pages through the link
    assert victim.read_bytes() == b"precious"


def test_a_link_in_place_of_the_directory_is_refused(tmp_path):
    real = private_dir(tmp_path)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(StorageError, match=f"directory {link}.*symbolic link"):
        disk_store(link)
    assert list(real.iterdir()) == []


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o755, 0o701], ids=oct)
def test_a_directory_open_to_group_or_others_is_refused(tmp_path, mode):
    directory = private_dir(tmp_path)
    directory.chmod(mode)
    with pytest.raises(StorageError, match=f"directory {directory} has mode {mode:04o}, open to group or others"):
        disk_store(directory)
    assert list(directory.iterdir()) == []


@pytest.mark.parametrize("mode", [0o666, 0o644, 0o620], ids=oct)
def test_a_slot_file_open_to_group_or_others_is_refused(tmp_path, mode):
    directory = private_dir(tmp_path)
    disk_store(directory).close()
    slot_file(directory).chmod(mode)
    with pytest.raises(StorageError, match=f"file {slot_file(directory)} has mode {mode:04o}"):
        disk_store(directory)


def test_a_directory_or_file_owned_by_another_user_is_refused(tmp_path):
    assert os.geteuid() == 0, "the test suite runs as root (os.chown to another uid)"
    directory = private_dir(tmp_path)
    disk_store(directory).close()
    os.chown(slot_file(directory), OTHER_UID, OTHER_UID)
    with pytest.raises(StorageError, match=f"file {slot_file(directory)} is owned by uid {OTHER_UID}, not by this user"):
        disk_store(directory)
    os.chown(directory, OTHER_UID, OTHER_UID)
    with pytest.raises(StorageError, match=f"directory {directory} is owned by uid {OTHER_UID}, not by this user"):
        disk_store(directory)


def test_a_slot_file_with_another_hard_link_is_refused(tmp_path):
    directory = private_dir(tmp_path)
    disk_store(directory).close()
    os.link(slot_file(directory), tmp_path / "second-name")
    with pytest.raises(StorageError, match="2 hard links"):
        disk_store(directory)


def test_a_private_directory_found_in_place_is_used_and_survives_restarts(tmp_path):
    directory = private_dir(tmp_path)
    tokens = list(range(12))
    store = disk_store(directory)
    store.store(tokens, prefix_kv(TINY, tokens))
    store.close()
    hit = disk_store(directory).load(tokens)
    assert hit.tokens == 12 and torch.equal(hit.kv, prefix_kv(TINY, tokens))
    assert oct(slot_file(directory).stat().st_mode & 0o777) == "0o600"
