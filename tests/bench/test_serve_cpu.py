"""The served benchmark's CPU meter (:mod:`kvray.bench.serve_cpu`): each actor's process reads
its own CPU time, so work done in an actor shows in its role's figure and idle actors add
(almost) nothing."""

from __future__ import annotations

import time

import pytest
import ray

from kvray.bench.serve_cpu import CpuMeter, median_per_request, per_request_ms

pytestmark = pytest.mark.ray


@ray.remote(num_cpus=0)
class Worker:
    def spin(self, seconds: float) -> None:
        """Busy for ``seconds`` of CPU time on two threads, as an engine's OpenMP threads are."""
        import threading

        def burn() -> None:
            end, spins = time.process_time() + seconds, 0
            while time.process_time() < end:  # the clock read and the count are the work
                spins += 1

        threads = [threading.Thread(target=burn) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def test_a_busy_actor_shows_its_cpu_time_and_an_idle_one_does_not(ray_cluster):
    busy, idle = Worker.remote(), Worker.remote()
    ray.get([busy.__ray_ready__.remote(), idle.__ray_ready__.remote()])
    meter = CpuMeter([busy])
    meter.roles["runtime"] = [idle]  # an idle actor in the other role
    before = meter.read()
    ray.get(busy.spin.remote(0.3))
    after = meter.read()
    spent = per_request_ms(before, after, requests=2)
    assert spent["engines"] >= 0.25 * 1e3 / 2  # every thread of the process counts, per request
    assert spent["runtime"] < 0.05 * 1e3 / 2
    assert spent["total"] == pytest.approx(spent["engines"] + spent["runtime"])
    ray.kill(busy)
    ray.kill(idle)


def test_the_median_of_runs_is_taken_part_by_part():
    runs = [{"engines": 100.0, "runtime": 9.0, "total": 109.0}, {"engines": 120.0, "runtime": 5.0, "total": 125.0},
            {"engines": 110.0, "runtime": 20.0, "total": 130.0}]  # fmt: skip
    assert median_per_request(runs) == {"engines": 110.0, "runtime": 9.0, "total": 125.0}
