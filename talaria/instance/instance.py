"""An instance: one engine, its calls, its session state and the admission loop that runs it.

``Instance`` is the instance's face: ``submit`` / ``stream`` / ``abort`` / ``state`` for the
server (or the in-process router), ``start`` / ``stop`` for its life cycle, and the read-only
``InstanceView`` its policies decide with. The loop itself is ``talaria.instance.loop``.

``submit``, ``abort`` and ``state`` may be called from any task on the loop; they only read
or queue bookkeeping and wake the loop. Only the loop's task touches the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import structlog

from engine.interface import EngineStats, MultiModelEngineProtocol, Residency
from talaria.instance.calls import CallBook, CallHandle, PendingCall
from talaria.instance.estimates import Estimator, blocks_for
from talaria.instance.executor import EngineExecutor
from talaria.instance.loop import AdmissionLoop
from talaria.instance.rates import RateBook
from talaria.instance.sessions import SessionKeeper
from talaria.instance.state_report import build_state
from talaria.policies.config import PolicyConfig
from talaria.policies.priority import Service
from talaria.policies.reservations import ReservationBook
from talaria.policies.round_scheduler import RoundScheduler, Slot
from talaria.policies.staging import call_capacity_blocks
from talaria.protocol import (
    CallEvent,
    CallRequest,
    InstanceState,
    InstanceUnavailable,
    Overloaded,
)

log = structlog.get_logger("talaria.instance")

__all__ = ["Instance"]


class Instance:
    """One engine with its admission loop. Create, ``await start()``, then ``submit``.

    Satisfies ``talaria.policies.view.InstanceView`` (what policies read) and
    ``talaria.instance.state_report.ReportSource`` (what the router is told).
    """

    def __init__(
        self,
        instance_id: str,
        engine: MultiModelEngineProtocol,
        policy: PolicyConfig | None = None,
        *,
        executor: EngineExecutor | None = None,
        record_splits: bool = False,
    ) -> None:
        """``record_splits``: keep each finished call's time split (``loop.split.done``) for
        a benchmark to read; off live, where nothing per finished call is kept."""
        self.instance_id = instance_id
        self.policy = policy or PolicyConfig()
        if self.policy.preempt and not callable(getattr(engine, "suspend", None)):
            raise ValueError(f"policy {self.policy.name!r} preempts calls in flight, which "
                             f"{type(engine).__name__} cannot suspend")
        self.engine = engine
        self.executor = executor or EngineExecutor(engine)
        self.models = list(engine.model_names)
        self.rounds = RoundScheduler(self.models)
        self.rates = RateBook(
            self.models,
            self.policy.rate_ewma_alpha,
            {m: engine.kv_bytes_per_token(m) for m in self.models},
        )
        self.executor.on_report.append(self.rates.observe)
        block_size = engine.stats().block_size
        # What one call may hold whenever it runs: the KV region, with the staging region
        # where the policy lends it (a call beyond the KV region makes its slot lend it)
        self._region_blocks = {m: engine.kv_capacity_blocks(m) for m in self.models}
        self._call_blocks = {
            m: call_capacity_blocks(self.policy, self._region_blocks[m],
                                    engine.kv_capacity_blocks(m, lent=True))
            for m in self.models}
        self.kv_capacity_tokens = {m: n * block_size for m, n in self._call_blocks.items()}
        self.calls = CallBook(self.models)
        self.counters: dict[str, int] = {
            "switches": 0,
            "preemptions": 0,
            "admitted": 0,
            "sp_admitted": 0,
            "sp_holds": 0,
            "reservations": 0,
            "reservations_consumed": 0,
            "reservations_expired": 0,
            "reservations_yielded": 0,
            "stages": 0,
            "engine_faults": 0,
            "departed": 0,
        }
        self.sessions = SessionKeeper(self.policy, self.executor, self.rates, self.counters)
        self.est = Estimator(self, self.calls, self.sessions, self.rates)
        self.loop = AdmissionLoop(
            instance_id, self, self.policy, self.executor, self.calls, self.sessions,
            self.est, self.rates, self.counters, engine.active_model, record_splits,
        )
        # a switch from the staging region ends its model's run of staging failures
        self.executor.on_report.append(self.loop.staging_retries.on_report)
        self._task: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self.hung = asyncio.Event()  # set by the watchdog: a live engine op has wedged
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._closing = False

    # the read-only view policies decide with ---------------------------------------------

    @property
    def active_model(self) -> str | None:
        """The engine's active model as of the last switch (read without touching the
        engine, so it is safe while an operation is in flight)."""
        return self.loop.active_model

    @property
    def slot(self) -> Slot | None:
        return self.loop.slot

    @property
    def residency(self) -> dict[str, Residency]:
        return self.loop.residency

    @property
    def stats(self) -> EngineStats:
        return self.loop.stats

    @property
    def healthy(self) -> bool:
        return self.loop.healthy

    @property
    def reservations(self) -> ReservationBook:
        return self.sessions.reservations

    def queued(self, model: str) -> Sequence[PendingCall]:
        return self.calls.queues[model]

    def others_waiting(self, model: str) -> int:
        return self.calls.others_waiting(model)

    def can_stage(self, model: str) -> bool:
        return self.executor.can_stage(model)

    def most_call_blocks(self, model: str) -> int:
        return self._call_blocks[model]

    def service(self, session_id: str, waiting_s: float) -> Service:
        return self.sessions.service(session_id, waiting_s)

    def best_waiting_key(self, calls: Sequence[PendingCall]) -> tuple[float, ...] | None:
        return self.sessions.best_waiting_key(calls, self.now())

    def now(self) -> float:
        """The instance clock: the event loop's time (virtual in simulation)."""
        loop = self._event_loop or asyncio.get_running_loop()
        return loop.time()

    # public API -------------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is not None:
            raise RuntimeError(f"instance {self.instance_id!r} already started")
        self._event_loop = asyncio.get_running_loop()
        self.loop.active_model = self.engine.active_model
        self.loop.refresh_engine_view()
        self._task = self._event_loop.create_task(
            self.loop.run(), name=f"admission-{self.instance_id}"
        )
        if not self.engine.simulated and self.policy.engine_op_timeout_s > 0:
            self._watchdog = self._event_loop.create_task(
                self._watch(self.policy.engine_op_timeout_s), name=f"watchdog-{self.instance_id}"
            )

    async def _watch(self, timeout_s: float) -> None:
        """Mark the instance unhealthy (and set ``hung``) once one engine operation has run
        for ``timeout_s``: the engine thread cannot be interrupted, so the process must go
        (``talaria.serving.instance_main`` exits and its supervisor restarts it)."""
        while True:
            await asyncio.sleep(min(1.0, timeout_s / 4))
            if self._wedged(timeout_s):
                return

    def _wedged(self, timeout_s: float) -> bool:
        """Whether the operation in flight now has run for ``timeout_s``; if so the instance
        is marked unhealthy and ``hung`` is set."""
        since = self.executor.busy_since
        if since is None or self.now() - since <= timeout_s:
            return False
        if not self.hung.is_set():
            log.error("engine_wedged", instance=self.instance_id, op=self.executor.busy,
                      seconds=self.now() - since)
        self.loop.healthy = False
        self.hung.set()
        return True

    async def stop(self, drain: bool = True) -> None:
        """Stop taking calls; with ``drain`` serve what is queued and running first,
        otherwise abort it. Live reservations are released.

        The operation in flight is watched while the loop winds down: one wedged past
        ``engine_op_timeout_s`` sets ``hung`` and the stop returns without waiting for it
        (the loop is cancelled, and every call it still had ends with an error; its thread
        cannot be, so the process must exit without joining it:
        ``talaria.serving.instance_main``; live reservations are not released on that path,
        as no engine call can be made). Only the operation in flight counts:
        ``hung`` set by an earlier one that has since returned is no reason to cancel."""
        self._closing = True
        if not drain:
            for pending in self.calls:
                self.abort(pending.call.call_id)
        self.loop.stopping = True
        self.loop.wake.set()
        task = self._task
        try:
            if task is not None and not await self._ended_or_wedged(task):
                log.error("engine_wedged_at_stop", instance=self.instance_id,
                          op=self.executor.busy)
                task.cancel()
                await asyncio.wait({task})  # ends at its next await; its outcome is dropped
                # no loop will end the calls it still had: end them here (no engine call)
                self.loop.faults.fail_all("the instance's engine wedged while it stopped")
                return
            if task is not None:
                await task  # its outcome (an exception raises here, as before)
        finally:
            self._task = None
            if self._watchdog is not None:
                self._watchdog.cancel()
        self.executor.close()

    async def _ended_or_wedged(self, task: asyncio.Task[None]) -> bool:
        """Wait for the admission loop to end (True) or the engine operation in flight to
        wedge past ``engine_op_timeout_s`` (False; never where no watchdog watches). The
        watchdog returns once it has set ``hung``, so the stop watches on its own: an
        operation that started after the one the watchdog found is judged by itself."""
        if self._watchdog is None:
            await asyncio.wait({task})
            return True
        timeout_s = self.policy.engine_op_timeout_s
        while not task.done():
            await asyncio.wait({task}, timeout=min(1.0, timeout_s / 4))
            if not task.done() and self._wedged(timeout_s):
                return False
        return True

    async def wait_until_stopped(self) -> None:
        """Return when the admission loop has ended: stopped, or given up after engine
        faults (then ``healthy`` is False)."""
        if self._task is not None:
            await asyncio.shield(self._task)

    def submit(self, call: CallRequest) -> CallHandle:
        """Queue a call; iterate the returned handle for its events.

        Raises ValueError for a malformed call, Overloaded when ``max_queue_calls`` calls are
        already queued, InstanceUnavailable when the instance is stopping or failed."""
        if self._closing or not self.healthy or self._task is None or self._task.done():
            raise InstanceUnavailable(f"instance {self.instance_id!r} is not accepting calls")
        if call.model not in self.calls.queues:
            raise ValueError(
                f"model {call.model!r} is not served by instance {self.instance_id!r} "
                f"(models: {self.models})"
            )
        if not call.prompt_token_ids:
            raise ValueError(f"call {call.call_id!r} has an empty prompt")
        if call.call_id in self.calls:
            raise ValueError(f"call id {call.call_id!r} is already in flight")
        queued = self.calls.num_queued()
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
        pending.need_blocks = self._need_blocks(call)
        self.calls.add(pending)
        self.loop.split.arrive(call.call_id, call.model, now)
        self.loop.wake.set()
        self.executor.interrupt()
        return handle

    def _need_blocks(self, call: CallRequest) -> int:
        """The KV blocks admission counts for ``call``: its prompt and expected answer; its
        longest answer where that outgrows the KV region but fits with the staging region
        lent, so the call runs only where the region is lent (the engines refuse a request
        that may outgrow the KV cache they have)."""
        block_size = self.stats.block_size
        need = blocks_for(call, self.loop.est.expected_output(call), block_size)
        longest = blocks_for(call, call.params.max_tokens, block_size)
        if self._region_blocks[call.model] < longest <= self._call_blocks[call.model]:
            need = max(need, longest)
        return need

    async def stream(self, call: CallRequest) -> AsyncIterator[CallEvent]:
        """``submit`` as an async generator; closing it early aborts the call."""
        handle = self.submit(call)
        try:
            async for event in handle:
                yield event
        finally:
            handle.abort()

    def abort(self, call_id: str, answered: bool = False) -> bool:
        """Abort a queued or running call; False if it is unknown or already finished.
        ``answered``: its caller has the answer it wanted (a stop string, a finished tool
        call), so a running call ends as a finished one does: its session's KV and books are
        kept, as for the session's next call (a reservation included)."""
        pending = self.calls.by_id.get(call_id)
        if pending is None:
            return False
        if pending.admitted is None:
            self.loop.finish(pending, "abort", None)
        else:
            self.loop.aborts.append(call_id)
            if answered:
                self.loop.answered.add(call_id)
            self.loop.wake.set()
            self.executor.interrupt()
        return True

    def state(self) -> InstanceState:
        return build_state(self)

    def forget_sessions(self, session_ids: Sequence[str]) -> None:
        """The router no longer holds these sessions: the loop forgets them here too (it
        alone touches the engine). Only sessions known here wake it: a turn at another
        moment is another schedule."""
        known = [s for s in session_ids if self.sessions.known(s)]
        if known:
            self.loop.to_forget.update(known)
            self.loop.wake.set()

    def release_reservations(self, session_ids: Sequence[str]) -> None:
        """These sessions' calls went to another instance: the loop releases their soft
        reservations here (their KV stays cached, unpinned, for a return); only ones it may
        release wake it (``SessionKeeper.releasable``)."""
        held = self.sessions.releasable(session_ids)
        if held:
            self.loop.to_release.update(held)
            self.loop.wake.set()
