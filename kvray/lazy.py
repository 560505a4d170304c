"""Attributes of a package imported on first use.

kvray's pools, store and client load torch (pages land in tensors), which takes seconds of
CPU. A controller actor, the simulator and most commands need none of it, and Ray starts a
process per actor, so the packages that re-export those names load them lazily: a process
pays for torch only when it touches a tensor.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_attributes(package: str, where: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` (PEP 562) that imports ``where[name]`` when ``name`` is first
    read, and keeps it in the package, so later reads are plain attribute reads.

    Example::

        from kvray.lazy import lazy_attributes

        __getattr__ = lazy_attributes("kvray.cluster", {"Runtime": "kvray.cluster.runtime"})
        __getattr__("Runtime").__name__   # 'Runtime', imported now
    """

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[name]), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
