"""Agent session traces: the format and its validating loader (our JSONL).

Readers of other formats are ``workloads.readers``; which of our models each session uses is
``workloads.assignment``.

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

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import orjson


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
