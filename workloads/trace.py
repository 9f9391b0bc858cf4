"""Agent session traces: the format, a validating loader, readers for other formats.

Our format is JSONL, one session per line::

    {"session_id": "swe-000", "model": "qwen3-235b-a22b", "arrival_s": 0.0,
     "calls": [{"input_tokens": 13600, "output_tokens": 113, "tool_gap_s": 0.05,
                "tools": ["Read"]}, ...]}

Invariants a valid session holds (the loader checks them and names the offending line, session,
call and field):
- every call has ``input_tokens >= 1`` and ``output_tokens >= 1``;
- the prompt grows: ``calls[k+1].input_tokens > calls[k].input_tokens`` (each call's prompt
  starts with the previous call's prompt and output);
- every call but the last has a tool gap ``tool_gap_s >= 0`` (seconds from the end of the call
  to the agent sending the next one); the last call's gap may be ``None``;
- ``arrival_s >= 0`` is when the session's first call is sent, relative to the trace start.
"""

from __future__ import annotations

import csv
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import orjson

REAL_TRACE_PATH = Path("/work/shared/traces/swe-claude-code.jsonl")


class TraceError(ValueError):
    """A trace that breaks the format; the message names where and what."""


@dataclass(frozen=True)
class Call:
    input_tokens: int  # the whole prompt of this call
    output_tokens: int
    tool_gap_s: float | None  # time the agent spends in tools after this call; None: last call
    tools: tuple[str, ...] = ()


@dataclass(frozen=True)
class Session:
    session_id: str
    model: str
    calls: tuple[Call, ...]
    arrival_s: float = 0.0
    tags: dict[str, str] = field(default_factory=dict)  # free-form provenance, not validated

    @property
    def num_calls(self) -> int:
        return len(self.calls)

    @property
    def total_tool_gap_s(self) -> float:
        return sum(c.tool_gap_s or 0.0 for c in self.calls)


