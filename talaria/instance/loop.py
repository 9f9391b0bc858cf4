"""The admission loop: the one task that decides what an instance's engine does next.

Each turn: apply aborts and expire reservations; admit into the active model's slot (close it
when its queue is empty or its quantum is over and another model waits; session-prefill may
still admit continuations of a closed slot); step the engine while calls run; otherwise keep,
reopen or switch the active model, or wait for work. Decisions are the policies'
(``talaria.policies``), taken on the instance's read-only ``InstanceView``; the loop carries
them out. Time comes only from the event loop.

Who touches the engine: only this task, between awaited operations (see EngineExecutor).
Who ends a call: ``finish`` (its terminal event; it leaves the call book) exactly once, from
delivery, abort, a refused admission, or an engine fault. A fault fails only the calls in the
engine and the loop goes on (``talaria.instance.faults``); a call the engine cannot take
fails alone.
"""

from __future__ import annotations

import asyncio

import structlog

from engine.interface import EngineRequest, EngineStats, Residency, StepResult, TokenEvent
from talaria.config import PolicyConfig
from talaria.instance.calls import CallBook, PendingCall, terminal_event, token_event
from talaria.instance.estimates import Estimator
from talaria.instance.executor import EngineExecutor
from talaria.instance.faults import EngineFaults, FaultBudget
from talaria.instance.rates import RateBook
from talaria.instance.sessions import SessionKeeper
from talaria.policies.round_scheduler import RoundScheduler, Slot
from talaria.policies.session_prefill import decide_queued, hold_until
from talaria.policies.staging import staging_target
from talaria.policies.view import InstanceView
from talaria.protocol import CallUsage

log = structlog.get_logger("talaria.admission")

__all__ = ["AdmissionLoop"]

_IDLE_STEP_BACKOFF_S = 0.01  # wait after an engine step that ran nothing


