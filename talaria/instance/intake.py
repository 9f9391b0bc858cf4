"""How queued calls enter an instance's engine: the admission half of the loop.

Queued calls of the active model are admitted in the policy's order (FIFO, by attained
service, or by expected remaining calls) while its slot is open; after it closes,
session-prefill may still admit queued continuations it decides pay. Every admission must
fit the budget: at most ``max_running_calls`` calls, and KV blocks (a call counts
``need_blocks``: its prompt and its expected answer, ``Estimator.expected_output``) within
the region, yielding other sessions' reservations (least valuable first) to make room. An
answer longer than expected grows past its count; the engine preempts when its blocks run
out. A call whose client left, or
that the engine refuses, fails alone.

``Intake`` is owned by ``AdmissionLoop``, which calls it at each decision (``admit_queue``
while a slot is open, ``admit_continuations`` after it closes) and tells it when the engine
stepped (``engine_stepped``). It shares the loop's books (calls, sessions, counters, faults,
time split) and reads the loop's latest engine stats and active model through the two
callables it is given, since the loop replaces both as the engine moves.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import structlog

from engine.interface import EngineRequest, EngineStats
from talaria.instance.calls import CallBook, PendingCall
from talaria.instance.estimates import Estimator
from talaria.instance.executor import EngineExecutor
from talaria.instance.faults import EngineFaults
from talaria.instance.sessions import SessionKeeper
from talaria.instance.time_split import TimeSplit
from talaria.policies.config import PolicyConfig
from talaria.policies.priority import priority_key
from talaria.policies.reservations import Reservation
from talaria.policies.round_scheduler import Slot
from talaria.policies.session_prefill import SlotCosts, decide_queued, slot_costs
from talaria.policies.view import InstanceView

log = structlog.get_logger("talaria.intake")

__all__ = ["Intake", "Room"]


class Room(enum.Enum):
    """Whether a queued call fits the admission budget now."""

    FITS = "fits"
    WAIT = "wait"  # not now: running calls or pinned reservations hold the room
    FAILED = "failed"  # never: larger than the KV region (lent one included), and failed


class Intake:
    def __init__(
        self,
        instance_id: str,
        view: InstanceView,
        policy: PolicyConfig,
        executor: EngineExecutor,
        calls: CallBook,
        sessions: SessionKeeper,
        est: Estimator,
        counters: dict[str, int],
        faults: EngineFaults,
        split: TimeSplit,
        *,
        finish: Callable[..., None],
        stats: Callable[[], EngineStats],
        active_model: Callable[[], str | None],
    ) -> None:
        self.instance_id = instance_id
        self.view = view
        self.policy = policy
        self.executor = executor
        self.calls = calls
        self.sessions = sessions
        self.est = est
        self.counters = counters
        self.faults = faults
        self.split = split
        self.finish = finish  # AdmissionLoop.finish(pending, reason, event, error=None)
        self._stats = stats
        self._active_model = active_model
        # prompt blocks handed to the engine since its last step (engine admission): the
        # engine gives them blocks only when it schedules them
        self.handed_blocks = 0

    def now(self) -> float:
        return self.view.now()

    def engine_stepped(self) -> None:
        """The engine ran a step: the prompts handed to it since hold their blocks now."""
        self.handed_blocks = 0

    async def admit_queue(self, model: str) -> None:
        """Admit queued calls of ``model`` in the policy's order while the budget allows."""
        queue = self.calls.queues[model]
        if len(self.calls.running) >= self.policy.max_running_calls:
            return  # nothing can be admitted now: no need to order the queue
        order = self.policy.admission_order
        if order != "fifo" and len(queue) > 1:
            ordered = sorted(queue, key=self.sessions.waiting_key(self.now()))
            queue.clear()
            queue.extend(ordered)
        while queue:
            pending = queue[0]
            room = await self._make_room(pending)
            if room is Room.FAILED:
                continue  # it can never fit and has failed: the next call may
            if room is Room.WAIT:
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
        # the engine preempts the largest first: the session that arrived last (Continuum)
        program = self.policy.engine_preempt == "program"
        try:
            self.executor.add_request(
                EngineRequest(
                    request_id=call.call_id,
                    prompt_token_ids=call.prompt_token_ids,  # shared: never changed in place
                    params=call.params,
                    model=call.model,
                    session_id=call.session_id,
                    prompt_chain=call.prompt_chain,
                    priority=self.sessions.service(call.session_id, 0.0).first_arrival
                    if program else 0.0,
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
        self.split.admit(call.call_id, pending.admitted)
        pending.sp = sp
        pending.expected_out = self.est.expected_output(call)
        self.calls.start(pending)
        self.counters["admitted"] += 1
        if sp:
            self.counters["sp_admitted"] += 1
        self.sessions.on_admit(call.session_id)

    async def _make_room(self, pending: PendingCall) -> Room:
        """Whether ``pending`` fits the admission budget, yielding other sessions'
        reservations (least valuable first; offloaded to host when host KV is on) if that
        makes it fit. A call that needs more than the KV region waits while the staging
        region can still be lent to it (``InstanceView.most_call_blocks``), and fails (leaving its
        queue) beyond that.
        Under the engine's own admission, whether the engine would take it now."""
        if len(self.calls.running) >= self.policy.max_running_calls:
            return Room.WAIT
        if self.policy.admission == "engine":
            return await self._engine_room(pending)
        model = pending.call.model
        total = self._stats().num_total_blocks
        if pending.need_blocks > total > 0:
            most = max(total, self.view.most_call_blocks(model))
            if pending.need_blocks <= most:
                # it fits once the staging region is lent: queued, it is pressure enough for
                # the loop to lend it (at the switch, or once the calls in flight end)
                return Room.WAIT
            self.finish(
                pending,
                "error",
                None,
                error=f"call needs {pending.need_blocks} KV blocks; the instance has {most}",
            )
            return Room.FAILED
        while True:
            if self._blocks_in_use(pending.call.session_id) + pending.need_blocks <= total:
                return Room.FITS
            victims = self.yield_order(model, pending.call.session_id)
            if not victims or (self.policy.hard_pins and self.calls.running):
                return Room.WAIT  # hard pins yield only when nothing runs (deadlock guard)
            await self.sessions.yield_reservation(victims[0])

    async def _engine_room(self, pending: PendingCall) -> Room:
        """A vLLM-style engine's admission (``PolicyConfig.admission`` "engine"): the call
        goes in while the engine's free blocks, less the prompts handed to it since its last
        step, hold its prompt; nothing is kept for its answer (the engine preempts when a
        decode finds no block). Pinned reservations are the engine's own pins: they yield as
        in the budget (a hard pin only when nothing runs, Continuum's deadlock guard, which
        ``unstall`` also applies to calls already handed to the engine). The session's own
        pinned prefix is not asked for again: as vLLM V1's ``allocate_slots``, only the
        blocks beyond it must be free."""
        bs = max(1, self._stats().block_size)
        prompt = new = -(-len(pending.call.prompt_token_ids) // bs)
        own = self.sessions.reservations.get(pending.call.session_id)
        if own is not None and own.pinned and own.model == pending.call.model:
            new = max(0, prompt - own.blocks)
        while True:
            if new + self.handed_blocks <= self.executor.stats().num_free_blocks:
                # the whole prompt: admission releases the session's pin (``on_admit``), and
                # the engine counts those blocks free until the call's prefill takes them back
                self.handed_blocks += prompt
                return Room.FITS
            victims = self.yield_order(pending.call.model, pending.call.session_id)
            if not victims or (self.policy.hard_pins and self.calls.running):
                return Room.WAIT if self.calls.running else Room.FITS
            await self.sessions.yield_reservation(victims[0])

    async def unstall(self, stats: EngineStats) -> bool:
        """The pins' deadlock guard at the engine: calls handed to the engine wait there for
        blocks while nothing runs, and pinned reservations of the active model hold them. A
        vLLM-style engine admits on the blocks free when a call is handed, then its prefill
        takes them chunk by chunk, so a call can be handed, preempted by a running call's
        decode, and left waiting once every call in flight has ended and pinned its KV: no
        queued call asks for room again, and without this the pins would hold until their
        TTL. The least valuable pin yields (one per stalled step, the next step yields
        another if the engine still cannot run); returns whether one did."""
        model = self._active_model()
        if stats.num_running or not stats.num_waiting or model is None:
            return False
        victims = self.yield_order(model)
        if not victims:
            return False
        await self.sessions.yield_reservation(victims[0])
        return True

    def yield_order(self, model: str, exclude: str | None = None) -> list[Reservation]:
        """Reservations to yield, least valuable first: the latest expected return, or under
        session priority the session that comes last (the latest return among equals);
        ``exclude``: a session whose own reservation is not a candidate."""
        victims = self.sessions.reservations.yield_order(model, exclude=exclude)
        if not self.policy.session_priority or len(victims) < 2:
            return victims
        order, ratio = self.policy.admission_order, self.policy.starvation_ratio
        floor = self.policy.starvation_min_wait_s
        return sorted(victims, reverse=True, key=lambda r: priority_key(
            order, self.sessions.service(r.session_id, 0.0), ratio, min_wait_s=floor))

    def _blocks_in_use(self, session_id: str) -> int:
        model = self._active_model()
        book = self.sessions.reservations
        used = sum(p.need_blocks for p in self.calls.running.values())
        pinned = book.pinned_blocks(model) if model is not None else 0
        own = book.get(session_id)
        if own is not None and own.pinned:
            pinned -= own.blocks
        return used + pinned

    async def admit_continuations(self, slot: Slot) -> None:
        """Admit queued continuations of the closed slot's model when SP decides it pays.

        A slot closed because another model outranks it (the priority switch) admits them
        too: SP's own price (the drain it extends against the wait it saves) decides, not
        the rank. Asking the rank first and admitting nothing for an outranked slot moved
        nothing on the 30 development scenarios (-0.1% / +0.3% / +0.2% at p50 / p95 / mean,
        none beyond its interval; docs/constants.md)."""
        queue = self.calls.queues[slot.model]
        # the slot's costs and drain end are the same for every candidate until something
        # happens: computed at the first candidate, then again after each wait for room and
        # each admission
        if not self.calls.others_waiting(slot.model):
            return  # nothing else waits: SP takes nothing (``decide``), and costs nothing
        costs: SlotCosts | None = None
        drain_end = 0.0
        for pending in list(queue):
            if not pending.continuation or pending.call.call_id not in self.calls:
                continue
            if costs is None:
                costs = slot_costs(self.view, self.est, slot)
                drain_end = self.now() + self.est.drain_left_s()
            decision = decide_queued(self.view, self.est, pending, costs, drain_end)
            if not decision.take:
                continue
            room = await self._make_room(pending)
            costs = None
            if room is Room.FAILED:
                continue
            if room is Room.WAIT:
                break
            if not self.calls.unqueue(pending):
                continue  # aborted while room was being made
            slot.sp_used_s += decision.extra_delay_s
            self._admit(pending, sp=True)
            costs = None
            log.debug(
                "sp_admit",
                call=pending.call.call_id,
                benefit=decision.benefit_s,
                cost=decision.cost_s,
                extra=decision.extra_delay_s,
            )
