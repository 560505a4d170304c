"""Links are queued resources: a transfer takes its bytes over the bottleneck bandwidth plus
latency, transfers sharing a lane queue, lanes work in parallel, and utilisation is the
bytes that arrived in the window over what the link could carry."""

import pytest

from kvray.sim.links import Link, transfer, transfer_ms

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
