"""How many examples each property test draws, by hypothesis profile.

Tests write CI's count (``settings(max_examples=examples(200))``); the ``ci`` profile
(``make test``) draws exactly that, the ``dev`` profile (``make check`` and a bare
``pytest``) a fifth of it, so the inner loop stays fast while CI keeps its coverage.
The profiles are registered in ``tests/conftest.py``.
"""

from __future__ import annotations

from hypothesis import settings

CI_EXAMPLES = 100  # the ci profile's max_examples: counts written in the tests are for it


def examples(ci_count: int) -> int:
    """``ci_count`` scaled by the loaded profile (at least 5, so every test still explores)."""
    return max(5, round(ci_count * settings.default.max_examples / CI_EXAMPLES))
