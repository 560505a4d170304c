"""kvray in vLLM: ``KVRayConnector``, a KV connector (vLLM's ``KVConnectorBase_V1``), split
as vLLM splits its own connectors.

vLLM makes one connector object per role: one in the scheduler's process, one in each
worker's. The object vLLM loads is a facade; each role's work is in its own class, and
what passes between them is typed metadata that vLLM carries with each step:

- :mod:`~kvray.engines.vllm.connector`: ``KVRayConnector``, the facade vLLM loads
  (``kv_connector_module_path="kvray.engines.vllm.connector"``); it checks the engine's
  configuration, opens the pages and hands each call to its role's side;
- :mod:`~kvray.engines.vllm.scheduler`: the scheduler side: what kvray holds of each
  request's prompt, and what the worker loads and saves in each step;
- :mod:`~kvray.engines.vllm.lookups`: the scheduler side's calls to a kvray runtime, on a
  thread of their own so that a lookup never stops the engine;
- :mod:`~kvray.engines.vllm.worker`: the worker side: copies pages into and out of
  vLLM's paged KV cache, and on a kvray runtime reads and stores them itself;
- :mod:`~kvray.engines.vllm.metadata`: what the two sides pass each other, and the
  counters both keep;
- :mod:`~kvray.engines.vllm.codec`: kvray pages <-> vLLM's block tensors, per attention
  backend;
- :mod:`~kvray.engines.vllm.settings`: ``kv_connector_extra_config``, validated;
- :mod:`~kvray.engines.vllm.serve`: vLLM with the connector as a Ray Serve deployment;
- :mod:`~kvray.engines.vllm.router`: its KV-aware Ray Serve request router, whose choice
  (:mod:`~kvray.engines.vllm.routing`, pure) is the cluster policy's ``route``.

This package imports nothing on its own: ``codec``, ``settings`` and ``routing`` work without vLLM
installed (their tests run anywhere torch does); the rest import vLLM.
"""
