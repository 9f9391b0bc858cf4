"""Which session a request belongs to, read from what coding agents already send.

Sources, first found wins (header names are case-insensitive; the lists are configurable):
1. ``X-Session-ID`` (also OpenCode's ``x-session-id``) or the body's ``session_id``: they must
   agree when both are sent;
2. Talaria's and Dynamo's ``x-talaria-session-id`` / ``x-dynamo-session-id``;
3. Claude Code: ``x-claude-code-agent-id`` (a subagent) else ``x-claude-code-session-id``;
4. Codex: ``session-id`` (older builds: ``session_id``);
5. OpenCode's ``x-session-affinity``;
6. the body's weaker hint: Claude Code's ``metadata.user_id`` on the Messages API.

A subagent's parent: ``x-talaria-parent-session-id``, ``x-dynamo-parent-session-id``,
``x-claude-code-parent-agent-id``, OpenCode's ``x-parent-session-id``; a Claude Code subagent
with none of these is a child of its Claude Code session. Agent ids are scoped by their
session (``<session>:<agent>``), so two sessions' "agent-1" never meet. The end of a session:
``x-talaria-session-final`` / ``x-dynamo-session-final: true``, or the body's
``talaria.last_call``. No source: the session is None (the router infers one or treats the
call as a session of one).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from router.limits import check_session_id
from talaria.protocol.errors import bad_request

__all__ = ["SessionHeaders", "SessionIdentity", "resolve_session"]


@dataclass(frozen=True)
class SessionHeaders:
    """Header names that carry a session, its parent and its end, in precedence order
    (case-insensitive, kept in lowercase).
    ``scoped``: headers whose value is only unique within another header's (agent ids within
    their session): the value read is ``<scope>:<value>`` when the scope header is sent."""

    session: tuple[str, ...] = (
        "x-session-id", "x-talaria-session-id", "x-dynamo-session-id",
        "x-claude-code-agent-id", "x-claude-code-session-id",
        "session-id", "session_id", "x-session-affinity",
    )
    parent: tuple[str, ...] = (
        "x-talaria-parent-session-id", "x-dynamo-parent-session-id",
        "x-claude-code-parent-agent-id", "x-parent-session-id",
    )
    final: tuple[str, ...] = ("x-talaria-session-final", "x-dynamo-session-final")
    scoped: tuple[tuple[str, str], ...] = (
        ("x-claude-code-agent-id", "x-claude-code-session-id"),
        ("x-claude-code-parent-agent-id", "x-claude-code-session-id"),
    )
    explicit: str = "x-session-id"  # the header that must agree with the body's session_id

    def __post_init__(self) -> None:
        # Header names are case-insensitive: kept in lowercase, so the scoping rules and the
        # explicit header match a name however the configuration spells it.
        for name in ("session", "parent", "final"):
            object.__setattr__(self, name, _lower(getattr(self, name)))
        object.__setattr__(self, "scoped", tuple(_lower(pair) for pair in self.scoped))
        object.__setattr__(self, "explicit", self.explicit.lower())
        for name in (*self.session, *self.parent, *self.final, *(h for pair in self.scoped for h in pair)):
            if not name or name != name.strip() or ":" in name:
                raise ValueError(f"bad session header name {name!r}")
        if not self.session:
            raise ValueError("SessionHeaders.session needs at least one header")


@dataclass(frozen=True)
class SessionIdentity:
    session_id: str | None  # None: nothing names the session
    parent_id: str | None = None
    final: bool = False  # the session ends with this call
    source: str = ""  # the header or body field the session came from


def resolve_session(
    headers: Mapping[str, str],
    body_session_id: str | None = None,
    body_hint: str | None = None,
    last_call: bool = False,
    names: SessionHeaders | None = None,
    max_chars: int = 256,
) -> SessionIdentity:
    """The session a request names. ``headers``: case-insensitive (aiohttp's CIMultiDict);
    ``body_session_id``: the body's ``session_id``; ``body_hint``: a weaker body source
    (Anthropic ``metadata.user_id``); ``last_call``: the body's session-final hint. Every id
    read is checked (``router.limits.check_session_id``: at most ``max_chars`` printable
    ASCII characters; 400 otherwise)."""
    names = names or SessionHeaders()
    checked = _Checker(max_chars)
    final = last_call or any(_flag(headers, h) for h in names.final)
    explicit = checked.header(headers, names.explicit, names) if names.explicit in names.session else None
    if explicit and body_session_id and explicit != body_session_id:
        raise bad_request(f"the {names.explicit} header and the session_id field disagree", "session_id")
    if body_session_id:
        return SessionIdentity(checked(body_session_id, "session_id"),
                               checked.parent(headers, names, None), final, "session_id")
    for header in names.session:
        value = checked.header(headers, header, names)
        if value:
            return SessionIdentity(value, checked.parent(headers, names, header), final, header)
    if body_hint:
        return SessionIdentity(checked(body_hint, "metadata.user_id"), None, final, "metadata.user_id")
    return SessionIdentity(None, checked.parent(headers, names, None), final, "")


class _Checker:
    """Reads ids from headers, each checked against one bound."""

    def __init__(self, max_chars: int) -> None:
        self.max_chars = max_chars

    def __call__(self, value: str, source: str) -> str:
        if not value:
            raise bad_request(f"the session id in {source} is empty", source)
        return check_session_id(value, self.max_chars, source)

    def parent(self, headers: Mapping[str, str], names: SessionHeaders, source: str | None) -> str | None:
        for header in names.parent:
            value = self.header(headers, header, names)
            if value:
                return value
        scope = dict(names.scoped).get(source or "")
        return self.header(headers, scope, names) if scope else None  # a subagent's parent: its session

    def header(self, headers: Mapping[str, str], name: str, names: SessionHeaders) -> str | None:
        raw = headers.get(name)
        if raw is None:
            return None
        value = self(raw.strip(), name)
        scope = dict(names.scoped).get(name)
        scope_value = headers.get(scope, "").strip() if scope else ""
        return f"{self(scope_value, scope or name)}:{value}" if scope_value else value


def _lower(names: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(n.lower() if isinstance(n, str) else n for n in names)


def _flag(headers: Mapping[str, str], name: str) -> bool:
    raw = headers.get(name)
    if raw is None:
        return False
    value = raw.strip().lower()
    if value in ("true", "1", "yes"):
        return True
    if value in ("false", "0", "no", ""):
        return False
    raise bad_request(f"the {name} header must be true or false, got {raw!r}", name)
