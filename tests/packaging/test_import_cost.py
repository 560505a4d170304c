"""Processes that never touch a tensor start without torch (seconds of CPU per process).

Ray starts a process per actor: a controller, or a store without an accelerator tier, that
imported torch would take ~3x as long to come up (kvray.lazy). The command line's sim, eval
and status paths do not need it either. Run in a fresh interpreter, since this one has
torch loaded already.
"""

from __future__ import annotations

import subprocess
import sys

TORCH_FREE = [
    "kvray",
    "kvray.cli",
    "kvray.cluster",
    "kvray.cluster.controller",
    "kvray.cluster.node_store",
    "kvray.cluster.runtime",
    "kvray.sim.simulator",
    "kvray.policy.rl",
    "kvray.apps.replay_engine",  # a replay engine per node and run: its prefill stand-in is numpy
]


def run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def test_processes_that_touch_no_tensor_import_no_torch():
    first = run(
        "import importlib, sys\n"
        f"for module in {TORCH_FREE!r}:\n"
        "    importlib.import_module(module)\n"
        "    if 'torch' in sys.modules:\n"
        "        print(module)\n"
        "        break\n"
    )
    assert not first, f"importing {first} loads torch"


def test_the_names_that_need_torch_still_resolve():
    assert (
        run(
            "import sys, kvray, kvray.cluster, kvray.core.tiers as tiers\n"
            "before = 'torch' in sys.modules\n"
            "kvray.PageStore, tiers.DevicePool, kvray.cluster.KvrayClient, kvray.cluster.Runtime\n"
            "print(before, 'torch' in sys.modules)\n"
        )
        == "False True"
    )
