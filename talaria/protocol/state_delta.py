"""The state poll as a delta: the router names the version of the instance's sessions it
holds, the instance answers with what changed since, and tells it which sessions to forget.

The ask (``POST /internal/v1/state``, :class:`StateAsk`): ``{"epoch", "since", "forget",
"release"}``, the report's epoch and version the poller last applied (null: none), the
sessions the router no longer holds and, optional, those whose soft reservation alone goes
(their calls went elsewhere; at most ``MAX_FORGET`` of each a poll). The answer is an ``InstanceState``
whose ``sessions`` holds only the sessions changed since, with four more fields:
``sessions_epoch``, ``sessions_version``, ``sessions_full`` (true: ``sessions`` is the whole
table; the poller drops what it held) and ``sessions_removed`` (ids gone since). A poller
that missed nothing gets a few entries a poll however many sessions the instance holds; the
whole table comes on the first poll, after the instance restarted, or when the poller fell
behind what the instance remembers of removals. :class:`SessionsCursor` is the poller's side
(an answer without those fields is a whole table, as a plain ``GET`` gives).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import orjson

from talaria.protocol.fields import boolean, check_keys, integer, printable_id
from talaria.protocol.messages import InstanceState, SessionKV

__all__ = [
    "MAX_FORGET", "SessionsCursor", "SessionsDelta", "StateAsk", "encode_report", "parse_report",
]

MAX_FORGET = 4096


@dataclass
class SessionsDelta:
    epoch: str
    version: int
    full: bool
    sessions: dict[str, SessionKV]
    removed: list[str] = field(default_factory=list)


@dataclass
class StateAsk:
    epoch: str | None = None
    since: int | None = None
    forget: list[str] = field(default_factory=list)
    release: list[str] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: Any) -> StateAsk:
        if not isinstance(data, dict):
            raise ValueError("a state ask must be a JSON object")
        check_keys(data, ("epoch", "since", "forget", "release"), "the state ask")
        epoch, since = data.get("epoch"), data.get("since")
        return cls(
            epoch=None if epoch is None else printable_id(epoch, "epoch"),
            since=None if since is None else integer(since, "since", lo=0),
            forget=_session_ids(data.get("forget"), "forget"),
            release=_session_ids(data.get("release"), "release"),
        )


def _session_ids(value: Any, name: str) -> list[str]:
    ids = value or []
    if not isinstance(ids, list) or len(ids) > MAX_FORGET:
        raise ValueError(f"{name} must be a list of at most {MAX_FORGET} session ids")
    return [printable_id(s, f"{name}[]") for s in ids]


def encode_report(state: InstanceState, delta: SessionsDelta) -> bytes:
    """The answer to a state ask: ``state`` with ``delta``'s sessions and fields."""
    data = dataclasses.asdict(dataclasses.replace(state, sessions={}))
    data["sessions"] = delta.sessions
    data["sessions_epoch"] = delta.epoch
    data["sessions_version"] = delta.version
    data["sessions_full"] = delta.full
    data["sessions_removed"] = delta.removed
    return orjson.dumps(data)


class SessionsCursor:
    """The poller's copy of one instance's sessions, kept up to date by deltas."""

    def __init__(self) -> None:
        self.epoch: str | None = None
        self.version: int | None = None
        self.sessions: dict[str, SessionKV] = {}

    def ask(self, forget: list[str], release: list[str] | None = None) -> StateAsk:
        return StateAsk(self.epoch, self.version, forget, release or [])

    def apply(self, data: Any) -> InstanceState:
        """Parse an answer (ValueError if malformed) and merge it (``merge``)."""
        return self.merge(*parse_report(data))

    def merge(self, state: InstanceState, delta: SessionsDelta | None) -> InstanceState:
        """Merge a parsed answer's sessions; the state with every session the poller now
        holds. A whole table (or a plain report, ``delta`` None) replaces what was held."""
        if delta is None:
            self.epoch, self.version, self.sessions = None, None, dict(state.sessions)
            return state
        if not delta.full and (delta.epoch != self.epoch or self.version is None
                               or delta.version < self.version):
            message = (f"a delta from version {delta.version} of {delta.epoch!r} does not "
                       f"follow version {self.version} of {self.epoch!r}")
            self.epoch = self.version = None  # the next poll asks for the whole table
            raise ValueError(message)
        if delta.full:
            self.sessions = {}
        for session_id in delta.removed:
            self.sessions.pop(session_id, None)
        self.sessions.update(delta.sessions)
        self.epoch, self.version = delta.epoch, delta.version
        state.sessions = dict(self.sessions)
        return state


def parse_report(data: Any) -> tuple[InstanceState, SessionsDelta | None]:
    """An answer to a state ask, checked (ValueError): the state (its sessions the answer's,
    its ``epoch`` the delta's) and the delta's fields (None for a plain report, without them). Reads no poller state,
    so it may run on any thread."""
    state = InstanceState.from_dict(data)
    if "sessions_epoch" not in data:
        return state, None
    removed = data.get("sessions_removed")
    if not isinstance(removed, list):
        raise ValueError("sessions_removed must be a list of session ids")
    state.epoch = printable_id(data.get("sessions_epoch"), "sessions_epoch")
    return state, SessionsDelta(
        epoch=state.epoch,
        version=integer(data.get("sessions_version"), "sessions_version", lo=0),
        full=boolean(data.get("sessions_full"), "sessions_full"),
        sessions=state.sessions,
        removed=[printable_id(s, "sessions_removed[]") for s in removed],
    )
