"""The connector's asker of the cluster policy's verbs (kvray/engines/vllm/verbs.py), without
vLLM or Ray: which policies are asked, and that a request waits for its verbs only while they
are decided in time, never on a failure (the engine test is test_vllm_cluster_verbs.py)."""

from __future__ import annotations

import threading

from kvray.engines.vllm.verbs import DEFAULT, PENDING, ClusterVerbs, Verbs, decides_verbs
from kvray.policy.cluster import CostRouter, LocalFirstRing, make_cluster_policy
from tests.engines.verb_policy import SplitPrefetchReplicate


class WriteBudgetOnly(LocalFirstRing):
    """Decides the NVMe write budget alone, which reaches the store with the decision."""

    def disk_write_budget(self, node, cluster):
        return 1e8


def test_only_a_policy_that_decides_a_verb_is_asked():
    assert not decides_verbs(LocalFirstRing()) and not decides_verbs(CostRouter())
    assert decides_verbs(SplitPrefetchReplicate()) and decides_verbs(make_cluster_policy("always-prefetch"))
    assert decides_verbs(make_cluster_policy("rl-router")) and decides_verbs(WriteBudgetOnly())


class Scripted(ClusterVerbs):
    """Decides by running ``script`` instead of asking a controller."""

    def __init__(self, script, timeout_s: float = 5.0) -> None:
        super().__init__(runtime=None, counters={}, timeout_s=timeout_s)
        self._decide = lambda keys, route_key: script()


def test_a_request_waits_for_its_verbs_then_gets_them():
    gate = threading.Event()

    def decided() -> Verbs:
        gate.wait(5)
        return Verbs(load_pages=2, replicate=("node-b",))

    verbs = Scripted(decided)
    assert verbs.answer("never-asked") == DEFAULT
    verbs.ask("r", [1, 2, 3], route_key=1)
    assert verbs.answer("r") is PENDING
    gate.set()
    verbs.close()
    assert verbs.answer("r") == Verbs(2, ("node-b",)) and verbs.failures == 0
    verbs.forget("r")
    assert verbs.answer("r") == DEFAULT


def test_a_failed_or_late_decision_is_the_default_never_a_failed_request():
    def fails() -> Verbs:
        raise ConnectionError("controller gone")

    failing = Scripted(fails)
    failing.ask("r", [1], route_key=1)
    failing.close()
    assert failing.answer("r") == DEFAULT and failing.failures == 1
    gate = threading.Event()
    late = Scripted(lambda: gate.wait(5) and Verbs(0), timeout_s=0.0)
    late.ask("r", [1], route_key=1)
    assert late.answer("r") == DEFAULT and late.failures == 1
    gate.set()
    late.close()
    assert late.answer("r") == DEFAULT  # the late answer does not replace the default it got
