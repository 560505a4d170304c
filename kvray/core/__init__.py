"""kvray's core: keys, pages, the prefix index, the cache manager, tiers, the placement seam
(:mod:`kvray.core.placement`) and the in-process :class:`~kvray.core.store.PageStore`.

Nothing here imports Ray or an inference engine (docs/design.md, "Core without Ray"): the
simulator, the Ray runtime and the engine adapters all build on these modules.
"""
