"""Optimising the simulator's core (the manager, index, slots, policies' hooks, links)
must not change a single replayed figure: small replays of every heuristic policy, Belady,
a 4-node cluster under the cost router and the oracle, compared to the bit with the results
committed in ``tests/sim/data/replay_fingerprint.json`` (whole ReplayResults: mean and p99
TTFT, hit tokens by tier, bytes moved, per-link bytes and utilisation). Every replay runs
twice: with the chain writer in C (``kvray.sim._chain``, what LRU replays use) and with the
manager's Python, the reference it transcribes.

The committed results were recorded before the core's speed work (docs/design.md,
"Replay speed"). A change that is *meant* to change replays (a new cost model, a policy's
new rule) rewrites the file on purpose, and says so in its commit::

    PYTHONPATH=$PWD python -m tests.sim.test_replay_fingerprint --write

The learned ``reuse`` policy is left out: its model file is retrained on its own schedule,
and a new model changes its replays without any change of the core.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from functools import cache
from pathlib import Path

import pytest

import kvray.sim.node
from kvray.report import ReplayResult
from kvray.scenario import DEFAULT_SCENARIO, load_scenario
from kvray.sim import _chain  # the compiled chain writer: built by setup.py, as kvray.core's extensions
from kvray.sim.node import python_chain_writer
from kvray.sim.simulator import simulate
from kvray.sim.workloads import FAMILIES, generate
from kvray.traces import read_trace

FINGERPRINT = Path(__file__).parent / "data" / "replay_fingerprint.json"
POLICIES = ("lru", "arc", "lfu", "s3fifo", "sieve", "wfq", "belady")
REQUESTS = 400


@cache
def replays() -> dict[str, Callable[[], ReplayResult]]:
    """Each fingerprinted replay by name, not yet run."""
    trace = read_trace("conversation_trace_first30min.jsonl", limit=REQUESTS)
    agent = generate(FAMILIES["agent"], seed=3)[:REQUESTS]
    one, four = load_scenario(DEFAULT_SCENARIO), load_scenario("h100-4node-skewed")
    cells: dict[str, Callable[[], ReplayResult]] = {}
    for policy in POLICIES:
        for name, workload in (("trace", trace), ("agent", agent)):
            for fraction in (0.02, 0.05):
                cells[f"{policy}/{name}/{fraction}"] = lambda w=workload, p=policy, f=fraction: simulate(
                    w, p, one, capacity_fraction=f
                )
    cells["4node/cost-router/lru"] = lambda: simulate(agent, "lru", four, capacity_fraction=0.05, cluster_policy="cost-router")
    cells["4node/cost-router/arc"] = lambda: simulate(trace, "arc", four, capacity_fraction=0.02, cluster_policy="cost-router")
    cells["4node/oracle"] = lambda: simulate(agent[: REQUESTS // 2], "lru", four, capacity_fraction=0.05, cluster_policy="oracle")
    return cells


def fingerprint(result: ReplayResult) -> dict:
    return json.loads(result.as_json())  # json keeps every float's exact value (repr)


@pytest.fixture(scope="module")
def recorded() -> dict[str, dict]:
    return json.loads(FINGERPRINT.read_text())


def test_fingerprint_covers_every_replay(recorded):
    assert set(recorded) == set(replays())


@pytest.fixture(params=["compiled", "python"])
def core(request) -> Iterator[str]:
    """The chain writer the replays run: kvray.sim._chain where it applies, or Python only."""
    with python_chain_writer() if request.param == "python" else nullcontext():
        yield request.param


@pytest.mark.parametrize("name", list(replays()))
def test_replay_is_bit_identical_to_the_recorded_one(name, recorded, core):
    assert fingerprint(replays()[name]()) == recorded[name]


@pytest.mark.parametrize("policy", ["lru", "arc", "s3fifo"])
def test_replays_run_the_compiled_chain_writer(policy, monkeypatch):
    """The compiled path is the one taken (else the test above would compare Python twice):
    LRU's hooks transcribed, any other policy's called from C (``generic``)."""
    calls = []

    def counted(*args):
        calls.append(args[7:])
        return _chain.store_chain(*args)

    monkeypatch.setattr(kvray.sim.node, "_chain", type("Counted", (), {"store_chain": staticmethod(counted)}))
    name = f"{policy}/trace/0.02"
    assert fingerprint(replays()[name]()) == json.loads(FINGERPRINT.read_text())[name]
    assert len(calls) > REQUESTS // 2
    assert all(extra == () if policy == "lru" else extra[1] is True for extra in calls)


def test_a_reuse_replay_is_the_same_with_the_compiled_chain_writer_or_the_manager_s_python():
    """The learned policy (shipped model, sampled-shadow tripwire: its shadows store through
    the compiled writer too) is left out of the recorded file, not out of the comparison."""
    from kvray.policy.reuse import ReusePolicy
    from kvray.sim.simulator import Simulator, fast_capacity

    trace = read_trace("conversation_trace_first30min.jsonl", limit=REQUESTS)
    scenario = load_scenario(DEFAULT_SCENARIO)
    capacities = fast_capacity(scenario, trace, fraction=0.05)

    def replay() -> dict:
        return fingerprint(Simulator(scenario, ReusePolicy.load(), capacities).replay(trace))

    compiled = replay()
    with python_chain_writer():
        assert replay() == compiled
    assert compiled["policy_stats"]["disk_closed_requests"] == 0  # an unqueued disk never queues


@pytest.mark.slow
def test_a_cluster_replay_whose_busy_disks_close_to_reuse_is_the_same_with_either_chain_writer():
    """The 4-node scenario at about 0.85 load under the cost router: its disks load a page in
    0.54 of a prefill while idle, so only their read queue closes them to demotions, on some
    requests and not others; the compiled writer's demotions agree with the manager's Python
    through every opening and closing."""
    from kvray.policy.cluster import make_cluster_policy
    from kvray.sim.cluster import ClusterSimulator
    from kvray.sim.load import scaled
    from kvray.sim.node import node_capacities
    from kvray.sim.workloads import WorkloadSpec

    whole = generate(WorkloadSpec(sessions=250, system_prompt_pages=1, document_probability=0.5), seed=0)
    trace = scaled(whole[:600], 0.1587)
    scenario = load_scenario("h100-4node-skewed")
    capacities = node_capacities(scenario, whole, 0.05)

    def replay() -> dict:
        return fingerprint(ClusterSimulator(scenario, "reuse", make_cluster_policy("cost-router"), capacities).replay(trace))

    compiled = replay()
    assert compiled["policy_stats"]["disk_closed_requests"] > 0  # closed to some requests ...
    assert sum(v for k, v in compiled["link_bytes"].items() if k.endswith("nvme_write")) > 0  # ... open to others
    with python_chain_writer():
        assert replay() == compiled


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    FINGERPRINT.write_text(
        json.dumps({name: fingerprint(run()) for name, run in replays().items()}, indent=1, sort_keys=True) + "\n"
    )
