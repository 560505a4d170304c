"""Error types: every failure kvray reports on bad input is a :class:`KvrayError`.

Callers (engines, the Ray runtime, the CLI) catch one base type and get a message that
names what is wrong. The subclasses let tests and callers tell the cases apart.
"""


class KvrayError(Exception):
    """Base class of all errors kvray raises on purpose."""


class ConfigError(KvrayError, ValueError):
    """A configuration, scenario or layout value is invalid."""


class LayoutError(KvrayError, ValueError):
    """A tensor or buffer does not match the page layout (shape, dtype, size)."""


class FingerprintMismatch(KvrayError, ValueError):
    """Pages or keys belong to another model layout than the one asked for."""


class RequestError(KvrayError, ValueError):
    """A request is empty, too long, or otherwise unusable."""


class TierFullError(KvrayError):
    """No slot can be freed in a tier (everything pinned or no room to demote)."""


class StorageError(KvrayError, OSError):
    """A tier's backing storage (a directory, a file) cannot be used."""


class CorruptPageError(KvrayError):
    """A stored page failed its checksum; it was dropped and never returned."""


class TraceError(KvrayError, ValueError):
    """A trace file is unreadable or malformed; the message names the file and line."""


class PolicyError(KvrayError, ValueError):
    """A placement policy name, file or observation space is invalid."""


class ClusterError(KvrayError):
    """The Ray runtime cannot start or lost something it needs (no nodes, no controller)."""
