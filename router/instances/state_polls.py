"""The router's polls of instance state: at most one in flight per instance, and the polls that
calls' ends ask for coalesced.

Who asks: the health poller (every ``interval_s``) and every call's end (the instance's queue,
KV and reservations changed). Rules:
- a poll asked for while one is in flight for that instance joins it (one report, every
  asker gets its answer);
- a call's end marks the instance stale; a poll that *starts* afterwards covers it (it reads a
  state taken after the call ended), whoever started it. So a burst of ends costs one poll
  now and at most one more when the burst is over, not one poll each;
- polls that call ends ask for start at least ``min_interval_s`` apart per instance (the
  first at once): the report costs the instance a pass over its sessions, the router a parse.

Time is the running loop's (virtual in simulation), never the wall clock.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Coroutine
from typing import Any

__all__ = ["StatePolls"]


class StatePolls:
    def __init__(
        self, poll: Callable[[str], Coroutine[Any, Any, bool]], min_interval_s: float = 0.05
    ) -> None:
        if min_interval_s < 0:
            raise ValueError(f"min_interval_s must be >= 0, got {min_interval_s}")
        self._poll = poll
        self.min_interval_s = min_interval_s
        self._in_flight: dict[str, asyncio.Task[bool]] = {}
        self._last_start: dict[str, float] = {}
        self._stale: set[str] = set()  # a call ended there since the last poll started
        self._followers: dict[str, asyncio.Task[None]] = {}

    async def poll(self, instance_id: str) -> bool:
        """Poll ``instance_id`` now, or join its poll in flight; whether it is healthy."""
        task = self._in_flight.get(instance_id)
        if task is None or task.done():
            self._stale.discard(instance_id)  # this poll reads a state after every end so far
            self._last_start[instance_id] = asyncio.get_running_loop().time()
            task = asyncio.ensure_future(self._poll(instance_id))
            self._in_flight[instance_id] = task
            task.add_done_callback(lambda done: self._forget(instance_id, done))
        return await asyncio.shield(task)

    def after_call(self, instance_id: str) -> None:
        """A call ended on ``instance_id``: make sure a poll starts after now, soon."""
        self._stale.add(instance_id)
        if instance_id not in self._followers:
            self._followers[instance_id] = asyncio.ensure_future(self._follow(instance_id))

    @property
    def idle(self) -> bool:
        """No poll in flight and none due."""
        return not self._followers and all(task.done() for task in self._in_flight.values())

    async def close(self) -> None:
        tasks = [*self._followers.values(), *self._in_flight.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _follow(self, instance_id: str) -> None:
        loop = asyncio.get_running_loop()
        try:
            while instance_id in self._stale:
                running = self._in_flight.get(instance_id)
                if running is not None and not running.done():
                    await asyncio.wait({running})  # it started before the end: wait, then poll
                    continue
                start = self._last_start.get(instance_id, -math.inf) + self.min_interval_s
                if start > loop.time():
                    await asyncio.sleep(start - loop.time())
                    continue
                await self.poll(instance_id)
        finally:
            self._followers.pop(instance_id, None)

    def _forget(self, instance_id: str, done: asyncio.Task[bool]) -> None:
        if self._in_flight.get(instance_id) is done:
            del self._in_flight[instance_id]
