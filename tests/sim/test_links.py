"""Links are queued resources: a transfer takes its bytes over the bottleneck bandwidth plus
latency, transfers sharing a lane queue, lanes work in parallel, and utilisation is the
bytes that arrived in the window over what the link could carry."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvray.sim.links import Link, transfer, transfer_ms
from tests.properties import examples

MB = 1_000_000


def test_one_load_takes_bytes_over_bandwidth_plus_latency():
    link = Link("pcie", gbps=10.0, latency_us=20.0)
    end = transfer((link,), ready_ms=5.0, nbytes=100 * MB, kind="load")
    assert end == pytest.approx(5.0 + 100 * MB / 10e9 * 1e3 + 0.020)
    assert link.bytes_by_kind == {"load": 100 * MB}


def test_two_concurrent_loads_queue_on_one_lane_and_not_on_two():
    one = Link("nvme", gbps=1.0)
    first = transfer((one,), 0.0, 10 * MB, "load")
    second = transfer((one,), 0.0, 10 * MB, "load")
    assert first == pytest.approx(10.0) and second == pytest.approx(20.0)
    two = Link("pcie", gbps=1.0, lanes=2)
    assert transfer((two,), 0.0, 10 * MB, "load") == pytest.approx(10.0)
    assert transfer((two,), 0.0, 10 * MB, "load") == pytest.approx(10.0)
    assert transfer((two,), 0.0, 10 * MB, "load") == pytest.approx(20.0)


def test_a_path_runs_at_its_slowest_link_and_holds_every_link():
    fast, slow = Link("pcie", gbps=50.0), Link("nvme", gbps=5.0, latency_us=100.0)
    end = transfer((slow, fast), 0.0, 50 * MB, "load", latency_ms=0.5)
    assert end == pytest.approx(0.5 + 0.1 + 10.0)
    assert transfer((fast,), 0.0, 50 * MB, "load") == pytest.approx(end + 1.0)  # waited for the path
    assert transfer_ms((slow, fast), 50 * MB, 0.5, ops=2) == pytest.approx(2 * 0.6 + 10.0)


def test_an_unqueued_link_never_delays_but_counts():
    link = Link("nvme_write", gbps=1.0, queued=False, window_ms=100.0)
    assert transfer((link,), 0.0, 100 * MB, "demote") == pytest.approx(100.0)
    assert transfer((link,), 0.0, 100 * MB, "demote") == pytest.approx(100.0)
    assert link.utilisation(100.0) == pytest.approx(2.0)  # twice what it can carry: uncharged work shows


def test_contention_is_the_utilisation_of_a_queued_link_and_nothing_on_an_unqueued_one():
    """What a policy is told of a link's queue: an unqueued link delays nothing, however busy."""
    queued, unqueued = Link("nvme_read", gbps=1.0, window_ms=100.0), Link("nvme_read", gbps=1.0, queued=False, window_ms=100.0)
    for link in (queued, unqueued):
        transfer((link,), 0.0, 50 * MB, "load")
    assert queued.contention(60.0) == queued.utilisation(60.0) == pytest.approx(0.5)
    assert unqueued.contention(60.0) == 0.0 and unqueued.utilisation(60.0) == pytest.approx(0.5)


def test_utilisation_counts_bytes_arrived_in_the_window():
    link = Link("nic_in", gbps=1.0, window_ms=100.0)
    transfer((link,), 0.0, 50 * MB, "load")  # arrives at 50 ms
    assert link.utilisation(49.0) == 0.0
    assert link.utilisation(60.0) == pytest.approx(0.5)
    assert link.utilisation(149.0) == pytest.approx(0.5)
    assert link.utilisation(150.0) == 0.0  # left the window
    assert link.utilisation_over(200.0) == pytest.approx(0.25)


def test_bad_links_are_refused():
    with pytest.raises(ValueError, match="nic"):
        Link("nic", gbps=0.0)


def test_a_load_fits_before_a_write_booked_for_later_and_waits_when_it_does_not_fit():
    link = Link("pcie_d2h", gbps=1.0)
    assert transfer((link,), 100.0, 10 * MB, "demote") == pytest.approx(110.0)  # a write booked for later
    assert transfer((link,), 0.0, 10 * MB, "load") == pytest.approx(10.0)  # idle until 100 ms: no wait
    assert transfer((link,), 95.0, 10 * MB, "load") == pytest.approx(120.0)  # would overlap it: after it
    nic = Link("nic_out", gbps=1.0)
    transfer((nic,), 12.0, 10 * MB, "load")  # the path's second link is busy from 12 to 22 ms
    assert transfer((link, nic), 5.0, 10 * MB, "load") == pytest.approx(32.0)  # both idle from 22 ms


def test_advance_forgets_only_what_ended_and_keeps_later_bookings():
    link = Link("nvme_write", gbps=1.0)
    for i in range(100):
        transfer((link,), 10.0 * i, 5 * MB, "store")  # 100 bookings, each 5 ms of every 10
    transfer((link,), 2000.0, 5 * MB, "store")
    link.advance(1000.0)
    assert transfer((link,), 1995.0, 10 * MB, "load") == pytest.approx(2015.0)  # the later booking still counts
    assert transfer((link,), 1000.0, 5 * MB, "load") == pytest.approx(1005.0)


@settings(max_examples=examples(60), deadline=None)
@given(
    lanes=st.integers(1, 3),
    jobs=st.lists(st.tuples(st.floats(0, 100), st.integers(1, 20), st.booleans()), min_size=1, max_size=40),
)
def test_no_lane_is_ever_double_booked_and_nothing_starts_before_it_is_ready(lanes, jobs):
    shared = Link("switch", gbps=1.0, lanes=lanes)
    other = Link("nic_in", gbps=2.0)
    booked = []
    for ready, mb, both in jobs:
        path = (shared, other) if both else (shared,)
        end = transfer(path, ready, mb * MB, "load")
        duration = mb * MB / 1e6  # the shared link is the bottleneck of either path
        assert end - duration >= ready - 1e-9
        booked.append((end - duration, end))
    for t in sorted({start for start, _ in booked}):  # at any start, at most `lanes` bookings hold the link
        assert sum(1 for s, e in booked if s <= t < e - 1e-9) <= lanes
