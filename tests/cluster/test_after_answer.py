"""The work a page server's read leaves for after its answer: run once, in order, and a
caller of ``run`` returns only once work another thread took is done (what the store's
next call relies on to find the read counted)."""

from __future__ import annotations

import threading

from kvray.cluster.after_answer import AfterAnswer


def test_work_runs_once_in_order_and_a_caller_waits_for_work_another_thread_took():
    after = AfterAnswer()
    started, release, log = threading.Event(), threading.Event(), []

    def slow() -> None:
        started.set()
        release.wait(10)
        log.append("slow")

    after.add(slow)
    after.add(lambda: log.append("next"))
    first = threading.Thread(target=after.run)
    first.start()
    started.wait(10)
    second = threading.Thread(target=after.run)  # the store's next call, while the server thread works
    second.start()
    second.join(0.2)
    assert second.is_alive() and log == []
    release.set()
    first.join(10)
    second.join(10)
    assert log == ["slow", "next"]
    after.run()
    assert log == ["slow", "next"]


def test_failing_work_is_logged_and_the_rest_runs(caplog):
    after = AfterAnswer()
    log = []
    after.add(lambda: 1 / 0)
    after.add(lambda: log.append("ran"))
    after.run()
    assert log == ["ran"] and "policy work after its answer failed" in caplog.text
