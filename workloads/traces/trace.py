"""Agent session traces: the format and its validating loader (our JSONL).

Readers of other formats are ``workloads.traces.readers``; which of our models each session uses is
``workloads.traces.assignment``.

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

Sessions may depend on each other, as an agent's subagents do (all optional, checked by
:func:`validate_sessions`; references are ``[session_id, call index]``):
- ``parent_id``: the session that spawned this one; ``start_after``: the call whose end starts
  it (``arrival_s`` then counts from that end, or the later end of its first call's
  ``waits_for``, not from the trace start);
- a call's ``waits_for``: calls of other sessions that must end before it is sent (a parent
  waiting for its subagents); its gap counts from the latest end, its session's previous
  call's included;
- a call's ``prefix_from`` / ``prefix_tokens``: its prompt starts with the first
  ``prefix_tokens`` tokens of that call's prompt + output (default: its session's previous
  call, all of it), the rest new. With either set the prompt need not grow (an agent that
  compacts its context); a ``prefix_from`` in another session must be a call it waits for.
Dependencies form no cycle.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import orjson


class TraceError(ValueError):
    """A trace that breaks the format; the message names where and what."""


@dataclass(frozen=True)
class CallRef:
    session_id: str
    call: int  # index in that session's calls


@dataclass(frozen=True)
class Call:
    input_tokens: int  # the whole prompt of this call
    output_tokens: int
    tool_gap_s: float | None  # time the agent spends in tools after this call; None: last call
    tools: tuple[str, ...] = ()
    waits_for: tuple[CallRef, ...] = ()  # calls of other sessions that must end first
    prefix_from: CallRef | None = None  # whose prompt + output this prompt starts with
    prefix_tokens: int | None = None  # how many of those tokens (None: all that fit)

    @property
    def extends_previous(self) -> bool:
        """Whether the prompt is its session's previous prompt + output + new tokens."""
        return self.prefix_from is None and self.prefix_tokens is None


@dataclass(frozen=True)
class Session:
    session_id: str
    model: str
    calls: tuple[Call, ...]
    arrival_s: float = 0.0
    tags: dict[str, str] = field(default_factory=dict)  # free-form provenance, not validated
    parent_id: str | None = None  # the session that spawned this one (a subagent's)
    start_after: CallRef | None = None  # the call whose end starts this session

    def references(self) -> list[CallRef]:
        """Every call of another session this one depends on."""
        refs = [self.start_after] if self.start_after is not None else []
        for call in self.calls:
            refs += call.waits_for
            if call.prefix_from is not None and call.prefix_from.session_id != self.session_id:
                refs.append(call.prefix_from)
        return refs

    def renamed(self, rename: Callable[[str], str]) -> Session:
        """The session with its id and every session id it names passed through ``rename``."""
        def ref(r: CallRef | None) -> CallRef | None:
            return None if r is None else CallRef(rename(r.session_id), r.call)

        calls = tuple(replace(c, waits_for=tuple(CallRef(rename(r.session_id), r.call) for r in c.waits_for),
                              prefix_from=ref(c.prefix_from)) for c in self.calls)
        return replace(self, session_id=rename(self.session_id), calls=calls, start_after=ref(self.start_after),
                       parent_id=None if self.parent_id is None else rename(self.parent_id))

    def alone(self) -> Session:
        """The session without what ties it to others (for replaying it by itself)."""
        calls = tuple(
            replace(c, waits_for=(), prefix_from=None, prefix_tokens=None)
            if c.prefix_from is not None and c.prefix_from.session_id != self.session_id
            else replace(c, waits_for=()) for c in self.calls)
        return replace(self, calls=calls, start_after=None, parent_id=None)

    @property
    def num_calls(self) -> int:
        return len(self.calls)

    @property
    def total_tool_gap_s(self) -> float:
        return sum(c.tool_gap_s or 0.0 for c in self.calls)


def validate_session(session: Session, where: str = "", gap_field: str = "tool_gap_s") -> None:
    """Raise :class:`TraceError` if ``session`` breaks an invariant of the format.
    ``gap_field``: what the file being read calls a call's tool gap (named in the errors)."""
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
                raise TraceError(f"{at}: {gap_field} is missing (only the last call may omit it)")
        elif not _is_number(gap) or not math.isfinite(gap) or gap < 0:
            raise TraceError(f"{at}: {gap_field} must be a finite number >= 0, got {gap!r}")
        if not all(isinstance(t, str) for t in call.tools):
            raise TraceError(f"{at}: tools must be strings, got {call.tools!r}")
        if call.prefix_tokens is not None and (
                not isinstance(call.prefix_tokens, int) or not 0 <= call.prefix_tokens <= call.input_tokens):
            raise TraceError(f"{at}: prefix_tokens must be in [0, input_tokens], got {call.prefix_tokens!r}")
        if call.prefix_from is not None:
            ref = call.prefix_from
            if ref.session_id == session.session_id and not 0 <= ref.call < k:
                raise TraceError(f"{at}: prefix_from must name an earlier call of its session")
            if ref.session_id != session.session_id and ref not in call.waits_for and not (
                    k == 0 and ref == session.start_after):
                raise TraceError(f"{at}: prefix_from {ref} in another session must be a call it waits for")
        elif k == 0 and call.prefix_tokens is not None:
            raise TraceError(f"{at}: a first call's prefix_tokens needs a prefix_from")
        if k > 0 and call.extends_previous:
            before = session.calls[k - 1].input_tokens
            if call.input_tokens <= before:
                raise TraceError(
                    f"{at}: prompt does not grow: input_tokens {call.input_tokens} <= previous "
                    f"call's {before} (a session's prompt only ever grows)"
                )


