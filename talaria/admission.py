"""The instance's admission loop: one asyncio task that decides what the engine does next.

It owns per-model queues of calls, the slot of the active model (round scheduler), model
switches (offloading the outgoing model's KV to host first when host KV is on; otherwise that
KV is dropped by the switch), staging of the model most likely needed next, admission of calls
into the engine within a KV-block budget, engine steps, delivery of each call's events to its
own queue, soft reservations and session-prefill. Time comes only from the loop.

Who touches the engine: only this task, between awaited operations (see EngineExecutor).
``submit``, ``abort`` and ``state`` may be called from any task on the loop; they only read
or queue bookkeeping and wake the loop.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator

import structlog

from engine.interface import (
    EngineRequest,
    EngineStats,
    MultiModelEngineProtocol,
    Residency,
    StepResult,
    TokenEvent,
)
from talaria.call_handle import CallHandle
from talaria.config import PolicyConfig
from talaria.estimates import Estimator, PendingCall
from talaria.executor import EngineExecutor
from talaria.policies.round_scheduler import RoundScheduler, Slot
from talaria.policies.session_prefill import decide_queued, hold_until
from talaria.policies.staging import staging_target
from talaria.protocol import (
    CallEvent,
    CallRequest,
    CallUsage,
    InstanceState,
    InstanceUnavailable,
    Overloaded,
)
from talaria.rates import RateBook
from talaria.session_keeper import SessionKeeper
from talaria.state_report import build_state

log = structlog.get_logger("talaria.admission")

__all__ = ["Instance"]

_IDLE_STEP_BACKOFF_S = 0.01  # wait after an engine step that ran nothing


class Instance:
    """One engine with its admission loop. Create, ``await start()``, then ``submit``."""

    def __init__(
        self,
        instance_id: str,
        engine: MultiModelEngineProtocol,
        policy: PolicyConfig | None = None,
        *,
        executor: EngineExecutor | None = None,
    ) -> None:
        self.instance_id = instance_id
        self.policy = policy or PolicyConfig()
        self.engine = engine
        self.executor = executor or EngineExecutor(engine)
        self.models = list(engine.model_names)
        self.rounds = RoundScheduler(self.models)
        self.rates = RateBook(self.models, self.policy.rate_ewma_alpha)
        self.executor.on_report.append(self.rates.observe)
        self.queues: dict[str, deque[PendingCall]] = {m: deque() for m in self.models}
        self.running: dict[str, PendingCall] = {}
        self.est = Estimator(self)
        self.slot: Slot | None = None
        self.healthy = True
        self.counters: dict[str, int] = {
            "switches": 0,
            "admitted": 0,
            "sp_admitted": 0,
            "sp_holds": 0,
            "reservations": 0,
            "reservations_consumed": 0,
            "reservations_expired": 0,
            "reservations_yielded": 0,
            "stages": 0,
        }
        self.sessions = SessionKeeper(self.policy, self.executor, self.rates, self.counters)
        self.gaps = self.sessions.gaps
        self.reservations = self.sessions.reservations
        self.kv_tokens = self.sessions.kv_tokens
        self.residency: dict[str, Residency] = {}
        self.stats: EngineStats = EngineStats()
        self._calls: dict[str, PendingCall] = {}
        self._aborts: list[str] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        self._stopping = False
        self._last_refresh = float("-inf")
        self._active: str | None = engine.active_model

    # public API -------------------------------------------------------------------------

    @property
    def active_model(self) -> str | None:
        """The engine's active model as of the last switch (read without touching the
        engine, so it is safe while an operation is in flight)."""
        return self._active

    async def start(self) -> None:
        if self._task is not None:
            raise RuntimeError(f"instance {self.instance_id!r} already started")
        self._loop = asyncio.get_running_loop()
        self._active = self.engine.active_model
        self._refresh_engine_view()
        self._task = self._loop.create_task(self._run(), name=f"admission-{self.instance_id}")

    async def stop(self, drain: bool = True) -> None:
        """Stop taking calls; with ``drain`` serve what is queued and running first,
        otherwise abort it. Live reservations are released."""
        self._closing = True
        if not drain:
            for call_id in list(self._calls):
                self.abort(call_id)
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            try:
                await self._task
            finally:
                self._task = None
        self.executor.close()

    def submit(self, call: CallRequest) -> CallHandle:
        """Queue a call; iterate the returned handle for its events.

        Raises ValueError for a malformed call, Overloaded when ``max_queue_calls`` calls are
        already queued, InstanceUnavailable when the instance is stopping or failed."""
        if self._closing or not self.healthy or self._task is None:
            raise InstanceUnavailable(f"instance {self.instance_id!r} is not accepting calls")
        if call.model not in self.queues:
            raise ValueError(
                f"model {call.model!r} is not served by instance {self.instance_id!r} "
                f"(models: {self.models})"
            )
        if not call.prompt_token_ids:
            raise ValueError(f"call {call.call_id!r} has an empty prompt")
        if call.call_id in self._calls:
            raise ValueError(f"call id {call.call_id!r} is already in flight")
        queued = sum(len(q) for q in self.queues.values())
        if queued >= self.policy.max_queue_calls:
            retry = max(1.0, self.est.wait_s(call.model))
            raise Overloaded(
                f"instance {self.instance_id!r} has {queued} queued calls "
                f"(max_queue_calls={self.policy.max_queue_calls})",
                retry_after_s=retry,
            )
        now = self.now()
        continuation = self.sessions.on_arrival(call, now)
        handle = CallHandle(call, self.abort)
        pending = PendingCall(call, handle, arrived=now, continuation=continuation)
        pending.need_blocks = self.est.blocks_for(call)
        self._calls[call.call_id] = pending
        self.queues[call.model].append(pending)
        self._wake.set()
        return handle

    async def stream(self, call: CallRequest) -> AsyncIterator[CallEvent]:
        """``submit`` as an async generator; closing it early aborts the call."""
        handle = self.submit(call)
        try:
            async for event in handle:
                yield event
        finally:
            handle.abort()

    def abort(self, call_id: str) -> bool:
        """Abort a queued or running call; False if it is unknown or already finished."""
        pending = self._calls.get(call_id)
        if pending is None:
            return False
        if pending.admitted is None:
            self.queues[pending.call.model].remove(pending)
            self._finish(pending, "abort", None)
        else:
            self._aborts.append(call_id)
            self._wake.set()
        return True

    def state(self) -> InstanceState:
        return build_state(self)

    # the loop ---------------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            while True:
                self._wake.clear()
                await self._housekeeping()
                if self._stopping and not self._calls:
                    break
                if self.slot is not None:
                    await self._serve_slot()
                if self.running:
                    await self._maybe_stage()
                    await self._step()
                    continue
                await self._between_slots()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the engine failed: fail every call, stop taking new ones
            log.exception("admission_loop_failed", instance=self.instance_id)
            self.healthy = False
            for pending in list(self._calls.values()):
                self._finish(pending, "error", None, error=f"{type(exc).__name__}: {exc}")
        finally:
            if self.executor.busy is None:
                self.sessions.release_all()

    async def _serve_slot(self) -> None:
        """Admit into the active slot; close it, or keep it when nothing else waits."""
        slot = self.slot
        assert slot is not None
        model = slot.model
        now = self.now()
        others = self.others_waiting(model)
        if not slot.open and self.queues[model] and others == 0:
            self._open_slot(model)  # nothing else to serve: the model's slot reopens
            slot = self.slot
            assert slot is not None
        if slot.open:
            if slot.quantum_expired(now):
                if others:
                    slot.close(now)
                else:
                    slot.opened = now  # only this model has work: the slot continues
            if slot.open:
                await self._admit_queue(model)
                if not self.queues[model] and others:
                    slot.close(now)
        if not slot.open and self.policy.session_prefill:
            await self._sp_admit_queued(slot)

    async def _between_slots(self) -> None:
        """The engine is idle: keep, reopen or switch the active model, or wait for work."""
        active = self.active_model
        nxt = self.rounds.next_model(active, self._has_queued)
        if nxt is None:
            await self._idle_wait(self.reservations.next_expiry())
            return
        if nxt == active:
            if self.slot is not None and self.slot.open and self.slot.model == nxt:
                # Its slot is open yet nothing could be admitted: wait for a change.
                await self._idle_wait(None)
            else:
                self._open_slot(nxt)
            return
        if self.slot is not None and self.policy.session_prefill:
            until = hold_until(self, self.slot)
            if until is not None:
                self.counters["sp_holds"] += 1
                await self._hold(until)
                return
        await self._switch(nxt)

    # admission --------------------------------------------------------------------------

    async def _admit_queue(self, model: str) -> int:
        """Admit queued calls of ``model`` in FIFO order while the budget allows."""
        admitted = 0
        queue = self.queues[model]
        while queue:
            pending = queue[0]
            if not await self._make_room(pending):
                break
            if not queue or queue[0] is not pending:
                continue  # aborted while room was being made
            queue.popleft()
            self._admit(pending)
            admitted += 1
        return admitted

    def _admit(self, pending: PendingCall, sp: bool = False) -> None:
        """Hand a call (already off its queue) to the engine. An engine that refuses the
        call as malformed (ValueError) fails that call only."""
        call = pending.call
        try:
            self.executor.add_request(
                EngineRequest(
                    request_id=call.call_id,
                    prompt_token_ids=list(call.prompt_token_ids),
                    params=call.params,
                    model=call.model,
                    session_id=call.session_id,
                )
            )
        except ValueError as exc:
            self._finish(pending, "error", None, error=f"rejected by the engine: {exc}")
            return
        pending.admitted = self.now()
        pending.sp = sp
        pending.expected_out = self.est.expected_output(call)
        self.running[call.call_id] = pending
        self.counters["admitted"] += 1
        if sp:
            self.counters["sp_admitted"] += 1
        self.sessions.on_admit(call.session_id)

    async def _make_room(self, pending: PendingCall) -> bool:
        """Whether ``pending`` fits the admission budget, yielding other sessions'
        reservations (least valuable first; offloaded to host when host KV is on) if that
        makes it fit. A call larger than the whole KV region fails."""
        if len(self.running) >= self.policy.max_running_calls:
            return False
        model = pending.call.model
        total = self.stats.num_total_blocks
        if pending.need_blocks > total > 0:
            self.queues[model].remove(pending)
            self._finish(
                pending,
                "error",
                None,
                error=f"call needs {pending.need_blocks} KV blocks; the instance has {total}",
            )
            return False
        while True:
            if self._blocks_in_use(pending.call.session_id) + pending.need_blocks <= total:
                return True
            victims = self.reservations.yield_order(model, exclude=pending.call.session_id)
            if not victims:
                return False
            await self.sessions.yield_reservation(victims[0])

    def _blocks_in_use(self, session_id: str) -> int:
        model = self.active_model
        used = sum(p.need_blocks for p in self.running.values())
        pinned = self.reservations.pinned_blocks(model) if model is not None else 0
        own = self.reservations.get(session_id)
        if own is not None and own.pinned:
            pinned -= own.blocks
        return used + pinned

    # session-prefill --------------------------------------------------------------------

    async def _sp_admit_queued(self, slot: Slot) -> None:
        """Admit queued continuations of the closed slot's model when SP decides it pays."""
        queue = self.queues[slot.model]
        for pending in list(queue):
            if not pending.continuation or pending.call.call_id not in self._calls:
                continue
            decision = decide_queued(self, slot, pending)
            if not decision.take:
                continue
            if not await self._make_room(pending):
                break
            if pending not in queue:
                continue  # aborted while room was being made
            queue.remove(pending)
            slot.sp_used_s += decision.extra_delay_s
            self._admit(pending, sp=True)
            log.debug(
                "sp_admit",
                call=pending.call.call_id,
                benefit=decision.benefit_s,
                cost=decision.cost_s,
                extra=decision.extra_delay_s,
            )

    async def _hold(self, until: float) -> None:
        slot = self.slot
        assert slot is not None
        start = self.now()
        await self._idle_wait(until)
        slot.sp_used_s += self.now() - start
        if self.now() >= until:
            # Nobody came in time: do not wait for these sessions again in this slot.
            for res in self.reservations.for_model(slot.model):
                if res.expected_return + self.policy.sp_idle_margin_s <= self.now():
                    slot.sp_given_up.add(res.session_id)

    # switching and staging --------------------------------------------------------------

    def _open_slot(self, model: str) -> None:
        self.slot = Slot(model=model, opened=self.now(), quantum_s=self.policy.slot_quantum_s)

    async def _switch(self, model: str) -> None:
        outgoing = self.active_model
        if outgoing is not None:
            if self.policy.host_kv:
                tokens = self.sessions.device_tokens_of(outgoing)
                report = await self.executor.offload_kv(None)
                self.rates.observe_kv_size(report.bytes, tokens)
            self.sessions.switch_out(outgoing)
        report = await self.executor.activate(model)
        self._active = model
        self.counters["switches"] += 1
        log.info(
            "switch",
            instance=self.instance_id,
            outgoing=outgoing,
            incoming=model,
            kind=report.kind,
            seconds=report.seconds,
        )
        self._open_slot(model)
        self._refresh_engine_view(all_sessions=True)
        await self._maybe_stage()

    async def _maybe_stage(self) -> None:
        if not self.policy.d2d_staging:
            return
        self.residency = self.executor.residency()
        target = staging_target(self)
        if target is None:
            return
        await self.executor.stage(target)
        self.counters["stages"] += 1
        self.residency = self.executor.residency()

    # steps and events -------------------------------------------------------------------

    async def _step(self) -> None:
        result: StepResult = await self.executor.step()
        for event in result.events:
            pending = self.running.get(event.request_id)
            if pending is None:
                continue  # aborted meanwhile
            self._deliver(pending, event)
        self.stats = self.executor.stats()
        if self.now() - self._last_refresh >= self.policy.state_refresh_s:
            self._refresh_engine_view(all_sessions=True)
        if not result.events and (result.num_steps == 0 or result.seconds <= 0):
            # Nothing could run (e.g. the engine waits for memory): do not spin.
            log.warning("idle_step", instance=self.instance_id, running=len(self.running))
            await self._idle_wait(self.now() + _IDLE_STEP_BACKOFF_S)

    def _deliver(self, pending: PendingCall, event: TokenEvent) -> None:
        pending.out_tokens = event.num_output_tokens
        pending.usage = CallUsage(
            prompt_tokens=event.num_prompt_tokens,
            completion_tokens=event.num_output_tokens,
            cached_tokens=event.num_cached_tokens,
            restored_tokens=event.num_restored_tokens,
        )
        if not event.finished:
            pending.handle.put(
                CallEvent(
                    call_id=pending.call.call_id,
                    token_ids=list(event.new_token_ids),
                    logprobs=event.logprobs,
                    instance_id=self.instance_id,
                )
            )
            return
        reason = event.finish_reason.value if event.finish_reason is not None else "stop"
        self._finish(pending, reason, event)
        if reason != "abort":
            self._on_call_end(pending)

    def _finish(
        self,
        pending: PendingCall,
        reason: str,
        event: TokenEvent | None,
        error: str | None = None,
    ) -> None:
        call = pending.call
        self._calls.pop(call.call_id, None)
        self.running.pop(call.call_id, None)
        pending.handle.put(
            CallEvent(
                call_id=call.call_id,
                token_ids=list(event.new_token_ids) if event is not None else [],
                logprobs=event.logprobs if event is not None else None,
                finished=True,
                finish_reason=reason,
                error=error,
                usage=pending.usage or CallUsage(prompt_tokens=len(call.prompt_token_ids)),
                instance_id=self.instance_id,
            )
        )

    def _on_call_end(self, pending: PendingCall) -> None:
        self.est.observe_output(pending.out_tokens)
        self.sessions.on_call_end(pending.call, pending.out_tokens, self.now())

    # housekeeping -----------------------------------------------------------------------

    async def _housekeeping(self) -> None:
        aborted = False
        while self._aborts:
            call_id = self._aborts.pop()
            pending = self.running.get(call_id)
            if pending is None:
                continue
            self.executor.abort(call_id)
            self._finish(pending, "abort", None)
            aborted = True
        if aborted:
            self.stats = self.executor.stats()
        self.sessions.expire(self.now())

    def _refresh_engine_view(self, all_sessions: bool = False) -> None:
        self.stats = self.executor.stats()
        self.residency = self.executor.residency()
        self._last_refresh = self.now()
        if all_sessions:
            live = {p.call.session_id for p in self._calls.values()}
            self.sessions.refresh(self._last_refresh, live)

    # helpers ----------------------------------------------------------------------------

    async def _idle_wait(self, until: float | None) -> None:
        loop = asyncio.get_running_loop()
        expiry = self.reservations.next_expiry()
        if expiry is not None and (until is None or expiry < until):
            until = expiry
        if until is not None and until <= loop.time():
            return
        timer = loop.call_at(until, self._wake.set) if until is not None else None
        try:
            await self._wake.wait()
        finally:
            if timer is not None:
                timer.cancel()

    def _has_queued(self, model: str) -> bool:
        return bool(self.queues[model])

    def others_waiting(self, model: str) -> int:
        """Calls queued for models other than ``model``."""
        return sum(len(q) for m, q in self.queues.items() if m != model)

    def now(self) -> float:
        """The instance clock: the event loop's time (virtual in simulation)."""
        loop = self._loop or asyncio.get_running_loop()
        return loop.time()
