"""A submitted call as its submitter sees it: an async iterator of its events."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from talaria.protocol import CallEvent, CallRequest

__all__ = ["CallHandle"]


class CallHandle:
    """Events of one call, in order; the last one has ``finished`` set and carries usage.

    Iterating ends after the finishing event. ``abort()`` (or leaving an ``async with``
    block early) aborts the call if it has not finished: its queue entry or engine request
    is dropped and its KV blocks are freed.
    """

    def __init__(self, call: CallRequest, abort: Callable[[str], None]) -> None:
        self.call = call
        self.queue: asyncio.Queue[CallEvent] = asyncio.Queue()
        self.done = False  # the finishing event has been put
        self._consumed = False
        self._abort = abort

    @property
    def call_id(self) -> str:
        return self.call.call_id

    def put(self, event: CallEvent) -> None:
        if self.done:
            return
        self.done = event.finished
        self.queue.put_nowait(event)

    def abort(self) -> None:
        if not self.done:
            self._abort(self.call.call_id)

    def __aiter__(self) -> CallHandle:
        return self

    async def __anext__(self) -> CallEvent:
        if self._consumed:
            raise StopAsyncIteration
        event = await self.queue.get()
        if event.finished:
            self._consumed = True
        return event

    async def collect(self) -> list[CallEvent]:
        """All events until the finish."""
        return [event async for event in self]

    async def __aenter__(self) -> CallHandle:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.abort()
