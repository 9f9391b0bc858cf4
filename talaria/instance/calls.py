"""Calls inside an instance: the submitter's handle, the loop's record, and the book of both.

Life of a call: ``submit`` creates its ``PendingCall`` and queues it (``CallBook.add``); the
loop admits it into the engine (``CallBook.start``: off its queue, into ``running``); with
token-level preemption it may be suspended (``suspend_running``) and resumed (``resume``)
when its model is active again; it leaves the book exactly once (``CallBook.remove``), when
its terminal event is put on its handle: finished, aborted, failed or refused. The handle's consumer sees events in order, the last one
with ``finished`` set.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from engine.interface import TokenEvent
from talaria.protocol import CallEvent, CallRequest, CallUsage

__all__ = ["CallBook", "CallHandle", "PendingCall", "terminal_event", "token_event"]


class CallHandle:
    """Events of one call, in order; the last one has ``finished`` set and carries usage (the
    first one with tokens carries the usage so far too: ``token_event``).

    A call sent with ``step_events`` False gets its events up to the first one with tokens,
    then only its last: the tokens of the steps between are held and sent with it (the
    consumer sees the same tokens in the same order, in fewer events).

    Iterating ends after the finishing event. ``abort()`` (or leaving an ``async with``
    block early) aborts the call if it has not finished: its queue entry or engine request
    is dropped and its KV blocks are freed.
    """

    def __init__(self, call: CallRequest, abort: Callable[[str], None]) -> None:
        self.call = call
        self.queue: asyncio.Queue[CallEvent] = asyncio.Queue()
        self.done = False  # the finishing event has been put
        # Set by a server: whether the call's client has gone away (checked at admission,
        # so a departed client's queued call is dropped, never prefilled).
        self.client_gone: Callable[[], bool] | None = None
        self._consumed = False
        self._abort = abort
        self._held: list[int] | None = None  # held tokens, once holding has started
        self._held_logprobs: list[float] | None = None

    @property
    def call_id(self) -> str:
        return self.call.call_id

    @property
    def holds_steps(self) -> bool:
        """Whether a step's tokens are held for the last event instead of sent now."""
        return self._held is not None

    def hold(self, token_ids: list[int], logprobs: list[float] | None) -> None:
        """Keep a step's tokens for the last event (only while ``holds_steps``)."""
        assert self._held is not None
        if logprobs is None or (self._held and self._held_logprobs is None):
            self._held_logprobs = None
        else:
            self._held_logprobs = (self._held_logprobs or []) + list(logprobs)
        self._held.extend(token_ids)

    def put(self, event: CallEvent) -> None:
        if self.done:
            return
        if self._held is not None:
            if not event.finished:
                self.hold(event.token_ids, event.logprobs)
                return
            if self._held:
                held_lp, lp = self._held_logprobs, event.logprobs
                if held_lp is None or (lp is None and event.token_ids):
                    event.logprobs = None  # logprobs for some tokens only: none
                else:
                    event.logprobs = held_lp + list(lp or [])
                event.token_ids = self._held + event.token_ids
                self._held = []
        elif event.token_ids and not event.finished and not self.call.step_events:
            self._held = []  # the first tokens go now, the rest with the last event
        self.done = event.finished
        self.queue.put_nowait(event)

    def departed(self) -> bool:
        return self.client_gone is not None and self.client_gone()

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


@dataclass(eq=False)
class PendingCall:
    """A call inside the instance, queued (``admitted`` None) or running. Compared by
    identity: two calls with equal fields are still two calls."""

    call: CallRequest
    handle: CallHandle
    arrived: float
    continuation: bool  # its session has finished a call of this model here before
    need_blocks: int = 0  # KV blocks it is expected to hold (prompt + expected answer)
    admitted: float | None = None
    sp: bool = False  # admitted by session-prefill after its slot closed
    out_tokens: int = 0
    expected_out: float = 0.0
    usage: CallUsage | None = None


