"""Readers of session traces in formats other than ours, into ``workloads.traces.trace.Session``.

- the shared real trace (``swe-claude-code.jsonl``: per-session ``calls`` with ``gap_s``);
- CSV (``session_id,round_idx,prefix_len,input_len,output_len,tool_wait_after_ms``);
- Mooncake JSONL with sessions (Dynamo's agentic traces): ``workloads.traces.mooncake``;
``load_any_trace`` picks the reader from the file. The real trace ships in
``workloads/data/traces/`` (with its source and licence) unless ``TALARIA_REAL_TRACE`` points
elsewhere.
"""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path

import orjson

from workloads.traces.mooncake import is_mooncake, read_mooncake_trace
from workloads.traces.trace import (
    Call,
    Session,
    TraceError,
    load_trace,
    validate_session,
    validate_sessions,
)

__all__ = ["CSV_COLUMNS", "TRACES_DIR", "load_any_trace", "read_csv_trace", "read_real_trace",
           "real_trace_path"]

REAL_TRACE_NAME = "swe-claude-code.jsonl"


TRACES_DIR = Path(__file__).resolve().parents[1] / "data" / "traces"


def real_trace_path() -> Path:
    """Where the real trace is: ``$TALARIA_REAL_TRACE``, else the copy shipped in
    ``workloads/data/traces/``."""
    env = os.environ.get("TALARIA_REAL_TRACE")
    if env:
        return Path(env)
    return TRACES_DIR / REAL_TRACE_NAME


def load_any_trace(path: str | Path) -> list[Session]:
    """Our JSONL, the shared real-trace JSONL (calls with ``gap_s``), a Mooncake JSONL with
    sessions (Dynamo's agentic traces, ``workloads.traces.mooncake``) or a CSV trace."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"trace file {path} does not exist")
    if not path.is_file():
        raise ValueError(f"trace {path} is not a file")
    if path.suffix.lower() == ".csv":
        return read_csv_trace(path)
    with path.open("rb") as f:
        first = f.readline()
    if b'"gap_s"' in first and b'"tool_gap_s"' not in first:
        return read_real_trace(path)
    if is_mooncake(first):
        return read_mooncake_trace(path)
    return load_trace(path)


def read_real_trace(path: str | Path | None = None) -> list[Session]:
    """Read the shared real trace (``swe-claude-code.jsonl``: per-session ``calls`` with
    ``input_tokens``, ``output_tokens``, ``gap_s``, ``tools``). Sessions keep the model the agent
    used (not one of ours; see ``workloads.traces.assignment``) and all start at 0. A session id
    that repeats (several attempts of one task) gets a ``#2``, ``#3``, ... suffix. ``path``
    None: :func:`real_trace_path`."""
    path = Path(path) if path is not None else real_trace_path()
    sessions = []
    seen: dict[str, int] = {}
    for lineno, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}: "
        raw = orjson.loads(line)
        try:
            calls = tuple(
                Call(
                    input_tokens=c["input_tokens"],
                    output_tokens=c["output_tokens"],
                    tool_gap_s=c["gap_s"],
                    tools=tuple(c.get("tools") or ()),
                )
                for c in raw["calls"]
            )
            sid = raw["session_id"]
            seen[sid] = seen.get(sid, 0) + 1
            session = Session(
                session_id=sid if seen[sid] == 1 else f"{sid}#{seen[sid]}",
                model=raw["model"],
                calls=calls,
                tags={"source": str(raw.get("source", "")), "instance": str(raw.get("instance", ""))},
            )
        except KeyError as exc:
            raise TraceError(f"{where}missing field {exc.args[0]!r}") from None
        validate_session(session, where, gap_field="gap_s")
        sessions.append(session)
    validate_sessions(sessions)
    return sessions


CSV_COLUMNS = ("session_id", "round_idx", "prefix_len", "input_len", "output_len",
               "tool_wait_after_ms")


def read_csv_trace(path: str | Path, model: str = "unknown") -> list[Session]:
    """Read a CSV trace with columns ``session_id,round_idx,prefix_len,input_len,output_len,
    tool_wait_after_ms`` (an optional ``model`` column overrides ``model``).

    A round's prompt is ``prefix_len`` tokens reused from the session's earlier rounds plus
    ``input_len`` new tokens, so ``input_tokens = prefix_len + input_len``. Rounds are ordered by
    ``round_idx``, which must run 0, 1, 2, ... per session; an empty ``tool_wait_after_ms`` is
    allowed on the last round only. Sessions keep the order of their first row.
    """
    path = Path(path)
    rows: dict[str, list[tuple[int, int, Call, str]]] = {}
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in CSV_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise TraceError(f"{path}: missing column(s) {', '.join(missing)}")
        for lineno, row in enumerate(reader, start=2):
            where = f"{path}:{lineno}"
            prefix = _csv_int(row, "prefix_len", where)
            if prefix < 0:
                raise TraceError(f"{where}: prefix_len must be >= 0, got {prefix}")
            wait = row["tool_wait_after_ms"].strip()
            gap_ms = None if wait == "" else _csv_float(row, "tool_wait_after_ms", where)
            if gap_ms is not None and not (math.isfinite(gap_ms) and gap_ms >= 0):
                raise TraceError(f"{where}: tool_wait_after_ms must be a finite number >= 0, "
                                 f"got {wait!r}")
            call = Call(
                input_tokens=prefix + _csv_int(row, "input_len", where),
                output_tokens=_csv_int(row, "output_len", where),
                tool_gap_s=None if gap_ms is None else gap_ms / 1000.0,
            )
            sid = row["session_id"].strip()
            if not sid:
                raise TraceError(f"{where}: empty session_id")
            row_model = (row.get("model") or "").strip() or model
            rows.setdefault(sid, []).append((_csv_int(row, "round_idx", where), lineno, call, row_model))
    sessions = []
    for sid, entries in rows.items():
        entries.sort(key=lambda e: e[0])
        for expected, (idx, lineno, _, _) in enumerate(entries):
            if idx != expected:
                raise TraceError(
                    f"{path}:{lineno}: session {sid!r} round_idx {idx} where {expected} was expected"
                    " (rounds must run 0, 1, 2, ... without gaps or repeats)"
                )
        models = {e[3] for e in entries}
        if len(models) > 1:
            raise TraceError(f"{path}: session {sid!r} names several models {sorted(models)}")
        session = Session(session_id=sid, model=models.pop(), calls=tuple(e[2] for e in entries))
        validate_session(session, f"{path}: ", gap_field="tool_wait_after_ms")
        sessions.append(session)
    if not sessions:
        raise TraceError(f"{path}: trace holds no sessions")
    return sessions


def _csv_int(row: dict[str, str], name: str, where: str) -> int:
    try:
        return int(row[name])
    except (TypeError, ValueError):
        raise TraceError(f"{where}: {name} must be an integer, got {row[name]!r}") from None


def _csv_float(row: dict[str, str], name: str, where: str) -> float:
    try:
        return float(row[name])
    except (TypeError, ValueError):
        raise TraceError(f"{where}: {name} must be a number, got {row[name]!r}") from None
