"""The scheduler side's lookups off vLLM's thread (kvray/engines/vllm/lookups.py), without vLLM
or Ray: a request is answered None until its plan is in, one lookup runs at a time, every
plan taken or not is released exactly once, in order after the lookup, and a failed lookup
is a miss (the engine test is test_vllm_on_ray.py)."""

from __future__ import annotations

import threading
import time

from kvray.cluster.protocol import NO_LEASE, Plan
from kvray.engines.vllm.lookups import RuntimeLookups


def new_counters() -> dict[str, int]:
    return {"lookups": 0, "lookup_us": 0, "failures": 0}  # the side's (metadata.new_counters, which imports vLLM)


class FakeRuntime:
    """Looks up by waiting for ``gate`` and answering a plan per call (lease = lookup number);
    records every call in order, with the thread it ran on, and each lookup's hint."""

    def __init__(self, fail: bool = False) -> None:
        self.gate = threading.Event()
        self.calls: list[tuple[str, object, str]] = []
        self.fail = fail
        self.client = self
        self.hints: list[tuple[int, bool]] = []
        self.announce_fails = False

    def lookup(self, keys, route_key, ends_session_from=-1, tell=True):
        self.gate.wait(5)
        if self.fail:
            raise ConnectionError("controller gone")
        plan = Plan(len(self.hints) + 1, ["a"] * len(keys), [])
        self.calls.append(("lookup", plan.lease, threading.current_thread().name))
        self.hints.append((ends_session_from, tell))
        return plan

    def announce(self, keys, ends_session_from):
        if self.announce_fails:
            raise RuntimeError("store gone")
        self.calls.append(("announce", (tuple(keys), ends_session_from), threading.current_thread().name))

    def release(self, plan):
        self.calls.append(("release", plan.lease, threading.current_thread().name))

    def touch_unloaded(self, keys, plan, cut):
        self.calls.append(("touch", (plan.lease, cut), threading.current_thread().name))


def test_a_request_is_answered_none_until_its_plan_is_in_and_one_lookup_runs_at_a_time():
    runtime = FakeRuntime()
    counters = new_counters()
    lookups = RuntimeLookups(runtime, counters)
    assert lookups.plan("r1", [1, 2, 3], route_key=1) is None  # asked
    assert lookups.plan("r2", [4, 5], route_key=4) is None  # not asked: r1's lookup runs
    assert lookups.plan("r1", [1, 2, 3], route_key=1) is None  # still running
    runtime.gate.set()
    lookups._asked["r1"].result(timeout=5)
    plan = lookups.plan("r1", [1, 2, 3], route_key=1)
    assert plan.lease == 1 and plan.hit_pages == 3  # taken
    assert lookups.plan("r2", [4, 5], route_key=4) is None  # now asked
    lookups._asked["r2"].result(timeout=5)
    assert lookups.plan("r2", [4, 5], route_key=4).hit_pages == 2
    lookups.release(plan)
    lookups.close()
    assert [c[:2] for c in runtime.calls] == [("lookup", 1), ("lookup", 2), ("release", 1)]  # told none: announced none
    assert all(c[2].startswith("kvray-lookup") for c in runtime.calls)  # never on the caller's (vLLM's) thread
    assert counters["lookups"] == 2 and counters["lookup_us"] > 0 and counters["failures"] == 0


def test_a_request_gone_before_its_plan_was_taken_releases_it_once_after_the_lookup():
    runtime = FakeRuntime()
    lookups = RuntimeLookups(runtime, new_counters())
    assert lookups.plan("r1", [1, 2], route_key=1) is None
    lookups.forget("r1")  # while its lookup still waits for the controller
    lookups.forget("r1")  # twice: nothing more
    lookups.touch_unloaded([1, 2], Plan(7, ["a"], []), 1)
    runtime.gate.set()
    lookups.close()
    assert [c[:2] for c in runtime.calls] == [("lookup", 1), ("release", 1), ("touch", (7, 1))]


def test_a_failed_lookup_is_a_miss_never_a_failed_request():
    runtime = FakeRuntime(fail=True)
    runtime.gate.set()
    counters = new_counters()
    lookups = RuntimeLookups(runtime, counters)
    assert lookups.plan("r", [1], route_key=1) is None
    lookups._asked["r"].result(timeout=5)
    plan = lookups.plan("r", [1], route_key=1)
    assert plan.lease == NO_LEASE and plan.hit_pages == 0 and counters["failures"] == 1
    lookups.close()


def test_on_done_runs_as_each_lookup_ends_so_the_next_ask_takes_its_plan():
    """An engine loop sleeping while the lookup runs is woken once its plan is in, not before."""
    runtime = FakeRuntime()
    lookups = RuntimeLookups(runtime, new_counters())
    woken: list[bool] = []
    lookups.on_done = lambda: woken.append(lookups._asked["r1"].done())
    assert lookups.plan("r1", [1, 2], route_key=1) is None
    assert woken == []  # the lookup waits for the gate
    runtime.gate.set()
    lookups._asked["r1"].exception(timeout=5)
    for _ in range(500):  # the callback runs on the lookup thread just after the future completes
        if woken:
            break
        time.sleep(0.01)
    assert woken == [True] and lookups.plan("r1", [1, 2], route_key=1).lease == 1
    lookups.close()


