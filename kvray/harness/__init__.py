"""The harness that runs real engines for kvray's tests, benchmarks and demos, kept apart
from the engine adapters (:mod:`kvray.engines`) it drives; nothing in the adapters
imports it.

- :mod:`~kvray.harness.tiny`: small Llama models with seeded random weights (data/models/);
- :mod:`~kvray.harness.vllm_env`: vLLM's own environment, and a run started there from
  kvray's (a subprocess that answers one JSON object);
- :mod:`~kvray.harness.vllm_engine`: one vLLM engine in this process, as every run makes it;
- :mod:`~kvray.harness.vllm_runs`: the runs the engine tests and the TTFT benchmark ask
  for (engines in turn, on two Ray nodes, behind Ray Serve);
- :mod:`~kvray.harness.vllm_serving`: a vLLM engine serving requests as they come, in a
  threaded Ray actor (the served benchmark's);
- :mod:`~kvray.harness.faults`: store faults injected the way real storage fails.
"""
