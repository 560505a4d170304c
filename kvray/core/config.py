"""Validated configuration: page layout, tier sizes, store settings.

Everything a user or a file hands kvray is checked here once, by pydantic, and trusted
afterwards. Invalid values raise :class:`kvray.core.errors.ConfigError` naming the field.

Example::
    from kvray.core.config import PageLayout, StoreConfig, TierSizes

    layout = PageLayout(layers=32, kv_heads=8, head_dim=128, page_tokens=256, dtype="bfloat16")
    assert layout.page_nbytes == 32 << 20   # one page holds K and V for all layers
    cfg = StoreConfig(layout=layout, tiers=TierSizes(host=128, disk=4096), disk_dir="/tmp/kv")
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvray.core.errors import ConfigError

DType = Literal["float32", "float16", "bfloat16"]
DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}


class FrozenModel(BaseModel):
    """Every kvray setting: immutable once validated, unknown fields refused."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class PageLayout(FrozenModel):
    """Shape of one KV page: ``layers x {K,V} x page_tokens x kv_heads x head_dim``.

    One page is one contiguous buffer so that it moves between tiers and nodes as a
    single copy. ``page_tokens`` plays the role of vLLM's block size / LMCache's chunk.
    """

    layers: int = Field(gt=0, le=1024)
    kv_heads: int = Field(gt=0, le=1024)
    head_dim: int = Field(gt=0, le=4096)
    page_tokens: int = Field(gt=0, le=65536)
    dtype: DType = "float16"

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        return (self.layers, 2, self.page_tokens, self.kv_heads, self.head_dim)

    def request_shape(self, tokens: int) -> tuple[int, int, int, int, int]:
        """Shape of the KV of ``tokens`` consecutive tokens, as :class:`PageStore` takes it."""
        return (self.layers, 2, tokens, self.kv_heads, self.head_dim)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def page_nbytes(self) -> int:
        return self.layers * 2 * self.page_tokens * self.kv_heads * self.head_dim * self.dtype_bytes


class TierSizes(FrozenModel):
    """Capacity of each local tier, in pages. A tier of 0 pages is absent."""

    device: int = Field(default=0, ge=0)
    host: int = Field(default=0, ge=0)
    disk: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _some_capacity(self) -> TierSizes:
        if self.device + self.host + self.disk == 0:
            raise ValueError("every tier has 0 pages: give device, host or disk a capacity")
        return self


class StoreConfig(FrozenModel):
    """Settings of one in-process :class:`kvray.core.store.PageStore`.

    ``model_name``, ``layout`` and ``model_revision`` form the model fingerprint that every
    page key carries, so two models never share pages; give ``model_revision`` (a commit,
    a weights hash) whenever a checkpoint can change under the same name, or a persistent
    disk tier serves the old weights' KV to the new ones. Disk pages are always hashed and verified;
    ``checksum_memory`` hashes pages in the memory tiers as well and verifies every read
    of them (a full extra pass over each page: guards against memory corruption at a
    cost of about a quarter of host-tier bandwidth). Off, a memory page gets its
    checksum when it is demoted to disk. ``host_shared_memory`` puts the host tier in that
    POSIX shared-memory segment, beside a slot directory, so engines on the node copy its
    pages without a call; only on x86-64, whose memory ordering the directory's lock-free
    reads rely on (:mod:`kvray.core.tiers.directory`): elsewhere the tier stays private.
    The placement policy is not a setting here but an object handed to the store.
    """

    layout: PageLayout
    model_name: str = Field(default="model", min_length=1, max_length=256)
    model_revision: str | None = Field(default=None, min_length=1, max_length=256)
    tiers: TierSizes = TierSizes(host=1024)
    disk_dir: Path | None = None
    disk_fsync: bool = False
    max_request_tokens: int = Field(default=1 << 20, gt=0)
    checksum_memory: bool = False
    host_shared_memory: str | None = None

    @model_validator(mode="after")
    def _disk_needs_dir(self) -> StoreConfig:
        if self.tiers.disk > 0 and self.disk_dir is None:
            raise ValueError("tiers.disk > 0 needs disk_dir")
        return self


def validate(model: type[BaseModel], data: Any, source: str = "config", flags: Mapping[str, str] | None = None) -> Any:
    """Build ``model`` from ``data``; raise ConfigError naming ``source`` and the bad fields.

    ``flags`` maps field names to the command-line flags that set them: a command's user typed
    flags, not the model's fields, so its errors name the flags (and not the model) instead.
    """
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        if flags is None:
            problems = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}" for err in exc.errors())
            raise ConfigError(f"{source}: invalid {model.__name__}: {problems}") from None
        raise ConfigError(f"{source}: " + "; ".join(_in_flags(err, flags) for err in exc.errors())) from None


def _in_flags(error: Any, flags: Mapping[str, str]) -> str:
    """One validation error with the fields it names written as their flags."""
    message = error["msg"].removeprefix("Value error, ")
    # a field named in the text: a dotted path (tiers.disk) or a name with an underscore (disk_root);
    # plain words (host, limit) are left alone, they may be English
    names = "|".join(sorted(map(re.escape, flags), key=len, reverse=True))
    named = r"\b(?:(?:[a-z_]+\.)+(" + names + r")|(" + "|".join(re.escape(f) for f in flags if "_" in f) + r"))\b"
    message = re.sub(named, lambda m: flags[m[1] or m[2]], message)
    # a setting no flag sets keeps its own name; a model's own check already says what it checks
    where = "" if error["type"] == "value_error" else ".".join(str(p) for p in error["loc"])
    field = next((flags[str(p)] for p in reversed(error["loc"]) if str(p) in flags), where or None)
    return message if field is None or field in message else f"{field}: {message}"


def read_yaml(path: str | Path) -> Any:
    """Parse a YAML file; unreadable, non-UTF-8 or malformed files raise ConfigError naming it."""
    path = Path(path)
    try:
        return yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None


def load_yaml(path: str | Path, model: type[BaseModel]) -> Any:
    """Read a YAML file and validate it as ``model``; errors name the file and the field."""
    return validate(model, read_yaml(path), source=str(path))
