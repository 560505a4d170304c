"""Landing buffers of engines that died without cleaning up: the store that mapped them
unmaps and unlinks them, and never one whose engine still runs or that is being copied,
nor a segment that is not a landing buffer of this user's (a caller can name any)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from kvray.cluster.shm import LandingBuffer, reap_orphans

PAGES, PAGE = 4, 4096
CREATE = (
    "import sys, time; from kvray.cluster.shm import LandingBuffer;"
    f"b = LandingBuffer.create({PAGES}, {PAGE}); b.pages[:] = 7; print(b.name, flush=True); time.sleep(60)"
)


def orphan() -> str:
    """A buffer whose engine (and its resource tracker) died by SIGKILL, as when Ray kills a
    worker's process group: nobody unlinked it."""
    engine = subprocess.Popen([sys.executable, "-c", CREATE], stdout=subprocess.PIPE, text=True, start_new_session=True)
    name = engine.stdout.readline().strip()
    os.killpg(engine.pid, signal.SIGKILL)
    engine.wait()
    assert Path("/dev/shm", name).exists()
    return name


def test_a_dead_engines_buffer_is_unmapped_and_unlinked():
    name = orphan()
    mapped = {name: LandingBuffer.attach(name, PAGES, PAGE)}
    assert (mapped[name].pages == 7).all() and not mapped[name].owner_alive
    assert reap_orphans(mapped) == [name]
    assert mapped == {} and not Path("/dev/shm", name).exists()


def test_a_live_engines_buffer_is_kept():
    mine = LandingBuffer.create(PAGES, PAGE)
    name = mine.name
    try:
        mapped = {name: LandingBuffer.attach(name, PAGES, PAGE)}
        assert reap_orphans(mapped) == [] and name in mapped and Path("/dev/shm", name).exists()
        mapped[name].close()
    finally:
        mine.close()
    assert not Path("/dev/shm", name).exists()


def test_a_buffer_still_being_copied_waits_for_the_next_reap():
    name = orphan()
    mapped = {name: LandingBuffer.attach(name, PAGES, PAGE)}
    assert reap_orphans(mapped, busy={name}) == [] and Path("/dev/shm", name).exists()
    assert (mapped[name].pages == 7).all()  # still mapped: the copy in flight can finish
    assert reap_orphans(mapped, busy=set()) == [name] and not Path("/dev/shm", name).exists()


OTHER_UID = 12345  # a uid nobody on the test machine is; segments are given to it with os.chown (root)


def dead_pid() -> int:
    process = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    return int(process.stdout)


def test_a_segment_create_did_not_name_is_never_reaped():
    """A caller can ask a store to map any segment: one named like ``<app>_<dead pid>_<hex>``
    is some other program's, not an orphaned landing buffer."""
    name = f"app_{dead_pid()}_{os.urandom(4).hex()}"
    Path("/dev/shm", name).write_bytes(b"\7" * PAGES * PAGE)
    try:
        mapped = {name: LandingBuffer.attach(name, PAGES, PAGE)}
        assert reap_orphans(mapped) == [] and name in mapped
        mapped[name].close()
        assert Path("/dev/shm", name).read_bytes() == b"\7" * PAGES * PAGE
    finally:
        Path("/dev/shm", name).unlink()


def test_a_dead_engines_buffer_that_is_not_this_users_is_unmapped_but_not_unlinked():
    assert os.geteuid() == 0, "the test suite runs as root (os.chown to another uid)"
    name = orphan()
    os.chown(Path("/dev/shm", name), OTHER_UID, OTHER_UID)
    try:
        mapped = {name: LandingBuffer.attach(name, PAGES, PAGE)}
        assert reap_orphans(mapped) == [name] and mapped == {}
        assert Path("/dev/shm", name).exists()
    finally:
        Path("/dev/shm", name).unlink()


def test_a_name_taken_by_another_segment_since_it_was_mapped_is_not_unlinked():
    name = orphan()
    mapped = {name: LandingBuffer.attach(name, PAGES, PAGE)}
    Path("/dev/shm", name).unlink()
    Path("/dev/shm", name).write_bytes(b"new owner")  # the name now names someone else's memory
    try:
        assert reap_orphans(mapped) == [name] and mapped == {}
        assert Path("/dev/shm", name).read_bytes() == b"new owner"
    finally:
        Path("/dev/shm", name).unlink()
