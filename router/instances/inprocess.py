"""An InstanceClient for an instance object in the same process (the replay driver's sim).

Duck-typed so the router needs nothing of ``talaria`` beyond the protocol: the target has
``stream(call)`` (an async iterator of CallEvents, raising InstanceUnavailable/Overloaded,
or ValueError for a malformed call), ``abort(call_id)`` and ``state()``, each either plain
or async.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator
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

    async def submit(self, call: CallRequest) -> AsyncIterator[CallEvent]:
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

    async def state(self) -> InstanceState:
        result = self._target.state()
        if inspect.isawaitable(result):
            result = await result
        return result
