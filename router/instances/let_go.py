"""What the router asks one instance to let go of at its next state poll.

Two kinds: sessions to forget (the router let them go: their reservation, KV pins, prefix
chain and history go there) and sessions whose soft reservation alone is released (the
session's calls went to another instance: the promise of a return is void there, but its KV
stays cached for a bounce back). A forget covers a release. A session id a call uses again
before the poll is current again and is withdrawn from both. Both ride along with a state
poll (``router.instances.http``, ``router.instances.inprocess``) and are dropped only once a
poll carried them, so a failed poll loses nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["PendingLetGo"]


class PendingLetGo:
    def __init__(self, bound: int) -> None:
        """``bound``: the most ids held of each kind; beyond it the oldest go unsent (the
        instance forgets idle sessions and expires reservations by itself too)."""
        self.bound = bound
        self.forget: dict[str, None] = {}
        self.release: dict[str, None] = {}

    def __bool__(self) -> bool:
        return bool(self.forget or self.release)

    def add_forget(self, session_ids: Iterable[str]) -> None:
        for session_id in session_ids:
            self.forget[session_id] = None
            self.release.pop(session_id, None)
        self._trim(self.forget)

    def add_release(self, session_ids: Iterable[str]) -> None:
        self.release.update((s, None) for s in session_ids if s not in self.forget)
        self._trim(self.release)

    def withdraw(self, session_id: str) -> None:
        """A call uses ``session_id`` again: it is current, nothing of it is let go."""
        self.forget.pop(session_id, None)
        self.release.pop(session_id, None)

    def batch(self, limit: int) -> tuple[list[str], list[str]]:
        """The oldest ``limit`` of each kind, for one poll (still held until ``sent``)."""
        return list(self.forget)[:limit], list(self.release)[:limit]

    def sent(self, forget: Iterable[str], release: Iterable[str]) -> None:
        for session_id in forget:
            self.forget.pop(session_id, None)
        for session_id in release:
            self.release.pop(session_id, None)

    def _trim(self, held: dict[str, None]) -> None:
        while len(held) > self.bound:
            del held[next(iter(held))]
