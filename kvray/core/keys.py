"""Chained page keys.

Key i of a request is ``H(key i-1 || tokens of page i)``, starting from a seed key that
hashes the model fingerprint and the tenant salt. A key therefore names the *whole* token
prefix up to the end of its page, for one model and one tenant: equal keys mean equal KV,
which is what lets the index answer longest-prefix questions with plain key lookups and
what keeps tenants and models apart. H is xxh3-128 (fast, non-cryptographic; 128 bits
make accidental collisions negligible at any realistic cache size).

Only full pages get keys: the KV of a partial last page is recomputed, as in vLLM.

Example::
    from kvray.core.config import PageLayout
    from kvray.core.keys import ModelFingerprint, page_keys

    layout = PageLayout(layers=2, kv_heads=2, head_dim=8, page_tokens=16)
    fp = ModelFingerprint.of(layout, "llama-3-8b")
    keys = page_keys(list(range(40)), fp, salt="tenant-a")   # one key per full page: 2
    assert len(keys) == 2 and keys != page_keys(list(range(40)), fp, salt="tenant-b")
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from kvray.core.config import PageLayout
from kvray.core.errors import RequestError

try:
    from kvray.core import _tokens
except ImportError:  # a checkout whose extension was not built (setup.py says how)
    _tokens = None

TOKEN_DTYPE = np.dtype("<i4")
TOKEN_MAX = np.iinfo(TOKEN_DTYPE).max


@dataclass(frozen=True)
class ModelFingerprint:
    """What a page's KV depends on besides the tokens: model identity and page layout.

    A name and a layout do not tell two checkpoints of one model apart (a fine-tune saved
    under the same name): ``revision`` names the weights as well (a hub commit, a hash,
    a version; see :mod:`kvray.engines.revision`), so a persistent disk tier never
    serves the KV of the weights it replaced. Without one the digest is what it always
    was, so disk tiers written before revisions existed stay readable.
    """

    digest: bytes
    page_tokens: int

    @classmethod
    def of(cls, layout: PageLayout, model_name: str, revision: str | None = None) -> ModelFingerprint:
        text = f"{model_name}|{layout.model_dump_json()}"
        if revision is not None:
            text += f"|revision|{revision}"
        return cls(digest=xxhash.xxh3_128_digest(text.encode()), page_tokens=layout.page_tokens)

    def seed_key(self, salt: str = "") -> bytes:
        """Key "-1" of every chain: binds the fingerprint and the tenant salt."""
        return xxhash.xxh3_128_digest(self.digest + b"|salt|" + salt.encode())

    @property
    def hex(self) -> str:
        return self.digest.hex()


def as_token_array(tokens: Sequence[int] | np.ndarray, max_tokens: int | None = None) -> np.ndarray:
    """Validate token ids and return them as a contiguous int32 array."""
    arr = _from_list(tokens) if isinstance(tokens, (list, tuple)) else None
    if arr is None:
        arr = _checked_array(tokens)
    if max_tokens is not None and arr.size > max_tokens:
        raise RequestError(f"request of {arr.size} tokens exceeds max_request_tokens={max_tokens}")
    return arr


def _from_list(tokens: list[int] | tuple[int, ...]) -> np.ndarray | None:
    """A non-empty list of valid token ids as int32, or None for :func:`_checked_array` to explain.

    Engines pass Python lists; ``np.asarray`` infers a type element by element (~45 µs
    for 2,048 tokens, most of a lookup), ``array("I")`` takes 12-20 µs, the C loop of
    :mod:`kvray.core._tokens` a few (built with kvray: see setup.py; without it,
    :func:`_from_list_array` is the way).
    """
    if _tokens is None:
        return _from_list_array(tokens)
    packed = _tokens.pack(tokens)
    return None if packed is None else np.frombuffer(packed, dtype=TOKEN_DTYPE)


def _from_list_array(tokens: list[int] | tuple[int, ...]) -> np.ndarray | None:
    """:func:`_from_list` without the C extension: ``array("I")`` converts in C and itself
    refuses anything but integers in [0, 2**32); only the top bit is left to check."""
    try:
        packed = array.array("I", tokens)
    except (TypeError, OverflowError):
        return None
    arr = np.frombuffer(packed, dtype=np.uint32)
    if arr.size == 0 or arr.max() > TOKEN_MAX:
        return None
    return arr.view(np.int32).astype(TOKEN_DTYPE, copy=False)


def _checked_array(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Any array-like of token ids as int32, or the :class:`RequestError` saying what is wrong."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise RequestError(f"token ids must be a flat sequence, got shape {arr.shape}")
    if arr.size == 0:
        raise RequestError("empty request: no token ids given")
    if arr.dtype.kind not in "iu":
        raise RequestError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.min() < 0 or arr.max() > TOKEN_MAX:
        raise RequestError("token ids must lie in [0, 2**31)")
    return np.ascontiguousarray(arr, dtype=TOKEN_DTYPE)


def page_keys(
    tokens: Sequence[int] | np.ndarray,
    fingerprint: ModelFingerprint,
    salt: str = "",
    max_tokens: int | None = None,
) -> list[int]:
    """Keys of the full pages of ``tokens``, chained from the fingerprint and salt."""
    arr = as_token_array(tokens, max_tokens)
    page = fingerprint.page_tokens
    data = memoryview(arr.data).cast("B")
    step = page * TOKEN_DTYPE.itemsize
    prev = fingerprint.seed_key(salt)
    keys: list[int] = []
    digest, to_int = xxhash.xxh3_128_digest, int.from_bytes
    for start in range(0, (arr.size // page) * step, step):
        prev = digest(prev + data[start : start + step])
        keys.append(to_int(prev, "little"))
    return keys


KEY_BYTES = 16  # a page key is an xxh3-128 digest
MASK64 = (1 << 64) - 1  # a key's low half: what 64-bit tables and hashes take of it


def trace_page_keys(fingerprint: ModelFingerprint, hash_ids: Sequence[int], salt: str = "") -> list[int]:
    """Page keys of a trace request: its prefix-chained block ids (each already names its
    whole prefix) bound to a model, as the runtime's engines key them; a simulator that
    keys pages the same way places them on the same nodes (hash rings hash the keys)."""
    seed = fingerprint.seed_key(salt)
    return [xxhash.xxh3_128_intdigest(seed + h.to_bytes(8, "little")) for h in hash_ids]


def pack_keys(keys: Sequence[int]) -> bytes:
    """Keys as one bytes object, 16 little-endian bytes each: what a fire-and-forget Ray call
    carries for a few microseconds, where a list of 128-bit ints is pickled int by int."""
    return b"".join(key.to_bytes(KEY_BYTES, "little") for key in keys)


def unpack_keys(packed: bytes) -> list[int]:
    """The keys :func:`pack_keys` packed: each from its two 64-bit halves, which numpy
    splits out (3.6x faster than ``int.from_bytes`` per key: 0.9 ms for 7,812 keys)."""
    if len(packed) % KEY_BYTES:
        raise RequestError(f"packed keys of {len(packed)} bytes: not a multiple of {KEY_BYTES}")
    halves = np.frombuffer(packed, dtype="<u8").reshape(-1, 2)
    return [high << 64 | low for low, high in zip(halves[:, 0].tolist(), halves[:, 1].tolist())]
