"""Faults injected into a running engine's store, the way real storage fails (tests of the
vLLM connector and the transformers adapter: a store that fails is a miss, never a failed
request and never wrong KV)."""

from __future__ import annotations

import os

from kvray.core.errors import ConfigError


def break_store(store, how: str) -> None:
    """Make a :class:`~kvray.core.store.PageStore`'s disk tier fail the way real storage does.

    ``wipe``: the page file loses its contents (someone else truncated it);
    ``io-error``: every read and write of it raises ``OSError`` (its descriptor now
    names a directory, as after a failed remount; it stays a valid descriptor, so no
    other file can be hit by mistake).
    """
    from kvray.core.tiers import Tier

    disk = store.pools[Tier.DISK]
    if how == "wipe":
        os.truncate(disk.path, 0)
    elif how == "io-error":
        directory = os.open("/", os.O_RDONLY)
        os.dup2(directory, disk._fd)
        os.close(directory)
    else:
        raise ConfigError(f"unknown fault {how!r}: use wipe or io-error")
