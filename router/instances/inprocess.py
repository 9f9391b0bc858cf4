"""An InstanceClient for an instance object in the same process (the replay driver's sim).

Duck-typed so the router needs nothing of ``talaria`` beyond the protocol: the target has
``stream(call)`` (an async iterator of CallEvents, raising InstanceUnavailable/Overloaded,
or ValueError for a malformed call), ``abort(call_id, answered=...)`` (``InstanceClient.abort``)
and ``state()``, each either plain or async, and may have ``forget_sessions(ids)`` and
``release_reservations(ids)``.

What the router asks the target to let go of (``router.instances.let_go``) reaches it as it
reaches a live instance over HTTP (``router.instances.http``): held until the next state
poll, then applied there just before the state is read, so the simulated replay sees it at
the same moments.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Iterable
from typing import Any

from router.core import CallRejected
from router.instances.let_go import PendingLetGo
from talaria.protocol import CallEvent, CallRequest, InstanceState

MAX_PENDING_LET_GO = 1 << 20  # as the HTTP client's bound, without its per-poll cap


class InProcessClient:
    def __init__(self, instance_id: str, target: Any) -> None:
        for name in ("stream", "abort", "state"):
            if not callable(getattr(target, name, None)):
                raise TypeError(f"in-process instance {instance_id!r} has no {name}() method")
        self.instance_id = instance_id
        self._target = target
        self._let_go = PendingLetGo(MAX_PENDING_LET_GO)

    async def submit(self, call: CallRequest) -> AsyncIterator[CallEvent]:
        withdrawn = self._let_go.withdraw(call.session_id)  # a session id in use again is current
        stream = None
        started = False
        try:
            stream = self._target.stream(call)
            async for event in stream:
                started = True
                yield event
        except ValueError as exc:
            raise CallRejected(400, f"{self.instance_id}: {exc}") from exc
        finally:
            # it never ran here, and no other call of it came here: what it withdrew stands
            self._let_go.settle(call.session_id, withdrawn, ran=started)
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()

    async def abort(self, call_id: str, answered: bool = False) -> None:
        result = self._target.abort(call_id, answered=answered)
        if inspect.isawaitable(result):
            await result

    def forget_sessions(self, session_ids: Iterable[str]) -> None:
        """Sessions the router let go: the next state poll tells the target to forget them
        (dropped when the target cannot forget)."""
        if callable(getattr(self._target, "forget_sessions", None)):
            self._let_go.add_forget(session_ids)

    def release_reservations(self, session_ids: Iterable[str]) -> None:
        """Sessions gone to another instance: the next state poll releases their reservations
        there (dropped when the target cannot)."""
        if callable(getattr(self._target, "release_reservations", None)):
            self._let_go.add_release(session_ids)

    async def state(self) -> InstanceState:
        if self._let_go:
            forget, release = self._let_go.batch(MAX_PENDING_LET_GO)
            self._let_go.sent()
            if release:
                self._target.release_reservations(release)
            if forget:
                self._target.forget_sessions(forget)
        result = self._target.state()
        if inspect.isawaitable(result):
            result = await result
        return result
