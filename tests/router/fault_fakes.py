"""An in-process instance whose faults a test switches on and off, as an operator's signals
and a flaky network would: killed (nothing listens: calls and polls refused, streams in
flight broken), stopped (SIGSTOP: calls, polls and aborts hang until continued), slow (each
event comes late), dropping (streams break after a few events)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from talaria.protocol import CallEvent, CallRequest, CallUsage, InstanceState, InstanceUnreachable


class FaultyInstance:
    def __init__(self, instance_id: str, tokens: int = 6, step_s: float = 0.01) -> None:
        self.instance_id = instance_id
        self.tokens = tokens
        self.step_s = step_s
        self.killed = False
        self.stopped = False
        self.slow_s = 0.0  # added before each event
        self.drop_after: int | None = None  # events sent before a stream breaks
        self.calls: list[CallRequest] = []
        self.aborted: list[str] = []
        self.state_polls = 0

    async def _alive(self) -> None:
        """Return while running; hang while stopped; raise once killed (a stopped process
        that is killed refuses too)."""
        while self.stopped and not self.killed:
            await asyncio.sleep(0.01)
        if self.killed:
            raise InstanceUnreachable(f"{self.instance_id}: connection refused")

    async def submit(self, call: CallRequest) -> AsyncIterator[CallEvent]:
        await self._alive()
        self.calls.append(call)
        n = min(self.tokens, call.params.max_tokens)
        for i in range(n):
            await asyncio.sleep(self.step_s + self.slow_s)
            await self._alive()
            if self.drop_after is not None and i >= self.drop_after:
                raise InstanceUnreachable(f"{self.instance_id}: connection reset")
            last = i == n - 1
            yield CallEvent(
                call_id=call.call_id, token_ids=[100 + i], finished=last,
                finish_reason="length" if last else None,
                usage=CallUsage(len(call.prompt_token_ids), n) if last else None,
            )

    async def abort(self, call_id: str, answered: bool = False) -> None:
        await self._alive()
        self.aborted.append(call_id)

    async def state(self) -> InstanceState:
        await self._alive()
        self.state_polls += 1
        return InstanceState(instance_id=self.instance_id)