def validate_session(session: Session, where: str = "") -> None:
    """Raise :class:`TraceError` if ``session`` breaks an invariant of the format."""
    prefix = f"{where}session {session.session_id!r}"
    if not isinstance(session.session_id, str) or not session.session_id:
        raise TraceError(f"{where}session_id must be a non-empty string")
    if not isinstance(session.model, str) or not session.model:
        raise TraceError(f"{prefix}: model must be a non-empty string")
    if not _is_number(session.arrival_s) or session.arrival_s < 0 or not math.isfinite(
        session.arrival_s
    ):
        raise TraceError(f"{prefix}: arrival_s must be a finite number >= 0, got {session.arrival_s!r}")
    if not session.calls:
        raise TraceError(f"{prefix}: has no calls")
    last = len(session.calls) - 1
    for k, call in enumerate(session.calls):
        at = f"{prefix} call {k}"
        for name in ("input_tokens", "output_tokens"):
            value = getattr(call, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TraceError(f"{at}: {name} must be an integer, got {value!r}")
            if value < 1:
                raise TraceError(f"{at}: {name} must be >= 1, got {value}")
        gap = call.tool_gap_s
        if gap is None:
            if k != last:
                raise TraceError(f"{at}: tool_gap_s is missing (only the last call may omit it)")
        elif not _is_number(gap) or not math.isfinite(gap) or gap < 0:
            raise TraceError(f"{at}: tool_gap_s must be a finite number >= 0, got {gap!r}")
        if not all(isinstance(t, str) for t in call.tools):
            raise TraceError(f"{at}: tools must be strings, got {call.tools!r}")
        if k > 0:
            before = session.calls[k - 1].input_tokens
            if call.input_tokens <= before:
                raise TraceError(
                    f"{at}: prompt does not grow: input_tokens {call.input_tokens} <= previous "
                    f"call's {before} (a session's prompt only ever grows)"
                )


def validate_sessions(sessions: Sequence[Session]) -> None:
    seen: set[str] = set()
    for session in sessions:
        validate_session(session)
        if session.session_id in seen:
            raise TraceError(f"duplicate session_id {session.session_id!r}")
        seen.add(session.session_id)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# --- our JSONL format -----------------------------------------------------------------------
_SESSION_FIELDS = {"session_id", "model", "calls", "arrival_s", "tags"}
_CALL_FIELDS = {"input_tokens", "output_tokens", "tool_gap_s", "tools"}


def session_to_dict(session: Session) -> dict:
    data: dict = {
        "session_id": session.session_id,
        "model": session.model,
        "arrival_s": session.arrival_s,
        "calls": [
            {
                "input_tokens": c.input_tokens,
                "output_tokens": c.output_tokens,
                "tool_gap_s": c.tool_gap_s,
                "tools": list(c.tools),
            }
            for c in session.calls
        ],
    }
    if session.tags:
        data["tags"] = dict(session.tags)
    return data


def session_from_dict(data: object, where: str = "") -> Session:
    """Build and validate a session from its JSON object."""
    if not isinstance(data, dict):
        raise TraceError(f"{where}a session must be a JSON object, got {type(data).__name__}")
    missing = sorted({"session_id", "model", "calls"} - set(data))
    if missing:
        raise TraceError(f"{where}session is missing field(s) {', '.join(missing)}")
    unknown = sorted(set(data) - _SESSION_FIELDS)
    if unknown:
        raise TraceError(f"{where}session {data['session_id']!r} has unknown field(s) {unknown}")
    if not isinstance(data["calls"], list):
        raise TraceError(f"{where}session {data['session_id']!r}: calls must be a list")
    calls = []
    for k, raw in enumerate(data["calls"]):
        at = f"{where}session {data['session_id']!r} call {k}"
        if not isinstance(raw, dict):
            raise TraceError(f"{at}: a call must be a JSON object")
        missing = sorted({"input_tokens", "output_tokens"} - set(raw))
        if missing:
            raise TraceError(f"{at}: missing field(s) {', '.join(missing)}")
        unknown = sorted(set(raw) - _CALL_FIELDS)
        if unknown:
            raise TraceError(f"{at}: unknown field(s) {unknown}")
        tools = raw.get("tools") or []
        if not isinstance(tools, list):
            raise TraceError(f"{at}: tools must be a list of strings")
        calls.append(
            Call(
                input_tokens=raw["input_tokens"],
                output_tokens=raw["output_tokens"],
                tool_gap_s=raw.get("tool_gap_s"),
                tools=tuple(tools),
            )
        )
    tags = data.get("tags") or {}
    if not isinstance(tags, dict):
        raise TraceError(f"{where}session {data['session_id']!r}: tags must be an object")
    session = Session(
        session_id=data["session_id"],
        model=data["model"],
        calls=tuple(calls),
        arrival_s=data.get("arrival_s", 0.0),
        tags={str(k): str(v) for k, v in tags.items()},
    )
    validate_session(session, where)
    return session


def dumps_trace(sessions: Iterable[Session]) -> bytes:
    return b"".join(orjson.dumps(session_to_dict(s)) + b"\n" for s in sessions)


def loads_trace(text: bytes | str, source: str = "<trace>") -> list[Session]:
    if isinstance(text, str):
        text = text.encode()
    sessions = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{source}:{lineno}: "
        try:
            data = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise TraceError(f"{where}not valid JSON ({exc})") from None
        sessions.append(session_from_dict(data, where))
    if not sessions:
        raise TraceError(f"{source}: trace holds no sessions")
    validate_sessions(sessions)
    return sessions


def save_trace(sessions: Sequence[Session], path: str | Path) -> None:
    validate_sessions(sessions)
    Path(path).write_bytes(dumps_trace(sessions))


def load_trace(path: str | Path) -> list[Session]:
    """Load and validate a trace in our JSONL format."""
    path = Path(path)
    return loads_trace(path.read_bytes(), source=str(path))


# --- other formats --------------------------------------------------------------------------
def read_real_trace(path: str | Path = REAL_TRACE_PATH) -> list[Session]:
    """Read the shared real trace (``swe-claude-code.jsonl``: per-session ``calls`` with
    ``input_tokens``, ``output_tokens``, ``gap_s``, ``tools``). Sessions keep the model the agent
    used (not one of ours; see :func:`assign_models`) and all start at 0. A session id that
    repeats (several attempts of one task) gets a ``#2``, ``#3``, ... suffix."""
    path = Path(path)
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
        validate_session(session, where)
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
            gap = None if wait == "" else _csv_float(row, "tool_wait_after_ms", where) / 1000.0
            call = Call(
                input_tokens=prefix + _csv_int(row, "input_len", where),
                output_tokens=_csv_int(row, "output_len", where),
                tool_gap_s=gap,
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
        validate_session(session, f"{path}: ")
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


# --- models ---------------------------------------------------------------------------------
def popularity_weights(num_models: int, skew: float) -> list[float]:
    """Zipf-like popularity: model i (0-based) gets weight 1 / (i + 1) ** skew, normalised.
    ``skew = 0`` is uniform."""
    if num_models < 1:
        raise ValueError("need at least one model")
    if skew < 0 or not math.isfinite(skew):
        raise ValueError(f"skew must be a finite number >= 0, got {skew}")
    raw = [1.0 / (i + 1) ** skew for i in range(num_models)]
    total = sum(raw)
    return [w / total for w in raw]


def apportion(total: int, weights: Sequence[float]) -> list[int]:
    """Split ``total`` into integer counts proportional to ``weights`` (largest remainder)."""
    if total < 0:
        raise ValueError("total must be >= 0")
    if not weights or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError("weights must be non-negative and not all zero")
    norm = sum(weights)
    exact = [total * w / norm for w in weights]
    counts = [math.floor(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (counts[i] - exact[i], i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


def assign_models(
    sessions: Sequence[Session], models: Sequence[str], skew: float = 1.0, seed: int = 0
) -> list[Session]:
    """Give each session one of ``models`` (first = most popular). Session counts per model are
    the Zipf-like shares of :func:`popularity_weights` rounded by largest remainder, so the skew
    is exact; which session gets which model is a seeded shuffle. Order is kept."""
    if not models:
        raise ValueError("assign_models needs at least one model")
    if len(set(models)) != len(models):
        raise ValueError(f"models must be distinct, got {list(models)}")
    counts = apportion(len(sessions), popularity_weights(len(models), skew))
    labels = [m for m, n in zip(models, counts, strict=True) for _ in range(n)]
    random.Random(seed).shuffle(labels)
    return [replace(s, model=m) for s, m in zip(sessions, labels, strict=True)]
