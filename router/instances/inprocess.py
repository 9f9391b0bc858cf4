"""An InstanceClient for an instance object in the same process (the replay driver's sim).

Duck-typed so the router needs nothing of ``talaria`` beyond the protocol: the target has
``stream(call)`` (an async iterator of CallEvents, raising InstanceUnavailable/Overloaded,
or ValueError for a malformed call), ``abort(call_id)`` and ``state()``, each either plain
or async, and may have ``forget_sessions(ids)``.

Sessions the router lets go reach the target as they reach a live instance over HTTP
(``router.instances.http``): held until the next state poll, then forgotten there just
before the state is read, so the simulated replay sees them at the same moments; a session
id a call uses again before that poll is current again and is not forgotten.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Iterable
from typing import Any

from router.core import CallRejected
from talaria.protocol import CallEvent, CallRequest, InstanceState


class InProcessClient:
    def __init__(self, instance_id: str, target: Any) -> None:
        for name in ("stream", "abort", "state"):
            if not callable(getattr(target, name, None)):
                raise TypeError(f"in-process instance {instance_id!r} has no {name}() method")
        self.instance_id = instance_id
        self._target = target
        self._forget: dict[str, None] = {}  # session ids to forget at the next poll, in order

    async def submit(self, call: CallRequest) -> AsyncIterator[CallEvent]:
        self._forget.pop(call.session_id, None)  # a session id in use again is current
        stream = self._target.stream(call)
        try:
            async for event in stream:
                yield event
        except ValueError as exc:
            raise CallRejected(400, f"{self.instance_id}: {exc}") from exc
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()

    async def abort(self, call_id: str) -> None:
        result = self._target.abort(call_id)
        if inspect.isawaitable(result):
            await result

    def forget_sessions(self, session_ids: Iterable[str]) -> None:
        """Sessions the router let go: the next state poll tells the target to forget them
        (dropped when the target cannot forget)."""
        if callable(getattr(self._target, "forget_sessions", None)):
            self._forget.update(dict.fromkeys(session_ids))

    async def state(self) -> InstanceState:
        if self._forget:
            forget, self._forget = list(self._forget), {}
            self._target.forget_sessions(forget)
        result = self._target.state()
        if inspect.isawaitable(result):
            result = await result
        return result
