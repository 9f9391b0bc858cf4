"""The admission loop: the one task that decides what an instance's engine does next.

Each turn: apply aborts and expire reservations; admit into the active model's slot (close it
when its quantum is over, or earlier by the policy's closing rule, once another model waits;
with preemption, suspend its calls in flight at the quantum; session-prefill may still admit
continuations of a closed slot); step the engine while calls run; otherwise keep, reopen or
switch the active model, or wait for work. Decisions are the policies'
(``talaria.policies``), taken on the instance's read-only ``InstanceView``; the loop carries
them out and tells ``split`` (``TimeSplit``) what the instance is doing, so each call's time
is accounted for. Time comes only from the event loop.

Who touches the engine: only this task, between awaited operations (see EngineExecutor).
Who ends a call: ``finish`` (its terminal event; it leaves the call book) exactly once, from
delivery, abort, a refused admission, or an engine fault. A fault fails only the calls in
the engine and the loop goes on (``talaria.instance.faults``); a refused call fails alone.
"""

from __future__ import annotations

import asyncio

import structlog

from engine.interface import EngineStats, Residency, StepResult, TokenEvent
from talaria.instance.calls import CallBook, PendingCall, terminal_event, token_event
from talaria.instance.estimates import Estimator
from talaria.instance.executor import EngineBusy, EngineExecutor
from talaria.instance.faults import EngineFaults, FaultBudget
from talaria.instance.heartbeats import Heartbeats
from talaria.instance.intake import Intake
from talaria.instance.kv_pressure import KVPressure
from talaria.instance.rates import RateBook
from talaria.instance.sessions import SessionKeeper
from talaria.instance.slot_yield import slot_outranked
from talaria.instance.staging import StagingRetries
from talaria.instance.time_split import IDLE, SWITCH, TimeSplit, serving
from talaria.instance.yield_guard import YieldGuard
from talaria.policies.config import PolicyConfig
from talaria.policies.model_choice import SlotYield
from talaria.policies.priority import Service, next_model
from talaria.policies.round_scheduler import RoundScheduler, Slot, slot_closes
from talaria.policies.session_prefill import hold_until
from talaria.policies.staging import staging_target
from talaria.policies.view import InstanceView
from talaria.protocol import CallUsage

log = structlog.get_logger("talaria.loop")

__all__ = ["AdmissionLoop"]