class CallBook:
    """Every call in the instance: FIFO queues per model, and the calls running in the engine.

    A call is in ``by_id`` from ``add`` to ``remove``; in between it is in exactly one of:
    its model's queue (not yet admitted), ``running``, or its model's ``suspended`` list
    (admitted, parked by the engine until its model is active again).
    """

    def __init__(self, models: list[str]) -> None:
        self.queues: dict[str, deque[PendingCall]] = {m: deque() for m in models}
        self.running: dict[str, PendingCall] = {}
        self.suspended: dict[str, list[PendingCall]] = {m: [] for m in models}
        self.by_id: dict[str, PendingCall] = {}

    def __contains__(self, call_id: object) -> bool:
        return call_id in self.by_id

    def __len__(self) -> int:
        return len(self.by_id)

    def __iter__(self) -> Iterator[PendingCall]:
        return iter(list(self.by_id.values()))

    def add(self, pending: PendingCall) -> None:
        self.by_id[pending.call.call_id] = pending
        self.queues[pending.call.model].append(pending)

    def start(self, pending: PendingCall) -> None:
        """``pending`` (already off its queue) is in the engine now."""
        self.running[pending.call.call_id] = pending

    def unqueue(self, pending: PendingCall) -> bool:
        """Take a queued call off its queue; False if it is not queued."""
        queue = self.queues[pending.call.model]
        if pending in queue:
            queue.remove(pending)
            return True
        return False

    def suspend_running(self, model: str) -> list[PendingCall]:
        """Every running call (all of ``model``) is suspended now."""
        calls = list(self.running.values())
        self.suspended[model].extend(calls)
        self.running.clear()
        return calls

    def resume(self, model: str) -> list[PendingCall]:
        """``model``'s suspended calls run again."""
        calls, self.suspended[model] = self.suspended[model], []
        for pending in calls:
            self.running[pending.call.call_id] = pending
        return calls

    def admitted_call(self, call_id: str) -> PendingCall | None:
        """The running or suspended call with this id."""
        pending = self.by_id.get(call_id)
        return pending if pending is not None and pending.admitted is not None else None

    def remove(self, call_id: str) -> PendingCall | None:
        """The call leaves the instance (its terminal event is being put)."""
        pending = self.by_id.pop(call_id, None)
        if pending is None or self.running.pop(call_id, None) is not None:
            return pending
        suspended = self.suspended[pending.call.model]
        if pending in suspended:
            suspended.remove(pending)
        else:
            self.unqueue(pending)
        return pending

    def num_queued(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def has_queued(self, model: str) -> bool:
        """Whether calls of ``model`` wait for its slot (queued or suspended)."""
        return bool(self.queues[model]) or bool(self.suspended[model])

    def waiting(self, model: str) -> list[PendingCall]:
        """Calls of ``model`` waiting for its slot: suspended ones first, then the queue."""
        return self.suspended[model] + list(self.queues[model])

    def others_waiting(self, model: str) -> int:
        """Calls queued or suspended for models other than ``model``."""
        return sum(len(q) + len(self.suspended[m]) for m, q in self.queues.items() if m != model)

    def sessions(self) -> set[str]:
        """Sessions with a call queued or running."""
        return {p.call.session_id for p in self.by_id.values()}


def token_event(pending: PendingCall, event: TokenEvent, instance_id: str) -> CallEvent:
    """A call's non-final event: the tokens one engine step produced for it. The first one
    with tokens also carries the usage so far (its prompt, cached and restored tokens are
    final then), so a consumer that stops reading early (a stop string reached) still has
    them; the last event carries the final usage."""
    first = bool(event.new_token_ids) and event.num_output_tokens == len(event.new_token_ids)
    return CallEvent(
        call_id=pending.call.call_id,
        token_ids=list(event.new_token_ids),
        logprobs=event.logprobs,
        usage=pending.usage if first else None,
        instance_id=instance_id,
    )


def terminal_event(
    pending: PendingCall,
    reason: str,
    event: TokenEvent | None,
    error: str | None,
    instance_id: str,
) -> CallEvent:
    """A call's last event: its last tokens (if any), why it ended, and its usage."""
    call = pending.call
    return CallEvent(
        call_id=call.call_id,
        token_ids=list(event.new_token_ids) if event is not None else [],
        logprobs=event.logprobs if event is not None else None,
        finished=True,
        finish_reason=reason,
        error=error,
        usage=pending.usage or CallUsage(prompt_tokens=len(call.prompt_token_ids)),
        instance_id=instance_id,
    )
