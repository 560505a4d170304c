"""Engines: kvray plugged into real inference engines.

- :mod:`kvray.engines.hf`: a Hugging Face transformers adapter that serves a causal LM's
  prefill from the longest cached prefix and stores the new pages.
- :mod:`kvray.engines.vllm`: ``KVRayConnector``, a vLLM ``KVConnectorBase_V1``, split into
  its scheduler side, worker side, page codec and Ray Serve deployment (its connector
  modules are imported only inside a vLLM environment).
- :mod:`kvray.engines.runtime`: both engines' pages on a shared kvray runtime (Ray),
  when one is named and reachable.
- :mod:`kvray.apps.chat`: a multi-turn conversation with TTFT per turn, with and
  without kvray.

Nothing here is imported by the core; each module imports its engine on its own.
"""