class AdmissionLoop:
    def __init__(
        self,
        instance_id: str,
        view: InstanceView,
        policy: PolicyConfig,
        executor: EngineExecutor,
        calls: CallBook,
        sessions: SessionKeeper,
        est: Estimator,
        rates: RateBook,
        counters: dict[str, int],
        active_model: str | None,
    ) -> None:
        self.instance_id = instance_id
        self.view = view
        self.policy = policy
        self.executor = executor
        self.calls = calls
        self.sessions = sessions
        self.est = est
        self.rates = rates
        self.counters = counters
        self.rounds: RoundScheduler = view.rounds
        self.active_model = active_model
        self.slot: Slot | None = None
        self.residency: dict[str, Residency] = {}
        self.stats = EngineStats()
        self.healthy = True
        self.aborts: list[str] = []
        self.stopping = False
        self.wake = asyncio.Event()
        self._last_refresh = float("-inf")
        self.faults = EngineFaults(
            instance_id, calls, executor, self.finish,
            FaultBudget(policy.max_engine_faults, policy.engine_fault_backoff_s),
        )

    def now(self) -> float:
        return self.view.now()

    # the loop ---------------------------------------------------------------------------

    async def run(self) -> None:
        try:
            while True:
                self.wake.clear()
                try:
                    if not await self._turn():
                        break
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    if not await self._recover(exc):
                        break
        finally:
            if self.executor.busy is None:
                self.sessions.release_all()

    async def _turn(self) -> bool:
        """One decision; False once stopping with nothing left to serve."""
        await self._housekeeping()
        if self.stopping and not self.calls:
            return False
        if self.slot is not None:
            await self._serve_slot()
        if self.calls.running:
            await self._maybe_stage()
            await self._step()
            return True
        await self._between_slots()
        return True

    async def _recover(self, exc: Exception) -> bool:
        """An engine fault (``talaria.instance.faults``); False when the loop gives up."""
        self.counters["engine_faults"] += 1
        backoff = self.faults.handle(exc)
        if backoff is None:
            self.healthy = False
            return False
        # Believe the engine about which model is active (a switch may have failed half-way).
        self.active_model = self.executor.active_model
        if self.slot is not None and self.slot.model != self.active_model:
            self.slot = None
        await asyncio.sleep(backoff)
        return True

    async def _serve_slot(self) -> None:
        """Admit into the active slot; close it, or keep it when nothing else waits."""
        slot = self.slot
        assert slot is not None
        model = slot.model
        now = self.now()
        others = self.calls.others_waiting(model)
        if not slot.open and self.calls.queues[model] and others == 0:
            slot = self._open_slot(model)  # nothing else to serve: the model's slot reopens
        if slot.open:
            if slot.quantum_expired(now):
                if others:
                    slot.close(now)
                else:
                    slot.opened = now  # only this model has work: the slot continues
            if slot.open:
                await self._admit_queue(model)
                if not self.calls.queues[model] and others:
                    slot.close(now)
        if not slot.open and self.policy.session_prefill:
            await self._sp_admit_queued(slot)

    async def _between_slots(self) -> None:
        """The engine is idle: keep, reopen or switch the active model, or wait for work."""
        active = self.active_model
        nxt = self.rounds.next_model(active, self.calls.has_queued)
        if nxt is None:
            await self.idle_wait(self.sessions.reservations.next_expiry())
            return
        if nxt == active:
            if self.slot is not None and self.slot.open and self.slot.model == nxt:
                # Its slot is open yet nothing could be admitted: wait for a change.
                await self.idle_wait(None)
            else:
                self._open_slot(nxt)
            return
        if self.slot is not None and self.policy.session_prefill:
            hold = hold_until(self.view, self.est, self.slot)
            self.slot.sp_given_up.update(hold.give_up)
            if hold.until is not None:
                self.counters["sp_holds"] += 1
                await self._hold(hold.until)
                return
        await self._switch(nxt)

    # admission --------------------------------------------------------------------------

    async def _admit_queue(self, model: str) -> None:
        """Admit queued calls of ``model`` in FIFO order while the budget allows."""
        queue = self.calls.queues[model]
        while queue:
            pending = queue[0]
            if not await self._make_room(pending):
                break
            if not queue or queue[0] is not pending:
                continue  # aborted while room was being made
            queue.popleft()
            self._admit(pending)

    def _admit(self, pending: PendingCall, sp: bool = False) -> None:
        """Hand a call (already off its queue) to the engine, unless its client has gone. An
        engine that refuses the call fails that call only."""
        call = pending.call
        if pending.handle.departed():
            self.counters["departed"] += 1
            self.finish(pending, "abort", None)
            return
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
            self.finish(pending, "error", None, error=f"rejected by the engine: {exc}")
            return
        except Exception as exc:  # the call's own failure: it alone fails
            log.exception("admit_failed", instance=self.instance_id, call=call.call_id)
            self.faults.drop(call.call_id)
            self.finish(pending, "error", None,
                        error=f"the engine could not take the call: {type(exc).__name__}: {exc}")
            return
        pending.admitted = self.now()
        pending.sp = sp
        pending.expected_out = self.est.expected_output(call)
        self.calls.start(pending)
        self.counters["admitted"] += 1
        if sp:
            self.counters["sp_admitted"] += 1
        self.sessions.on_admit(call.session_id)

    async def _make_room(self, pending: PendingCall) -> bool:
        """Whether ``pending`` fits the admission budget, yielding other sessions'
        reservations (least valuable first; offloaded to host when host KV is on) if that
        makes it fit. A call larger than the whole KV region fails."""
        if len(self.calls.running) >= self.policy.max_running_calls:
            return False
        model = pending.call.model
        total = self.stats.num_total_blocks
        if pending.need_blocks > total > 0:
            self.finish(
                pending,
                "error",
                None,
                error=f"call needs {pending.need_blocks} KV blocks; the instance has {total}",
            )
            return False
        book = self.sessions.reservations
        while True:
            if self._blocks_in_use(pending.call.session_id) + pending.need_blocks <= total:
                return True
            victims = book.yield_order(model, exclude=pending.call.session_id)
            if not victims:
                return False
            await self.sessions.yield_reservation(victims[0])

    def _blocks_in_use(self, session_id: str) -> int:
        model = self.active_model
        book = self.sessions.reservations
        used = sum(p.need_blocks for p in self.calls.running.values())
        pinned = book.pinned_blocks(model) if model is not None else 0
        own = book.get(session_id)
        if own is not None and own.pinned:
            pinned -= own.blocks
        return used + pinned

    # session-prefill --------------------------------------------------------------------

    async def _sp_admit_queued(self, slot: Slot) -> None:
        """Admit queued continuations of the closed slot's model when SP decides it pays."""
        queue = self.calls.queues[slot.model]
        for pending in list(queue):
            if not pending.continuation or pending.call.call_id not in self.calls:
                continue
            decision = decide_queued(self.view, self.est, slot, pending)
            if not decision.take:
                continue
            if not await self._make_room(pending):
                break
            if not self.calls.unqueue(pending):
                continue  # aborted while room was being made
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
        await self.idle_wait(until)
        slot.sp_used_s += self.now() - start
        if self.now() >= until:
            # Nobody came in time: do not wait for these sessions again in this slot.
            for res in self.sessions.reservations.for_model(slot.model):
                if res.expected_return + self.policy.sp_idle_margin_s <= self.now():
                    slot.sp_given_up.add(res.session_id)

    # switching and staging --------------------------------------------------------------

    def _open_slot(self, model: str) -> Slot:
        self.slot = Slot(model=model, opened=self.now(), quantum_s=self.policy.slot_quantum_s)
        return self.slot

    async def _switch(self, model: str) -> None:
        outgoing = self.active_model
        if outgoing is not None:
            if self.policy.host_kv:
                tokens = self.sessions.device_tokens_of(outgoing)
                report = await self.executor.offload_kv(None)
                self.rates.observe_kv_size(report.bytes, tokens)
            self.sessions.switch_out(outgoing)
        report = await self.executor.activate(model)
        self.active_model = model
        self.faults.budget.progress()
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
        self.refresh_engine_view(all_sessions=True)
        await self._maybe_stage()

    async def _maybe_stage(self) -> None:
        if not self.policy.d2d_staging:
            return
        self.residency = self.executor.residency()
        target = staging_target(self.view)
        if target is None:
            return
        await self.executor.stage(target)
        self.counters["stages"] += 1
        self.residency = self.executor.residency()

    # steps and events -------------------------------------------------------------------

    async def _step(self) -> None:
        result: StepResult = await self.executor.step()
        if result.events:
            self.faults.budget.progress()
        for event in result.events:
            pending = self.calls.running.get(event.request_id)
            if pending is None:
                continue  # aborted meanwhile
            self._deliver(pending, event)
        self.stats = self.executor.stats()
        if self.now() - self._last_refresh >= self.policy.state_refresh_s:
            self.refresh_engine_view(all_sessions=True)
        if not result.events and (result.num_steps == 0 or result.seconds <= 0):
            # Nothing could run (e.g. the engine waits for memory): do not spin.
            log.warning("idle_step", instance=self.instance_id, running=len(self.calls.running))
            await self.idle_wait(self.now() + _IDLE_STEP_BACKOFF_S)

    def _deliver(self, pending: PendingCall, event: TokenEvent) -> None:
        pending.out_tokens = event.num_output_tokens
        pending.usage = CallUsage(
            prompt_tokens=event.num_prompt_tokens,
            completion_tokens=event.num_output_tokens,
            cached_tokens=event.num_cached_tokens,
            restored_tokens=event.num_restored_tokens,
        )
        if not event.finished:
            pending.handle.put(token_event(pending, event, self.instance_id))
            return
        reason = event.finish_reason.value if event.finish_reason is not None else "stop"
        self.finish(pending, reason, event)
        if reason != "abort":
            self.est.observe_output(pending.out_tokens)
            self.sessions.on_call_end(pending.call, pending.out_tokens, self.now())

    def finish(
        self, pending: PendingCall, reason: str, event: TokenEvent | None, error: str | None = None
    ) -> None:
        """The call's terminal event: it leaves the book and its handle ends."""
        self.calls.remove(pending.call.call_id)
        pending.handle.put(terminal_event(pending, reason, event, error, self.instance_id))

    # housekeeping -----------------------------------------------------------------------

    async def _housekeeping(self) -> None:
        aborted = False
        while self.aborts:
            call_id = self.aborts.pop()
            pending = self.calls.running.get(call_id)
            if pending is None:
                continue
            self.executor.abort(call_id)
            self.finish(pending, "abort", None)
            aborted = True
        if aborted:
            self.stats = self.executor.stats()
        self.sessions.expire(self.now())

    def refresh_engine_view(self, all_sessions: bool = False) -> None:
        self.stats = self.executor.stats()
        self.residency = self.executor.residency()
        self._last_refresh = self.now()
        if all_sessions:
            self.sessions.refresh(self._last_refresh, self.calls.sessions())

    async def idle_wait(self, until: float | None) -> None:
        """Sleep until ``until`` (None: no deadline), the next reservation expiry, or a wake."""
        loop = asyncio.get_running_loop()
        expiry = self.sessions.reservations.next_expiry()
        if expiry is not None and (until is None or expiry < until):
            until = expiry
        if until is not None and until <= loop.time():
            return
        timer = loop.call_at(until, self.wake.set) if until is not None else None
        try:
            await self.wake.wait()
        finally:
            if timer is not None:
                timer.cancel()
