"""Reader of Mooncake-format traces with sessions: the agentic JSONL of Dynamo's agent capture.

One JSON object per request::

    {"request_id": "r2", "session_id": "root", "input_length": 192, "output_length": 20,
     "hash_ids": [0, 1, 3], "timestamp": 500.0, "delay": 100.0, "tool_wait_ms": 100.0,
     "wait_for": ["r1", "c1"]}

(``input_tokens`` / ``output_tokens``, ``created_time`` and ``delay_ms`` are accepted for
``input_length``, ``output_length``, ``timestamp`` and ``delay``; ``branches``,
``prefix_reset``, ``tool_events`` and the rest are metadata and ignored.) Times are ms.

How rows become :class:`~workloads.traces.trace.Session` s:
- rows of one ``session_id`` are its calls, in ``timestamp`` order (file order without
  timestamps); each call waits for its session's previous one, then ``delay + tool_wait_ms``;
- a session whose first row waits for another session's row is a child (a subagent): it starts
  ``delay + tool_wait_ms`` after that row ends (``start_after``), its ``parent_id`` that row's
  session; a row that waits for rows of other sessions (a parent joining its subagents) waits
  for them too (``waits_for``), so children run beside their parents as recorded;
- a root session's first call starts at its ``timestamp`` relative to the earliest root;
- ``hash_ids`` (ids of the prompt's blocks; equal leading ids = equal prefix) give the shared
  prefix: a prompt keeping all of its session's previous prompt's full blocks extends it
  (previous prompt + output + new tokens, as the replay builds prompts); one that keeps fewer
  (context compaction) keeps ``shared blocks x block size`` tokens; a child's first prompt
  starts with the blocks it shares with the parent row it starts after. The block size is
  the one every row's ``len(hash_ids) == ceil(input_length / block_size)`` agrees on.
Sessions get the model ``MODEL`` (none is recorded); ``talaria replay`` assigns catalog models,
a child its parent's. Rows without ``session_id`` (the original Mooncake traces) are refused:
a closed-loop replay needs sessions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from router.instances.placement import common_prefix_len
from workloads.traces.trace import Call, CallRef, Session, TraceError, validate_sessions

__all__ = ["MODEL", "is_mooncake", "read_mooncake_trace", "infer_block_size"]

MODEL = "mooncake"
BLOCK_SIZES = (16, 32, 64, 128, 256, 512, 1024)


@dataclass
class _Row:
    line: int
    request_id: str
    session_id: str
    input_tokens: int
    output_tokens: int
    hash_ids: list[int] | None
    timestamp_ms: float | None
    gap_ms: float  # delay + tool_wait_ms: the wait after the row's dependencies end
    wait_for: list[str] = field(default_factory=list)


def is_mooncake(first_line: bytes) -> bool:
    """Whether a JSONL trace's first line is a Mooncake row."""
    return any(k in first_line for k in (b'"input_length"', b'"hash_ids"', b'"wait_for"'))


def read_mooncake_trace(path: str | Path, block_size: int | None = None) -> list[Session]:
    """Read an agentic (or sessioned) Mooncake JSONL trace; ``block_size``: of ``hash_ids``
    (None: inferred from the rows)."""
    path = Path(path)
    rows = [_row(line, lineno, path) for lineno, line in enumerate(path.read_bytes().splitlines(), 1)
            if line.strip()]
    if not rows:
        raise TraceError(f"{path}: trace holds no rows")
    where: dict[str, tuple[str, int]] = {}
    by_session: dict[str, list[_Row]] = {}
    for row in rows:
        if row.request_id in where:
            raise TraceError(f"{path}:{row.line}: duplicate request_id {row.request_id!r}")
        by_session.setdefault(row.session_id, []).append(row)
        where[row.request_id] = (row.session_id, -1)
    for sid, srows in by_session.items():
        if all(r.timestamp_ms is not None for r in srows):
            srows.sort(key=lambda r: r.timestamp_ms)  # stable: ties keep file order
        for k, r in enumerate(srows):
            where[r.request_id] = (sid, k)
    bs = block_size or infer_block_size(rows, path)
    roots = [srows[0].timestamp_ms for srows in by_session.values()
             if not _outside(srows[0], srows[0].session_id, where, path)]
    t0 = min((t for t in roots if t is not None), default=0.0)
    sessions = [_session(sid, srows, where, bs, t0, by_session, path) for sid, srows in by_session.items()]
    validate_sessions(sessions)
    return sessions


def infer_block_size(rows: list[_Row], path: Path) -> int:
    with_ids = [r for r in rows if r.hash_ids]
    if not with_ids:
        return BLOCK_SIZES[0]  # unused: no row shares blocks
    fits = [bs for bs in BLOCK_SIZES if all(len(r.hash_ids or ()) == math.ceil(r.input_tokens / bs)
                                            for r in with_ids)]
    if not fits:
        raise TraceError(f"{path}: no block size in {BLOCK_SIZES} gives every row "
                         "len(hash_ids) == ceil(input_length / block_size); pass the trace's block size")
    return fits[-1]


