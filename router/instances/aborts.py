"""Aborts the router sends an instance for calls it gave up on (a deadline missed, a call cut
from an instance marked down, a consumer that stopped early): best effort, each bounded by
the state deadline (the instance also aborts a call whose connection closed). Those sent
beside a call (``later``) are kept until done, so ``close`` can give them their deadline and
then cancel what is left."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import structlog

from talaria.protocol import InstanceClient

log = structlog.get_logger(__name__)

__all__ = ["CallAborts"]


class CallAborts:
    def __init__(self, clients: Mapping[str, InstanceClient], deadline_s: float) -> None:
        self.clients = clients  # the core's own mapping: an instance added there is known here
        self.deadline_s = deadline_s
        self._tasks: set[asyncio.Task[Any]] = set()

    async def now(self, instance_id: str, call_id: str, answered: bool = False) -> None:
        """Abort the call and wait (at most the deadline); a failure is logged, not raised.
        ``answered``: its consumer had the whole answer (``InstanceClient.abort``)."""
        try:
            async with asyncio.timeout(self.deadline_s):
                await self.clients[instance_id].abort(call_id, answered)
        except Exception as exc:
            log.info("router.abort_failed", instance=instance_id, call_id=call_id, error=repr(exc))

    @property
    def idle(self) -> bool:
        """No abort is under way beside a call."""
        return not self._tasks

    def later(self, instance_id: str, call_id: str) -> None:
        """Abort the call beside it (kept until done; cancelled by ``close``)."""
        task = asyncio.ensure_future(self.now(instance_id, call_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """The aborts under way get their deadline to reach their instances; then the rest
        are cancelled."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=self.deadline_s)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
