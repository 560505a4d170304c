"""Policies from outside kvray: ``package.module:Class`` names an importable policy class.

A cluster's actors build their policies by name from the runtime's settings, so a policy
written elsewhere (a user's package, a test's recorder) reaches them as an import path:
every process on the cluster imports the module itself. The class must subclass the
expected base, or the name is refused with a :class:`~kvray.core.errors.PolicyError`.

Example::

    from kvray.core.placement import PlacementPolicy
    from kvray.policy.plugin import policy_class

    policy_class("kvray.core.placement:LRUPolicy", PlacementPolicy)().name   # 'lru'
"""

from __future__ import annotations

import importlib

from kvray.core.errors import PolicyError


def is_import_path(name: str) -> bool:
    """Whether ``name`` is ``package.module:Class`` rather than a registered name."""
    return ":" in name and not name.startswith("rl:")


def policy_class(path: str, base: type) -> type:
    """The class at ``package.module:Class``, checked to subclass ``base``."""
    module_name, _, class_name = path.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise PolicyError(f"policy {path!r}: cannot import {class_name!r} from {module_name!r} ({exc})") from None
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise PolicyError(f"policy {path!r} is not a {base.__name__} subclass")
    return cls