def test_the_store_is_told_once_before_the_plan_is_handed_over_with_every_page_and_the_hint():
    """A request's first lookup tells this node's store of it on the lookup thread, before vLLM
    can take the plan (the worker's stores of its pages come after): every full page of the
    prompt, which can be more than the lookup's, with the client's hint over them; the lookup
    carries the hint too (``RuntimePages.lookup`` drops it where it names no page looked up). A
    retry (vLLM asks again for a request it could not schedule) tells no store again."""
    runtime = FakeRuntime()
    runtime.gate.set()
    lookups = RuntimeLookups(runtime, new_counters())
    assert lookups.plan("r1", [1, 2, 3], route_key=1, told=([1, 2, 3, 4], 1)) is None
    lookups._asked["r1"].result(timeout=5)
    assert lookups.plan("r1", [1, 2, 3], route_key=1).lease == 1
    assert lookups.plan("r1", [1, 2, 3], route_key=1) is None  # again, told already: told=None
    lookups._asked["r1"].result(timeout=5)
    lookups.plan("r1", [1, 2, 3], route_key=1)
    assert lookups.plan("r2", [5, 6], route_key=5, told=([5, 6, 7], 2)) is None
    lookups.close()
    assert [c[:2] for c in runtime.calls] == [
        ("lookup", 1),
        ("announce", ((1, 2, 3, 4), 1)),
        ("lookup", 2),
        ("lookup", 3),
        ("announce", ((5, 6, 7), 2)),
        ("release", 3),  # r2's plan, never taken: released as the side closes
    ]
    assert runtime.hints == [(1, True), (-1, False), (2, True)]


def test_a_request_arrives_whatever_its_lookup_finds_and_one_not_looked_up_is_told_too():
    """A lookup that fails is a miss, and the store still hears of the request; a request with
    nothing to look up (vLLM holds every page it could load) is told on the same thread, after
    the calls made before."""
    runtime = FakeRuntime(fail=True)
    runtime.gate.set()
    counters = new_counters()
    lookups = RuntimeLookups(runtime, counters)
    lookups.plan("r1", [1, 2], route_key=1, told=([1, 2, 3], 2))
    lookups._asked["r1"].result(timeout=5)
    assert lookups.plan("r1", [1, 2], route_key=1).lease == NO_LEASE and counters["failures"] == 1
    lookups.announce(([4, 5], -1))
    lookups.close()
    assert [c[:2] for c in runtime.calls] == [("announce", ((1, 2, 3), 2)), ("announce", ((4, 5), -1))]
    assert all(c[2].startswith("kvray-lookup") for c in runtime.calls)


def test_a_store_that_cannot_be_told_leaves_the_plan_standing():
    """The lookup pinned the prefix: a failed announce is counted, and the plan still goes to
    vLLM (a lost plan would keep its pages pinned until its lease expires)."""
    runtime = FakeRuntime()
    runtime.gate.set()
    runtime.announce_fails = True
    counters = new_counters()
    lookups = RuntimeLookups(runtime, counters)
    lookups.plan("r1", [1, 2], route_key=1, told=([1, 2], -1))
    lookups._asked["r1"].result(timeout=5)
    assert lookups.plan("r1", [1, 2], route_key=1).lease == 1 and counters["failures"] == 1
    lookups.close()


def test_a_hint_names_the_page_of_its_token_and_a_bad_one_is_ignored(caplog):
    """``kv_transfer_params["kvray_ends_session_from_token"]``: the page holding that token is the
    first of the session's own (its key binds every token before); no hint without the key,
    past the pages looked up, or for a value that is not a token index (logged by name)."""
    from kvray.engines.vllm.hints import SESSION_END_PARAM, session_end_page

    assert session_end_page({SESSION_END_PARAM: 128}, 64, 4) == 2
    assert session_end_page({SESSION_END_PARAM: 130}, 64, 4) == 2
    assert session_end_page({SESSION_END_PARAM: 0}, 64, 4) == 0
    assert session_end_page({SESSION_END_PARAM: 256}, 64, 4) == -1  # past the prompt's full pages
    assert session_end_page(None, 64, 4) == session_end_page({"other": 1}, 64, 4) == -1
    for bad in (-1, "128", 1.5, True, None):
        with caplog.at_level("WARNING"):
            caplog.clear()
            assert session_end_page({SESSION_END_PARAM: bad}, 64, 4, "req-7") == -1
        assert SESSION_END_PARAM in caplog.text and "req-7" in caplog.text
