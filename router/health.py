"""Background poller: every ``interval_s`` fetch each instance's state (which marks it up or
down in the core) and drop stale sessions. Runs under aiohttp's ``cleanup_ctx``."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import structlog

from router.core import RouterCore

log = structlog.get_logger(__name__)


class HealthPoller:
    def __init__(self, core: RouterCore, interval_s: float = 1.0) -> None:
        if interval_s <= 0:
            raise ValueError(f"poll interval must be > 0, got {interval_s}")
        self.core = core
        self.interval_s = interval_s
        self.polls = 0

    async def poll_once(self) -> dict[str, bool]:
        ids = sorted(self.core.clients)
        results = await asyncio.gather(*(self.core.refresh(i) for i in ids))
        self.core.cleanup_sessions()
        self.polls += 1
        return dict(zip(ids, results, strict=True))

    async def run(self) -> None:
        while True:
            try:
                await self.poll_once()
            except Exception:
                log.exception("router.poll_failed")
            await asyncio.sleep(self.interval_s)

    async def context(self) -> AsyncIterator[None]:
        """For ``app.cleanup_ctx``: start polling at startup, stop at cleanup."""
        task = asyncio.ensure_future(self.run())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
