"""Landing buffers of engines that died without cleaning up: the store that mapped them
unmaps and unlinks them, and never one whose engine still runs or that is being copied."""

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
