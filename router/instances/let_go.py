"""What the router asks one instance to let go of at its next state poll.

Two kinds: sessions to forget (the router let them go: their reservation, KV pins, prefix
chain and history go there) and sessions whose soft reservation alone is released (the
session's calls went to another instance: the promise of a return is void there, but its KV
stays cached for a bounce back). A forget covers a release. A session id a call uses again
before the poll is current again and is withdrawn from both, unless that call ends before
its first event here (refused, unreachable) and no other call of the session came here
meanwhile: then the let-go stands again (``settle``). Both ride along with a state poll
(``router.instances.http``, ``router.instances.inprocess``) and are dropped only once a
poll carried them, so a failed poll loses nothing; an id withdrawn and let go again while a
poll carried it stays (the poll carried the older let-go, which the instance may have
applied before the call that came between).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["PendingLetGo", "Withdrawal"]


@dataclass(frozen=True)
class Withdrawal:
    """What a call's ``withdraw`` took (a forget, a release), and which use of its session
    id here the call was (``PendingLetGo.settle`` tells whether another came since)."""

    forget: bool
    release: bool
    use: int


class PendingLetGo:
    def __init__(self, bound: int) -> None:
        """``bound``: the most ids held of each kind; beyond it the oldest go unsent (the
        instance forgets idle sessions and expires reservations by itself too)."""
        self.bound = bound
        self.forget: dict[str, int] = {}  # id -> the stamp of its let-go
        self.release: dict[str, int] = {}
        self._stamp = 0
        self._carried: tuple[dict[str, int], dict[str, int]] = ({}, {})  # the last batch's
        # session id -> [its calls open here, uses of it here since the first of them opened]
        self.open_calls: dict[str, list[int]] = {}

    def __bool__(self) -> bool:
        return bool(self.forget or self.release)

    def add_forget(self, session_ids: Iterable[str]) -> None:
        for session_id in session_ids:
            self.forget.setdefault(session_id, self._next())
            self.release.pop(session_id, None)
        self._trim(self.forget)

    def add_release(self, session_ids: Iterable[str]) -> None:
        for session_id in session_ids:
            if session_id not in self.forget:
                self.release.setdefault(session_id, self._next())
        self._trim(self.release)

    def withdraw(self, session_id: str) -> Withdrawal:
        """A call uses ``session_id`` again: it is current, nothing of it is let go. The call
        is open here until ``settle``; returns what it withdrew."""
        uses = self.open_calls.setdefault(session_id, [0, 0])
        uses[0] += 1
        uses[1] += 1
        return Withdrawal(self.forget.pop(session_id, None) is not None,
                          self.release.pop(session_id, None) is not None, uses[1])

    def settle(self, session_id: str, withdrawn: Withdrawal, ran: bool) -> None:
        """The call that withdrew ``withdrawn`` ended (``ran``: its first event came). One
        that never ran here (refused, or the instance unreachable before its first event)
        restores what it took, unless another call of the session came here meanwhile
        (one of an agent's parallel calls, accepted: the session is current here after all;
        it may even have ended, leaving a reservation the let-go would release)."""
        uses = self.open_calls[session_id]
        alone = uses[0] == 1 and uses[1] == withdrawn.use
        uses[0] -= 1
        if uses[0] == 0:
            del self.open_calls[session_id]
        if not ran and alone:
            self.restore(session_id, withdrawn)

    def restore(self, session_id: str, withdrawn: Withdrawal) -> None:
        """The let-go ``withdraw`` took stands again, as a new one."""
        if withdrawn.forget:
            self.add_forget([session_id])
        elif withdrawn.release:
            self.add_release([session_id])

    def batch(self, limit: int) -> tuple[list[str], list[str]]:
        """The oldest ``limit`` of each kind, for one poll (still held until ``sent``; a
        later batch, after a poll that failed, replaces it)."""
        forget, release = list(self.forget)[:limit], list(self.release)[:limit]
        self._carried = ({s: self.forget[s] for s in forget}, {s: self.release[s] for s in release})
        return forget, release

    def sent(self) -> None:
        """The poll that carried the last ``batch`` was answered: drop what it carried, not
        an id let go anew since (withdrawn and added again: another stamp)."""
        for held, carried in zip((self.forget, self.release), self._carried, strict=True):
            for session_id, stamp in carried.items():
                if held.get(session_id) == stamp:
                    del held[session_id]
        self._carried = ({}, {})

    def _next(self) -> int:
        self._stamp += 1
        return self._stamp

    def _trim(self, held: dict[str, int]) -> None:
        while len(held) > self.bound:
            del held[next(iter(held))]