def _row(line: bytes, lineno: int, path: Path) -> _Row:
    at = f"{path}:{lineno}"
    try:
        data = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise TraceError(f"{at}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise TraceError(f"{at}: a row must be a JSON object")
    sid = data.get("session_id")
    if not isinstance(sid, str) or not sid:
        raise TraceError(f"{at}: no session_id (the original Mooncake format has no sessions; a "
                         "closed-loop replay needs them)")
    hash_ids = data.get("hash_ids")
    if hash_ids is not None and (not isinstance(hash_ids, list) or not all(_is_int(h) for h in hash_ids)):
        raise TraceError(f"{at}: hash_ids must be a list of integers")
    wait_for = data.get("wait_for") or []
    if not isinstance(wait_for, list) or not all(isinstance(w, str) for w in wait_for):
        raise TraceError(f"{at}: wait_for must be a list of request ids")
    request_id = data.get("request_id", f"{sid}#line{lineno}")
    if not isinstance(request_id, str) or not request_id:
        raise TraceError(f"{at}: request_id must be a non-empty string")
    return _Row(
        line=lineno, request_id=request_id, session_id=sid,
        input_tokens=_count(data, ("input_length", "input_tokens"), at),
        output_tokens=_count(data, ("output_length", "output_tokens"), at),
        hash_ids=hash_ids,
        timestamp_ms=_ms(data, ("timestamp", "created_time"), at),
        gap_ms=(_ms(data, ("delay", "delay_ms"), at) or 0.0) + (_ms(data, ("tool_wait_ms",), at) or 0.0),
        wait_for=wait_for,
    )


def _count(data: dict[str, Any], names: tuple[str, ...], at: str) -> int:
    value = next((data[n] for n in names if n in data), None)
    if not _is_int(value) or value < 1:
        raise TraceError(f"{at}: {names[0]} must be an integer >= 1, got {value!r}")
    return value


def _ms(data: dict[str, Any], names: tuple[str, ...], at: str) -> float | None:
    value = next((data[n] for n in names if data.get(n) is not None), None)
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise TraceError(f"{at}: {names[0]} must be a number of ms >= 0, got {value!r}")
    return float(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _outside(row: _Row, sid: str, where: dict[str, tuple[str, int]], path: Path) -> list[CallRef]:
    """The rows of other sessions ``row`` waits for."""
    refs = []
    for rid in row.wait_for:
        if rid not in where:
            raise TraceError(f"{path}:{row.line}: wait_for names unknown request {rid!r}")
        other, k = where[rid]
        if other != sid:
            refs.append(CallRef(other, k))
    return refs


def _session(
    sid: str, rows: list[_Row], where: dict[str, tuple[str, int]], bs: int, t0: float,
    by_session: dict[str, list[_Row]], path: Path,
) -> Session:
    calls: list[Call] = []
    start_after: CallRef | None = None
    for k, row in enumerate(rows):
        outside = _outside(row, sid, where, path)
        for rid in row.wait_for:
            if where[rid][0] == sid and where[rid][1] >= k:
                raise TraceError(f"{path}:{row.line}: waits for {rid!r}, a later row of its own session")
        prefix_from, prefix_tokens = None, None
        if k == 0 and outside:
            start_after, outside = outside[0], outside[1:]
            parent_row = by_session[start_after.session_id][start_after.call]
            shared = common_prefix_len(row.hash_ids or (), parent_row.hash_ids or ())
            if shared:
                prefix_from, prefix_tokens = start_after, min(shared * bs, row.input_tokens)
        elif k > 0:
            prev = rows[k - 1]
            shared = common_prefix_len(row.hash_ids or (), prev.hash_ids or ())
            keeps_all = row.hash_ids is None or shared >= prev.input_tokens // bs
            if not (keeps_all and row.input_tokens > prev.input_tokens):
                prefix_tokens = min(shared * bs, row.input_tokens, prev.input_tokens + prev.output_tokens)
        gap = rows[k + 1].gap_ms / 1000.0 if k + 1 < len(rows) else None
        calls.append(Call(row.input_tokens, row.output_tokens, gap, waits_for=tuple(outside),
                          prefix_from=prefix_from, prefix_tokens=prefix_tokens))
    first = rows[0]
    if start_after is not None:
        arrival = first.gap_ms / 1000.0
    else:
        arrival = ((first.timestamp_ms or t0) - t0) / 1000.0
    return Session(session_id=sid, model=MODEL, calls=tuple(calls), arrival_s=arrival,
                   parent_id=start_after.session_id if start_after else None, start_after=start_after,
                   tags={"source": "mooncake"})
