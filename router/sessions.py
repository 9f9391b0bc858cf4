"""The router's session table: where each session's calls went and how they came back.

Times are the caller's clock (the event loop's ``loop.time()``, virtual in simulation).
A session record lives while calls are in flight and ``ttl_s`` after its last finish;
``cleanup`` drops the stale ones (and a session whose client said ``last_call`` goes when
that call ends). The table holds at most ``max_sessions``: a new session beyond that evicts
the least recently seen idle one, and ``on_evict`` hears of it (its owner forgets what else
it kept of the session).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from router.prefix_chain import ChainSample


@dataclass
class SessionRecord:
    session_id: str
    model: str
    started_at: float
    instance_id: str | None = None  # where its last call ran
    prompt_tokens: int = 0  # of its last call
    kv_tokens: int = 0  # prompt + output of its last finished call
    kv: ChainSample = field(default_factory=lambda: ChainSample.of(()))  # prompt + output, sampled
    last_finish: float | None = None
    last_seen: float = 0.0
    calls: int = 0
    active_calls: int = 0


class SessionTable:
    def __init__(self, ttl_s: float = 1800.0, max_sessions: int = 100_000) -> None:
        if ttl_s <= 0:
            raise ValueError(f"session ttl_s must be > 0, got {ttl_s}")
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.evicted = 0
        self.on_evict: Callable[[SessionRecord], None] | None = None
        self._sessions: OrderedDict[str, SessionRecord] = OrderedDict()  # least recent first

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def get(self, session_id: str) -> SessionRecord | None:
        return self._sessions.get(session_id)

    def start_call(
        self,
        session_id: str,
        model: str,
        now: float,
        prompt_tokens: int,
    ) -> SessionRecord:
        """Record a call's arrival and return the record as it was before this call's
        placement."""
        record = self._sessions.get(session_id)
        if record is None or record.model != model:
            if record is None:
                self._make_room()
            record = SessionRecord(session_id=session_id, model=model, started_at=now)
            self._sessions[session_id] = record
        record.calls += 1
        record.active_calls += 1
        record.prompt_tokens = prompt_tokens
        record.last_seen = now
        self._sessions.move_to_end(session_id)
        return record

    def _make_room(self) -> None:
        """Evict least recently seen idle sessions until one more fits (sessions with calls
        in flight stay: the router's cap on calls in flight bounds them)."""
        while len(self._sessions) >= self.max_sessions:
            victim = next((r for r in self._sessions.values() if r.active_calls == 0), None)
            if victim is None:
                return
            del self._sessions[victim.session_id]
            self.evicted += 1
            if self.on_evict is not None:
                self.on_evict(victim)

    def end_call(
        self,
        session_id: str,
        instance_id: str | None,
        now: float,
        kv: ChainSample,
        kv_tokens: int,
        last_call: bool = False,
    ) -> SessionRecord | None:
        """Record a call's end; returns the record, removed from the table if the session
        ended (``last_call``)."""
        record = self._sessions.get(session_id)
        if record is None:
            return None
        record.active_calls = max(0, record.active_calls - 1)
        record.last_finish = now
        record.last_seen = now
        self._sessions.move_to_end(session_id)
        if instance_id is not None:
            record.instance_id = instance_id
            record.kv = kv
            record.kv_tokens = kv_tokens
        if last_call and record.active_calls == 0:
            del self._sessions[session_id]
        return record

    def cleanup(self, now: float) -> list[SessionRecord]:
        """Drop sessions idle for more than ``ttl_s``; returns what was dropped."""
        stale = [
            r for r in self._sessions.values()
            if r.active_calls == 0 and now - r.last_seen > self.ttl_s
        ]
        for record in stale:
            del self._sessions[record.session_id]
        return stale
