"""Calls' waits on each instance for their next event, cut short once it is marked down.

Every wait has its deadline (``router.instances.deadlines``). When the router marks an instance down
because it stopped answering (a state poll failed or timed out, its address refused, it
reported itself unhealthy: ``RouterCore.mark_down``), every wait on it is bounded by
``grace_s`` from the mark, and so is every later wait until a poll finds it answering again.
A call whose events keep coming within that grace goes on (a poll missed once does not cut
streams that flow); a call that gets nothing is cut with :class:`InstanceMarkedDown`: the core
re-places it when it had no event yet and ends it with an error event otherwise. So a hung
instance (SIGSTOP) holds its calls for the time it takes to be marked down plus the grace,
not for their first-token deadline.

At shut-down, once the drain timeout has passed, :meth:`InstanceWaits.close` cuts every wait
at once, and every later one, with :class:`RouterShuttingDown`: the core ends those calls
as failed ones (a 503 before the first event, an error event after it), not re-placed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from router.instances.deadlines import DeadlineMissed
from talaria.protocol import CallEvent, InstanceUnavailable

__all__ = ["InstanceMarkedDown", "InstanceWaits", "RouterShuttingDown", "close_stream"]


class InstanceMarkedDown(InstanceUnavailable):
    """The instance was marked down while the call waited on it."""


class RouterShuttingDown(InstanceMarkedDown):
    """The router shut down while the call waited on its instance."""


@dataclass(eq=False)
class _Wait:
    scope: asyncio.Timeout
    cut: bool = False  # its deadline was brought forward by a mark down
    closed: bool = False  # ... by the router's shut-down


class InstanceWaits:
    def __init__(self, grace_s: float = 1.0) -> None:
        if not grace_s > 0:
            raise ValueError(f"grace_s must be > 0, got {grace_s!r}")
        self.grace_s = grace_s
        self._waits: dict[str, set[_Wait]] = {}
        self._down: set[str] = set()
        self.closed = False

    def down(self, instance_id: str) -> None:
        """The instance stopped answering: bound every wait on it by the grace from now."""
        self._down.add(instance_id)
        waits = self._waits.get(instance_id)
        if waits:
            deadline = asyncio.get_running_loop().time() + self.grace_s
            for wait in waits:
                _bound(wait, deadline)

    def close(self) -> None:
        """The router is shutting down: end every wait now, and every later one at once."""
        self.closed = True
        now = asyncio.get_running_loop().time()
        for waits in self._waits.values():
            for wait in waits:
                _bound(wait, now)
                wait.closed = True

    def up(self, instance_id: str) -> None:
        """The instance answers again: later waits on it keep their own deadlines."""
        self._down.discard(instance_id)

    def is_down(self, instance_id: str) -> bool:
        return instance_id in self._down

    def waiting(self, instance_id: str) -> int:
        return len(self._waits.get(instance_id, ()))

    async def next_event(
        self, instance_id: str, stream: AsyncIterator[CallEvent], seconds: float | None, what: str
    ) -> CallEvent:
        """The stream's next event within ``seconds`` (None: no deadline, until a mark down);
        DeadlineMissed or InstanceMarkedDown otherwise (the wait is cancelled, which closes
        the stream's connection)."""
        loop = asyncio.get_running_loop()
        waits = self._waits.setdefault(instance_id, set())
        wait: _Wait | None = None
        try:
            async with asyncio.timeout_at(None if seconds is None else loop.time() + seconds) as scope:
                wait = _Wait(scope)
                if self.closed:
                    _bound(wait, loop.time())
                    wait.closed = True
                elif instance_id in self._down:
                    _bound(wait, loop.time() + self.grace_s)
                waits.add(wait)
                return await anext(stream)
        except TimeoutError:
            if wait is not None and wait.closed:
                raise RouterShuttingDown("the router is shutting down") from None
            if wait is not None and wait.cut:
                raise InstanceMarkedDown(
                    f"instance {instance_id} was marked down while the call waited for its {what}"
                ) from None
            raise DeadlineMissed(f"no {what} within {seconds:g} s") from None
        finally:
            if wait is not None:
                waits.discard(wait)
                if not waits:
                    self._waits.pop(instance_id, None)


def _bound(wait: _Wait, deadline: float) -> None:
    when = wait.scope.when()
    if when is None or when > deadline:
        wait.scope.reschedule(deadline)
        wait.cut = True


async def close_stream(stream: AsyncIterator[CallEvent]) -> None:
    """Close a call's event stream (its ``aclose``, when it has one), whatever it raises."""
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):
            await aclose()