def validate_sessions(sessions: Sequence[Session]) -> None:
    seen: dict[str, Session] = {}
    for session in sessions:
        validate_session(session)
        if session.session_id in seen:
            raise TraceError(f"duplicate session_id {session.session_id!r}")
        seen[session.session_id] = session
    for session in sessions:
        for ref in session.references():
            target = seen.get(ref.session_id)
            if target is None or not 0 <= ref.call < target.num_calls:
                raise TraceError(f"session {session.session_id!r} depends on {ref}, which is not in the trace")
        if session.parent_id is not None and session.parent_id not in seen:
            raise TraceError(f"session {session.session_id!r}: parent {session.parent_id!r} is not in the trace")
    _check_acyclic(sessions)


def _check_acyclic(sessions: Sequence[Session]) -> None:
    """Calls must be orderable: each after its session's previous call and what it waits for."""
    deps: dict[CallRef, list[CallRef]] = {}
    for s in sessions:
        for k, call in enumerate(s.calls):
            before = [CallRef(s.session_id, k - 1)] if k else ([s.start_after] if s.start_after else [])
            deps[CallRef(s.session_id, k)] = before + list(call.waits_for)
    state: dict[CallRef, int] = {}  # 1: on the path, 2: done
    for root in deps:
        stack = [(root, iter(deps[root]))]
        state[root] = state.get(root) or 1
        if state[root] == 2:
            continue
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                state[node] = 2
                stack.pop()
            elif state.get(child) == 1:
                raise TraceError(f"dependency cycle through {child}")
            elif state.get(child) is None:
                state[child] = 1
                stack.append((child, iter(deps[child])))


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# --- our JSONL format -----------------------------------------------------------------------
_SESSION_FIELDS = {"session_id", "model", "calls", "arrival_s", "tags", "parent_id", "start_after"}
_CALL_FIELDS = {"input_tokens", "output_tokens", "tool_gap_s", "tools", "waits_for", "prefix_from",
                "prefix_tokens"}


def _call_dict(c: Call) -> dict:
    data: dict = {"input_tokens": c.input_tokens, "output_tokens": c.output_tokens,
                  "tool_gap_s": c.tool_gap_s, "tools": list(c.tools)}
    if c.waits_for:
        data["waits_for"] = [[r.session_id, r.call] for r in c.waits_for]
    if c.prefix_from is not None:
        data["prefix_from"] = [c.prefix_from.session_id, c.prefix_from.call]
    if c.prefix_tokens is not None:
        data["prefix_tokens"] = c.prefix_tokens
    return data


def _ref(raw: object, at: str) -> CallRef:
    if (not isinstance(raw, list) or len(raw) != 2 or not isinstance(raw[0], str)
            or not isinstance(raw[1], int) or isinstance(raw[1], bool)):
        raise TraceError(f"{at}: a call reference must be [session_id, call index], got {raw!r}")
    return CallRef(raw[0], raw[1])


def session_to_dict(session: Session) -> dict:
    data: dict = {
        "session_id": session.session_id,
        "model": session.model,
        "arrival_s": session.arrival_s,
        "calls": [_call_dict(c) for c in session.calls],
    }
    if session.tags:
        data["tags"] = dict(session.tags)
    if session.parent_id is not None:
        data["parent_id"] = session.parent_id
    if session.start_after is not None:
        data["start_after"] = [session.start_after.session_id, session.start_after.call]
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
        waits = raw.get("waits_for") or []
        if not isinstance(waits, list):
            raise TraceError(f"{at}: waits_for must be a list of call references")
        prefix_from = raw.get("prefix_from")
        calls.append(
            Call(
                input_tokens=raw["input_tokens"],
                output_tokens=raw["output_tokens"],
                tool_gap_s=raw.get("tool_gap_s"),
                tools=tuple(tools),
                waits_for=tuple(_ref(r, at) for r in waits),
                prefix_from=None if prefix_from is None else _ref(prefix_from, at),
                prefix_tokens=raw.get("prefix_tokens"),
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
        parent_id=data.get("parent_id"),
        start_after=None if data.get("start_after") is None else _ref(data["start_after"], where),
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
