"""Request traces: Mooncake JSON Lines or Parquet with the same columns.

A trace is a list of :class:`TraceRequest`: arrival time (ms), prompt and output lengths,
and ``hash_ids``, one prefix-chained id per ``block_tokens``-token block of the prompt
(512 in Mooncake's traces). Two requests share block i only if they share the whole
prefix up to block i, exactly like kvray's own page keys, so the simulator and
``kvray run`` use a trace id as a page key.

Malformed input raises :class:`kvray.core.errors.TraceError` naming the file and line (row).

Example::
    from kvray.traces import read_trace

    trace = read_trace("conversation_trace_first30min.jsonl")   # shipped with kvray, or any path
    trace[0].hash_ids[:3], len(trace)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvray.core.errors import ConfigError, TraceError
from kvray.resources import shipped_or_given

MOONCAKE_BLOCK_TOKENS = 512
COLUMNS = ("timestamp", "input_length", "output_length", "hash_ids")


@dataclass(frozen=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def full_blocks(hash_ids: Sequence[int], input_length: int, block_tokens: int) -> Sequence[int]:
    """The block ids of a request that can be cached: its full ``block_tokens`` blocks.

    A partial last block is recomputed, never cached (as in vLLM): the runtime keys only
    full pages, and the simulator follows the same rule so their hits agree.
    """
    return hash_ids[: min(input_length // block_tokens, len(hash_ids))]


def _request(row: object, where: str) -> TraceRequest:
    if not isinstance(row, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(row).__name__}")
    missing = [c for c in COLUMNS if c not in row]
    if missing:
        raise TraceError(f"{where}: missing field(s) {', '.join(missing)}")
    ts, inp, out, ids = (row[c] for c in COLUMNS)
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not np.isfinite(ts) or ts < 0:
        raise TraceError(f"{where}: timestamp must be a non-negative number, got {ts!r}")
    for name, value in (("input_length", inp), ("output_length", out)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise TraceError(f"{where}: {name} must be a non-negative integer, got {value!r}")
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise TraceError(f"{where}: hash_ids must be a list of non-negative integers")
    return TraceRequest(float(ts), inp, out, tuple(ids))


def read_jsonl(path: Path) -> list[TraceRequest]:
    requests = []
    with path.open("rb") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise TraceError(f"{path}:{lineno}: not valid JSON ({exc})") from None
            requests.append(_request(row, f"{path}:{lineno}"))
    return requests


def read_parquet(path: Path) -> list[TraceRequest]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several unrelated types for a bad file
        raise TraceError(f"{path}: not a readable Parquet file ({exc})") from None
    missing = [c for c in COLUMNS if c not in table.column_names]
    if missing:
        raise TraceError(f"{path}: missing column(s) {', '.join(missing)}")
    return [_request(row, f"{path}:row {i + 1}") for i, row in enumerate(table.select(list(COLUMNS)).to_pylist())]


def read_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Read a Mooncake JSONL (``.jsonl``/``.json``) or Parquet (``.parquet``) trace."""
    try:
        path = shipped_or_given(path, "data/traces")
    except ConfigError:
        raise TraceError(f"{path}: no such trace file (nor a trace shipped by that name)") from None
    if not path.is_file():
        raise TraceError(f"{path}: not a trace file")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        requests = read_jsonl(path)
    elif suffix in (".parquet", ".pq"):
        requests = read_parquet(path)
    else:
        raise TraceError(f"{path}: unknown trace format {suffix!r} (expected .jsonl or .parquet)")
    if not requests:
        raise TraceError(f"{path}: the trace holds no requests")
    return requests[:limit] if limit is not None else requests


def write_parquet(requests: list[TraceRequest], path: str | Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "timestamp": [r.timestamp_ms for r in requests],
            "input_length": [r.input_length for r in requests],
            "output_length": [r.output_length for r in requests],
            "hash_ids": [list(r.hash_ids) for r in requests],
        }
    )
    pq.write_table(table, path)


def write_trace(requests: list[TraceRequest], path: str | Path) -> None:
    """Write Parquet for a ``.parquet`` path, Mooncake JSON Lines otherwise (what :func:`read_trace` reads)."""
    path = Path(path)
    if path.suffix == ".parquet":
        write_parquet(requests, path)
        return
    rows = (dict(zip(COLUMNS, (r.timestamp_ms, r.input_length, r.output_length, list(r.hash_ids)))) for r in requests)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def unique_blocks(requests: list[TraceRequest]) -> int:
    return len({h for r in requests for h in r.hash_ids})


def next_uses(trace: Sequence[TraceRequest]) -> list[np.ndarray]:
    """For each request and each of its pages, the index of the next request using that
    page (``inf`` if none): the future that only an offline oracle may see."""
    seen: dict[int, int] = {}
    out: list[np.ndarray] = [np.empty(0)] * len(trace)
    for i in range(len(trace) - 1, -1, -1):
        ids = trace[i].hash_ids
        out[i] = np.array([seen.get(h, np.inf) for h in ids], dtype=np.float64)
        for h in ids:
            seen[h] = i
    return out


def session_end_hints(
    trace: Sequence[TraceRequest], block_tokens: int, futures: Sequence[np.ndarray] | None = None
) -> dict[int, int]:
    """The end-of-session hint of each session's last request, as its client would send it:
    request index -> the depth from which its cacheable pages are its own. A Mooncake trace
    has no session ids, so a session is read from its chain: a request whose last page no
    later request reads ends its session, and its own pages are the tail of its chain that
    no later request reads (the prefix before them is shared with sessions still going).
    ``futures``: :func:`next_uses` of ``trace``, when the caller has it. It is what a client
    that knows this turn is its last, and which part of its prompt is its own, would say
    (RequestInfo.ends_session_from); a cache cannot infer it."""
    futures = next_uses(trace) if futures is None else futures
    hints: dict[int, int] = {}
    for i, (request, future) in enumerate(zip(trace, futures)):
        if not len(future) or future[-1] != np.inf:
            continue
        read_later = np.flatnonzero(future != np.inf)
        own_from = int(read_later[-1]) + 1 if len(read_later) else 0
        if own_from < len(full_blocks(request.hash_ids, request.input_length, block_tokens)):
            hints[i] = own_from
    return hints


def cacheable_pages(requests: Sequence[TraceRequest], block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> int:
    """Distinct full blocks of ``requests`` (:func:`full_blocks`): the most pages a replay of
    them can keep, which a cache must hold for a second replay to find every one of them."""
    return len({h for r in requests for h in full_blocks(r.hash_ids, r.input_length, block_tokens)})
