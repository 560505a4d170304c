"""The vLLM connector's ``kv_connector_extra_config``: parsed and turned into a
:class:`~kvray.core.config.StoreConfig` without importing vLLM.

Imports no vLLM, so that the one place untrusted engine settings enter kvray is testable,
and fuzzed, anywhere: whatever the user writes there, the outcome is a valid store config
or a :class:`~kvray.core.errors.ConfigError` naming the field.

Example::

    settings = connector_settings({"host_pages": 4096, "salt": "tenant-a"})
    config = store_config(settings, layout, served_model_name="my-model")
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kvray.core.config import PageLayout, StoreConfig, validate
from kvray.core.errors import ConfigError

SOURCE = "kv_connector_extra_config"


class ConnectorSettings(BaseModel):
    """``kv_connector_extra_config`` of the connector, validated once at start-up.

    ``disk_dir`` with ``disk_pages`` puts pages in files there; a later engine process
    started on the same directory finds them (one live engine per directory at a time:
    concurrent sharing is the Ray runtime's job). ``model_name`` defaults to vLLM's
    served model name; it goes into every page key with the layout, as do ``salt`` and
    each request's own ``cache_salt``, and the checkpoint's revision: vLLM's ``revision``
    (or ``model_revision``, which overrides it: name your local fine-tunes with it) and a
    hash of the model's config (:mod:`kvray.engines.revision`).

    ``kvray_runtime`` and ``kvray_ray_address`` (else ``$KVRAY_RUNTIME`` and
    ``$KVRAY_RAY_ADDRESS``) put the pages on a shared kvray runtime instead
    (:mod:`kvray.engines.runtime`); the tier sizes above then apply only when it cannot be
    reached. ``cluster_verbs``: ask the runtime's cluster policy how much of each hit to
    load, whether to prefetch it and whether to keep a copy here
    (:mod:`kvray.engines.vllm.verbs`); default: when that policy decides one of them.

    Example::

        ConnectorSettings(host_pages=4096, disk_pages=65536, disk_dir="/var/cache/kvray", salt="tenant-a")
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_name: str | None = Field(default=None, min_length=1)
    model_revision: str | None = Field(default=None, min_length=1, max_length=200)
    salt: str = ""
    device_pages: int = Field(default=0, ge=0)
    host_pages: int = Field(default=1024, ge=0)
    disk_pages: int = Field(default=0, ge=0)
    disk_dir: Path | None = None
    policy: str = "lru"
    kvray_runtime: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_-]{1,40}$")
    kvray_ray_address: str | None = Field(default=None, min_length=1)
    cluster_verbs: bool | None = None


def connector_settings(extra: Any) -> ConnectorSettings:
    """Validate the engine's ``kv_connector_extra_config`` (None means all defaults)."""
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise ConfigError(f"{SOURCE}: expected a mapping of settings, got {type(extra).__name__}")
    return validate(ConnectorSettings, extra, source=SOURCE)


def store_config(
    settings: ConnectorSettings, layout: PageLayout, served_model_name: str, model_revision: str | None = None
) -> StoreConfig:
    """The page store the connector opens (``model_revision``: the checkpoint's, see
    :func:`~kvray.engines.revision.checkpoint_revision`); every combination of settings is checked here."""
    config = {
        "layout": layout,
        "model_name": settings.model_name or served_model_name,
        "model_revision": model_revision,
        "tiers": {"device": settings.device_pages, "host": settings.host_pages, "disk": settings.disk_pages},
        "disk_dir": settings.disk_dir,
    }
    return validate(StoreConfig, config, source=SOURCE)
