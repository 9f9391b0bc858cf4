"""The sessions part of the instance's state report, kept as sessions change instead of
rebuilt at every poll, and sent as what changed since the poller's last report.

What a session's entry reads (where its KV is, its reservation, its model) changes at a few
places: a call arrives or ends, a reservation is made, consumed, expires or yields, KV is
demoted or re-read, the session is forgotten. Those mark the session (``touch``: the KV map
is a :class:`TouchingDict` and the reservation book calls back, so no write is missed) and
``sync`` recomputes only the marked ones. Each change takes the next version. A poller that
names this report's epoch and the version it last applied gets the sessions changed since
and the ids removed since (``since``); one that names none, another epoch (the instance
restarted) or a version older than the removals still remembered gets the whole table.
Removals are remembered for at least ``max_removed`` sessions.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from talaria.protocol import SessionKV
from talaria.protocol.state_delta import SessionsDelta

__all__ = ["SessionReport", "TouchingDict"]


class TouchingDict(dict[str, Any]):
    """A dict that calls ``touch(key)`` when a key's value changes or the key goes (only
    the writes the session books use: item assignment and ``pop``)."""

    def __init__(self, touch: Callable[[str], None]) -> None:
        super().__init__()
        self._touch = touch

    def __setitem__(self, key: str, value: Any) -> None:
        if key not in self or super().__getitem__(key) != value:
            self._touch(key)
        super().__setitem__(key, value)

    def pop(self, key: str, *default: Any) -> Any:
        if key in self:
            self._touch(key)
        return super().pop(key, *default)


class SessionReport:
    def __init__(self, entry: Callable[[str], SessionKV | None], max_removed: int = 1 << 14) -> None:
        self.epoch = secrets.token_hex(8)
        self.version = 0
        self.entries: dict[str, SessionKV] = {}
        self.max_removed = max_removed
        self._entry = entry
        self._touched: set[str] = set()
        self._log: OrderedDict[str, int] = OrderedDict()  # session -> its last change's version
        self._removed = 0  # entries of the log that are removals
        self._floor = 0  # removals up to this version may be forgotten

    def touch(self, session_id: str) -> None:
        self._touched.add(session_id)

    def sync(self) -> None:
        """Recompute the touched sessions' entries; a changed one takes the next version."""
        if not self._touched:
            return
        touched, self._touched = sorted(self._touched), set()
        for session_id in touched:
            new = self._entry(session_id)
            old = self.entries.get(session_id)
            if new == old:
                continue
            self.version += 1
            was_removal = session_id in self._log and old is None
            if new is None:
                del self.entries[session_id]
                self._removed += 1
            else:
                self.entries[session_id] = new
            self._removed -= was_removal
            self._log[session_id] = self.version
            self._log.move_to_end(session_id)
        if self._removed > self.max_removed:
            self._let_go()

    def since(self, epoch: str | None, version: int | None) -> SessionsDelta:
        """What a poller that applied ``version`` of ``epoch`` lacks (call after ``sync``)."""
        if epoch != self.epoch or version is None or not self._floor <= version <= self.version:
            return SessionsDelta(self.epoch, self.version, True, dict(self.entries), [])
        changed: dict[str, SessionKV] = {}
        removed: list[str] = []
        for session_id, at in reversed(self._log.items()):
            if at <= version:
                break
            entry = self.entries.get(session_id)
            if entry is None:
                removed.append(session_id)
            else:
                changed[session_id] = entry
        return SessionsDelta(self.epoch, self.version, False, changed, removed)

    def _let_go(self) -> None:
        """Forget the oldest removals, down to half the bound; a poller behind the newest
        one forgotten gets the whole table next."""
        for session_id, at in list(self._log.items()):
            if self._removed <= self.max_removed // 2:
                break
            if session_id not in self.entries:
                del self._log[session_id]
                self._removed -= 1
                self._floor = at
