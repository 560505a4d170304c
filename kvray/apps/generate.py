"""``kvray generate``: a seeded workload written as a trace file.

The workload is a family (or a held-out configuration) of :mod:`kvray.sim.workloads` by
name, a :class:`~kvray.sim.workloads.WorkloadSpec` YAML file, or the default spec; a number
of sessions overrides the family's or the spec's (a phased workload has none to override).

Example::

    requests = generate_trace(Path("agent.jsonl"), family="agent", sessions=None, seed=1, spec=None)
"""

from __future__ import annotations

from pathlib import Path

from kvray.core.config import load_yaml
from kvray.core.errors import ConfigError
from kvray.sim.workloads import PhasedWorkload, WorkloadSpec, generate, named_workload
from kvray.traces import write_trace


def generate_trace(out: Path, family: str | None, sessions: int | None, seed: int, spec: Path | None) -> int:
    """Write the workload to ``out`` (.jsonl or .parquet); returns its number of requests."""
    if family and spec:
        raise ConfigError("give --family or --spec, not both")
    shape = named_workload(family) if family else load_yaml(spec, WorkloadSpec) if spec else WorkloadSpec()
    if sessions is not None:
        if isinstance(shape, PhasedWorkload):
            raise ConfigError(f"--sessions does not apply to the phased workload {family!r}")
        shape = shape.model_copy(update={"sessions": sessions})
    trace = generate(shape, seed)
    write_trace(trace, out)
    return len(trace)
