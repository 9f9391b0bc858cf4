"""Background polls of instance health: every ``interval_s`` each instance's state is fetched
by its own task, under the state deadline, so a hung ``/state`` delays nobody else's; a poll
that fails marks the instance down, one that answers healthy marks it up unless its calls
put it in a cooldown (``router.instances.call_health``). Stale sessions are dropped by one more task.
An unexpected error in one round of a task is logged, and the task goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import structlog

if TYPE_CHECKING:
    from router.core import RouterCore

log = structlog.get_logger(__name__)

__all__ = ["HealthPoller"]


class HealthPoller:
    def __init__(self, core: RouterCore, interval_s: float = 1.0) -> None:
        if interval_s <= 0:
            raise ValueError(f"poll interval must be > 0, got {interval_s}")
        self.core = core
        self.interval_s = interval_s
        self.polls = 0

    async def poll_once(self) -> dict[str, bool]:
        """Poll every instance once (concurrently, each under the state deadline) and drop
        stale sessions."""
        ids = sorted(self.core.clients)
        results = await asyncio.gather(*(self.core.refresh(i) for i in ids))
        self.core.cleanup_sessions()
        self.polls += 1
        return dict(zip(ids, results, strict=True))

    async def _poll_forever(self, instance_id: str) -> None:
        while True:
            try:
                await self.core.refresh(instance_id)
            except Exception:  # a bug in one poll must not end every poll for good
                log.exception("router.poll_failed", instance=instance_id)
            await asyncio.sleep(self.interval_s)

    async def _clean_forever(self) -> None:
        while True:
            try:
                self.core.cleanup_sessions()
            except Exception:
                log.exception("router.session_cleanup_failed")
            self.polls += 1
            await asyncio.sleep(self.interval_s)

    async def run(self) -> None:
        """Poll until cancelled: one task per instance and one session cleaner."""
        tasks = [asyncio.ensure_future(self._poll_forever(i)) for i in sorted(self.core.clients)]
        tasks.append(asyncio.ensure_future(self._clean_forever()))
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def context(self) -> AsyncIterator[None]:
        """For ``app.cleanup_ctx``: poll from startup to cleanup."""
        task = asyncio.ensure_future(self.run())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