_IDLE_STEP_BACKOFF_S = 0.01  # wait after an engine step that ran nothing
_IDLE_WARN_EVERY_S = 5.0


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
        record_splits: bool = False,
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
        self.answered: set[str] = set()  # of those, calls whose caller had the answer it wanted
        self.to_forget: set[str] = set()  # sessions the router no longer holds
        self.to_release: set[str] = set()  # sessions gone elsewhere: their reservations go
        self.stopping = False
        self.wake = asyncio.Event()
        self._last_refresh = float("-inf")
        self.staging_retries = StagingRetries(instance_id, policy.staging_retry_backoff_s, counters)
        self.staging_lent = False  # the active model's KV spans the staging region: no staging
        self.pressure = KVPressure(instance_id, policy, executor, calls, sessions, counters)
        self._idle_steps = 0  # engine steps that ran nothing since the last warning
        self._idle_warned = float("-inf")
        self.faults = EngineFaults(
            instance_id, calls, executor, self.finish,
            FaultBudget(policy.max_engine_faults, policy.engine_fault_backoff_s),
        )
        self.split = TimeSplit(0.0, record=record_splits)
        self.yield_guard = YieldGuard()
        self.heartbeats = Heartbeats(instance_id, policy.call_heartbeat_s, policy.engine_op_timeout_s, counters)
        self.intake = Intake(
            instance_id, view, policy, executor, calls, sessions, est, counters, self.faults,
            self.split, finish=self.finish, stats=lambda: self.stats,
            active_model=lambda: self.active_model,
        )
        executor.on_device_wait.append(lambda waiting: self.split.device_wait(self.now(), waiting))
        if executor.device is not None:
            executor.device_request = self._device_request

    def now(self) -> float:
        return self.view.now()

    # the loop ---------------------------------------------------------------------------

    async def run(self) -> None:
        self._account()
        try:
            while True:
                self.wake.clear()
                if self.yield_guard.must_yield():  # a spin: let the server answer
                    await self._forced_yield()
                try:
                    if not await self._turn():
                        break
                except Exception as exc:  # not a cancellation: a BaseException
                    if not await self._recover(exc):
                        break
        except Exception:  # a bug outside the engine (the fault path itself): end, logged
            log.exception("admission_loop_crashed", instance=self.instance_id)
            self.faults.fail_all("the instance's admission loop stopped")
        finally:
            if not self.stopping:
                self.healthy = False  # the loop ended on its own (gave up, or a bug): no calls
            if self.executor.busy is None:
                self.sessions.release_all()

    async def _forced_yield(self) -> None:
        self.counters["forced_yields"] = self.counters.get("forced_yields", 0) + 1
        if self.counters["forced_yields"] == 1:
            log.warning("admission_loop_spinning", instance=self.instance_id,
                        turns=self.yield_guard.max_turns)
        await asyncio.sleep(0)

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
        if slot.open and self.policy.priority_switch and self._outranked(slot).model:
            slot.close(now)
        if slot.open:
            if slot.quantum_expired(now):
                if others:
                    slot.close(now)
                    if self.policy.preempt and self.calls.running:
                        await self._suspend(model)
                else:
                    slot.opened = now  # only this model has work: the slot continues
            if slot.open and self.pressure.lend_in_slot_due(model, self.staging_lent):
                if self.calls.running:  # admit nothing until they end: the view changes
                    self._account()
                    return
                await self.pressure.lend_in_slot(model)
                self.staging_lent = True
                self.refresh_engine_view(all_sessions=True)  # capacity and residency moved
            if slot.open:
                await self.intake.admit_queue(model)
                if slot_closes(self.policy.slot_close, queue_empty=not self.calls.queues[model],
                               in_flight=bool(self.calls.running), others_waiting=others > 0):
                    slot.close(now)
        self._account()
        if not slot.open and self.policy.session_prefill:
            await self.intake.admit_continuations(slot)

    async def _between_slots(self) -> None:
        """The engine is idle: keep, reopen or switch the active model, or wait for work."""
        active = self.active_model
        policy = self.policy
        waiting = {m: self.calls.waiting(m) for m in self.rounds.order}
        nxt = next_model(self.rounds, active, waiting, policy.model_choice, self._service,
                         policy.starvation_ratio, policy.admission_order,
                         min_wait_s=policy.starvation_min_wait_s)
        if nxt is None:
            await self.idle_wait(self.sessions.reservations.next_expiry())
            return
        slot = self.slot
        if slot is not None and slot.open and slot.model == active:
            # Its slot is open (its closing rule keeps it) yet nothing could be admitted:
            # wait for a change, at most until its quantum ends when another model waits.
            await self.idle_wait(None if nxt == active else slot.ends)
            return
        if nxt == active and self.policy.priority_switch:
            # A model that outranks even a fresh slot of this one goes next: reopened, the slot
            # would yield at once and the loop spin without awaiting (next_model weighs models
            # by their calls waiting, the priority switch by their sessions)
            nxt = self._outranked(Slot(nxt, self.now(), self.policy.slot_quantum_s)).model or nxt
        if nxt == active:
            if self.calls.suspended[nxt]:
                await self._switch(nxt)  # its suspended calls resume
            else:
                self._open_slot(nxt)
            return
        if self.slot is not None and self.policy.session_prefill and self.policy.sp_hold and not (
                self.policy.priority_switch and self._outranked(self.slot).model):
            hold = hold_until(self.view, self.est, self.slot)
            self.slot.sp_given_up.update(hold.give_up)
            if hold.until is not None:
                self.counters["sp_holds"] += 1
                await self._hold(hold.until)
                return
        await self._switch(nxt)

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

    def _outranked(self, slot: Slot) -> SlotYield:
        return slot_outranked(slot, self.now(), self.rounds.order, self.policy, self.calls,
                              self.sessions, self.est)

    # switching and staging --------------------------------------------------------------

    def _open_slot(self, model: str, switch_s: float = 0.0) -> Slot:
        self.slot = Slot(model=model, opened=self.now(), quantum_s=self.policy.slot_quantum_s,
                         switch_s=switch_s)
        self._account()
        return self.slot

    def _account(self) -> None:
        """Tell the time split what the instance is doing now."""
        slot = self.slot
        active = slot is not None and slot.model == self.active_model
        self.split.state(self.now(), serving(slot.model, slot.open) if active else IDLE)

    def _service(self, pending: PendingCall) -> Service:
        return self.sessions.service(pending.call.session_id, self.now() - pending.arrived)

    def _device_request(self) -> tuple[float, bool]:
        assert self.executor.device is not None
        calls = [(self.sessions.service(p.call.session_id, 0.0).attained_s, p.admitted)
                 for p in self.calls]
        return self.executor.device.claim(calls, self.now())

    async def _suspend(self, model: str) -> None:
        """Token-level preemption: the model's calls in flight are parked, KV to host."""
        self.split.state(self.now(), SWITCH)
        await self.executor.suspend()
        for pending in self.calls.suspend_running(model):
            self.split.suspend(pending.call.call_id, self.now())
        self.counters["preemptions"] = self.counters.get("preemptions", 0) + 1
        self._account()

    async def _switch(self, model: str) -> None:
        outgoing = self.active_model
        self.split.state(self.now(), SWITCH)
        if outgoing is not None and outgoing != model:
            if self.policy.host_kv:
                await self.executor.offload_kv(None)
            self.sessions.switch_out(outgoing)
        # another model comes in: its KV cache is viewed lent or not (in a slot: lend_in_slot)
        lend = self.pressure.lend_staging(model) if outgoing != model else self.staging_lent
        report = await self.executor.activate(model, lend_staging=lend)
        self.active_model = model
        if lend and outgoing != model:
            self.pressure.lent()
        self.staging_lent = lend
        self.faults.budget.progress()
        for pending in self.calls.resume(model):
            self.split.admit(pending.call.call_id, self.now())
        self.counters["switches"] += int(outgoing != model)
        log.info("switch", instance=self.instance_id, outgoing=outgoing, incoming=model,
                 kind=report.kind, seconds=report.seconds, lend_staging=lend)
        self._open_slot(model, report.seconds)
        self.refresh_engine_view(all_sessions=True)
        await self._maybe_stage()

    async def _maybe_stage(self) -> None:
        if not self.policy.d2d_staging or self.staging_lent:
            return
        self.residency, retries, now = self.executor.residency(), self.staging_retries, self.now()
        retries.observe(self.executor.take_staging_failures(), self.residency, now)
        target, slot = staging_target(self.view), self.slot
        if target is None or not retries.may_stage(target, now) or (  # the region is about to be lent
                slot and slot.open and self.pressure.lend_in_slot_due(slot.model, False)):
            return
        try:
            await self.executor.stage(target)
        except EngineBusy:
            raise
        except Exception:  # costs its D2D switch, not the calls running: no fault, a backoff
            log.exception("staging_failed", instance=self.instance_id, model=target)
            retries.failed(target, now)
            return
        self.counters["stages"] += 1
        self.residency = self.executor.residency()

    # steps and events -------------------------------------------------------------------

    async def _step(self) -> None:
        result: StepResult = await self.executor.step()
        self.intake.engine_stepped()
        if result.events:
            self.faults.budget.progress()
        for event in result.events:
            pending = self.calls.running.get(event.request_id)
            if pending is None:
                continue  # aborted meanwhile
            self._deliver(pending, event)
        ran = bool(result.events) or (result.num_steps > 0 and result.seconds > 0)
        self.heartbeats.sweep(self.now(), self.calls.running, ran)
        self.stats = self.executor.stats()
        self.rates.observe_restores(self.active_model, self.stats.restored_tokens_total)
        self.stats = await self.pressure.demote(self.active_model, self.stats) or self.stats
        if self.now() - self._last_refresh >= self.policy.state_refresh_s:
            self.refresh_engine_view(all_sessions=True)
        if not ran:
            if await self.intake.unstall(self.stats):
                return
            # Nothing could run (e.g. the engine waits for memory): do not spin, and say so
            # at most every _IDLE_WARN_EVERY_S.
            self._idle_steps += 1
            if self.now() - self._idle_warned >= _IDLE_WARN_EVERY_S:
                log.warning("idle_steps", instance=self.instance_id, steps=self._idle_steps,
                            running=len(self.calls.running))
                self._idle_warned, self._idle_steps = self.now(), 0
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
            if pending.handle.holds_steps:  # its consumer reads the ends only
                pending.handle.hold(event.new_token_ids, event.logprobs)
            else:
                pending.handle.put(token_event(pending, event, self.instance_id))
            return
        reason = event.finish_reason.value if event.finish_reason is not None else "stop"
        self.finish(pending, reason, event)
        if reason != "abort":
            self._answered(pending)

    def _answered(self, pending: PendingCall) -> None:
        """A call its caller got an answer from (finished, or ended once answered): its
        session's books, as the session goes on."""
        now = self.now()
        admitted = pending.admitted if pending.admitted is not None else now
        self.est.observe_output(pending.out_tokens)
        self.sessions.on_call_end(pending.call, pending.out_tokens, now,
                                  waited_s=admitted - pending.arrived, served_s=now - admitted)
        self.pressure.call_ended(pending)

    def finish(self, pending: PendingCall, reason: str, event: TokenEvent | None,
               error: str | None = None) -> None:
        """The call's terminal event: it leaves the book and its handle ends."""
        self.calls.remove(pending.call.call_id)
        self.split.finish(pending.call.call_id, self.now())
        pending.handle.put(terminal_event(pending, reason, event, error, self.instance_id))

    # housekeeping -----------------------------------------------------------------------

    async def _housekeeping(self) -> None:
        aborted = False
        while self.aborts:
            call_id = self.aborts.pop()
            pending = self.calls.admitted_call(call_id)
            if pending is None:
                continue
            answered = call_id in self.answered
            self.executor.abort(call_id, keep_session=answered)
            self.finish(pending, "stop" if answered else "abort", None)
            if answered:
                self._answered(pending)
            aborted = True
        self.answered.clear()
        released = self.sessions.expire(self.now())  # unpinned blocks are free: re-read
        if self.to_forget or self.to_release:
            asks, self.to_forget, self.to_release = (self.to_forget, self.to_release), set(), set()
            released |= self.sessions.drop(*asks, self.calls.sessions())
        if aborted or released:
            self.stats = self.executor.stats()

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
