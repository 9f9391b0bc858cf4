"""A shut-down's drain that a second signal cuts short.

The first SIGINT / SIGTERM stops a server taking calls and gives those in flight their drain
time; a second one sets the app's ``DRAIN_HURRY_KEY`` event, and the drain (the router's
``InflightGate.drain``, the instance's ``_drain``) stops waiting and ends what is left at
once, as it would at its timeout. The event belongs to whoever handles the signals
(``talaria.serving.signals``); an app that has none drains for its whole timeout.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from aiohttp import web

__all__ = ["DRAIN_HURRY_KEY", "drain_hurry", "wait_unless_hurried"]

DRAIN_HURRY_KEY = web.AppKey("talaria_drain_hurry", asyncio.Event)


def drain_hurry(app: web.Application) -> asyncio.Event | None:
    """The event that cuts ``app``'s drain short, if its server set one."""
    return app.get(DRAIN_HURRY_KEY)


async def wait_unless_hurried(
    waiting: Awaitable[object], timeout_s: float, hurry: asyncio.Event | None
) -> bool:
    """Wait for ``waiting`` up to ``timeout_s`` or until ``hurry`` is set; True if it ended.
    ``waiting`` is wrapped in a task, cancelled if it has not ended by then."""
    task = asyncio.ensure_future(waiting)
    if hurry is not None and hurry.is_set():
        task.cancel()
        await asyncio.wait({task})
        return False
    waits: set[asyncio.Future[object]] = {task}
    hurried = asyncio.ensure_future(hurry.wait()) if hurry is not None else None
    if hurried is not None:
        waits.add(hurried)
    try:
        await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in waits:
            if not pending.done():
                pending.cancel()
        await asyncio.wait(waits)
    return task.done() and not task.cancelled() and task.exception() is None
