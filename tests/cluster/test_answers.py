"""Clients of one process share the answers they poll for (:class:`SharedAnswers`): many
clients asking at once make one call per period, each gets that call's answer, and a
client that must see the state from now on (``fresh``) gets a new one."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray

from kvray.cluster.answers import SharedAnswers

pytestmark = pytest.mark.ray


@ray.remote(num_cpus=0)
def stamp(n: int) -> int:
    return n


def test_many_clients_asking_at_once_make_one_call_per_period(ray_cluster):
    answers, calls = SharedAnswers(period_s=3.0), []  # ample for the asks between the checks on a loaded machine

    def call() -> ray.ObjectRef:
        calls.append(None)
        return stamp.remote(len(calls))

    with ThreadPoolExecutor(16) as pool:
        first = list(pool.map(lambda _: answers.ask("store-a", call).result(timeout=60), range(64)))
    assert first == [1] * 64 and len(calls) == 1
    assert answers.ask("store-b", call).result(timeout=60) == 2  # another question, its own call
    time.sleep(3.1)
    assert answers.ask("store-a", call).result(timeout=60) == 3  # the answer grew old: asked again
    assert answers.ask("store-a", call).result(timeout=60) == 3
    assert answers.ask("store-a", call, fresh=True).result(timeout=60) == 4 and len(calls) == 4
