"""Runs engine operations so that their time is spent on the right clock.

Live engine: every blocking operation runs on one dedicated worker thread
(``loop.run_in_executor``), so the event loop keeps serving HTTP and timers while a step or a
weight copy is in progress; the time has passed when the call returns.

Simulated engine (``engine.simulated``): the operation is called directly (no thread) and
returns the seconds its cost model predicts; the executor then ``await asyncio.sleep``s that
long, so the virtual clock advances by exactly the modelled duration. ``stage`` is the one
exception: staging is a background copy, so it is started and not waited for (the engine's
residency tells when it is ready).

Invariant: at most one timed operation is in flight, and the cheap synchronous calls
(``add_request``, ``abort``, ``pin_session_kv``...) are refused while one is, so the engine is
never touched from two threads at once.

Simulated engines that share one server's GPUs (several models resident at once) share a
``device`` (a ``DeviceGate``: the benchmark's ``workloads.bounds.shared_device.SharedDevice``): a timed
operation first waits for it, as ``device_request`` says (its priority, and whether it
continues a call in flight), so operations of different models never overlap in time;
``on_device_wait`` hears when a wait starts and ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, TypeVar

from engine.interface import (
    EngineRequest,
    EngineStats,
    FinishReason,
    MoveReport,
    MultiModelEngineProtocol,
    Residency,
    StepResult,
    TokenEvent,
)

T = TypeVar("T")

__all__ = ["DeviceGate", "EngineExecutor", "EngineBusy"]


class DeviceGate(Protocol):
    """GPUs shared by the simulated engines of several resident models: a timed operation of
    ``model`` holds it between ``acquire`` and ``release``."""

    def claim(self, calls: Sequence[tuple[float, float | None]], now: float) -> tuple[float, bool]:
        """(priority, continuing) of an engine's request, from (the attained service of the
        call's session before it, when it was admitted or None) for each of its calls."""
        ...

    async def acquire(self, model: str, priority: float = 0.0, continuing: bool = False) -> None:
        ...

    def release(self, model: str) -> None:
        ...


class EngineBusy(RuntimeError):
    """An engine call was attempted while another operation was in flight."""


class EngineExecutor:
    def __init__(
        self,
        engine: MultiModelEngineProtocol,
        thread_init: Callable[[], None] | None = None,
        device: DeviceGate | None = None,
    ) -> None:
        """``thread_init`` runs once on the live worker thread before its first op (e.g.
        ``torch.cuda.set_device`` for the rank's device)."""
        self.engine = engine
        self._thread_init = thread_init
        self.simulated = bool(getattr(engine, "simulated", False))
        if device is not None and not self.simulated:
            raise ValueError("a shared device times simulated engines only")
        self.device = device
        self.device_request: Callable[[], tuple[float, bool]] = lambda: (0.0, False)
        self.on_device_wait: list[Callable[[bool], None]] = []
        self._pool: ThreadPoolExecutor | None = None
        self._busy: str | None = None
        # the fused simulated step in flight: (its start, the future it sleeps on, its end)
        self._fused: tuple[float, asyncio.Future[None], asyncio.TimerHandle] | None = None
        self.busy_since: float | None = None  # loop time the operation in flight started
        self.on_report: list[Callable[[str, StepResult | MoveReport, str | None], None]] = []
        self._aborted: set[str] = set()  # ids aborted here whose abort event is still to come
        # background staging copies that failed (engines whose copies end in the background)
        self._staging_failures: Callable[[], list[str]] | None = getattr(
            engine, "take_staging_failures", None)
        self._hold_host_kv: Callable[[str, bool], None] | None = getattr(
            engine, "hold_host_kv", None)

    # timed operations -------------------------------------------------------------------

    async def step(self) -> StepResult:
        model = self.engine.active_model
        result = await self._timed("step", self.engine.step, lambda r: r.seconds)
        if self._aborted:
            result.events = self._without_abort_events(result.events)
        self._report("step", result, model)
        return result

    async def activate(self, model: str, lend_staging: bool = False) -> MoveReport:
        """Switch to ``model`` (``lend_staging``: its KV cache spans the staging region until
        the next switch; asked only then, so engines without the option keep working)."""
        if lend_staging:
            op = lambda: self.engine.activate(model, lend_staging=True)  # noqa: E731
        else:
            op = lambda: self.engine.activate(model)  # noqa: E731
        report = await self._timed("activate", op, _secs)
        self._report("activate", report, model)
        return report

    async def offload_kv(self, session_ids: list[str] | None = None) -> MoveReport:
        model = self.engine.active_model
        report = await self._timed("offload_kv", lambda: self.engine.offload_kv(session_ids), _secs)
        self._report("offload_kv", report, model)
        return report

    async def suspend(self) -> MoveReport:
        """Token-level preemption: the engine parks its unfinished requests (their KV goes
        to host) until their model is active again. Engines that cannot raise."""
        suspend = getattr(self.engine, "suspend", None)
        if suspend is None:
            raise NotImplementedError(f"{type(self.engine).__name__} cannot suspend requests")
        model = self.engine.active_model
        report = await self._timed("suspend", suspend, _secs)
        self._report("suspend", report, model)
        return report

    async def stage(self, model: str) -> MoveReport:
        """Start staging ``model``; in sim the copy runs in the background (no sleep)."""
        if self.simulated:
            self._check_idle("stage")
            report = self.engine.stage(model)
        else:
            report = await self._timed("stage", lambda: self.engine.stage(model), _secs)
        self._report("stage", report, model)
        return report

    # cheap synchronous calls ------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> None:
        self._check_idle("add_request")
        self.engine.add_request(request)

    def abort(self, request_id: str, keep_session: bool = False) -> None:
        """Abort ``request_id`` in the engine (``keep_session``: its blocks stay its session's
        remembered prefix, as a finished call's). The abort event the engine reports for it at
        its next step is not passed on: whoever aborts has ended the call already, and by that
        step a new call may use the same id (a client may reuse one), which that event would
        end."""
        self._check_idle("abort")
        self.engine.abort(request_id, keep_session)
        self._aborted.add(request_id)

    def has_unfinished(self) -> bool:
        self._check_idle("has_unfinished")
        return self.engine.has_unfinished()

    def stats(self) -> EngineStats:
        self._check_idle("stats")
        return self.engine.stats()

    def residency(self) -> dict[str, Residency]:
        self._check_idle("residency")
        return self.engine.residency()

    def can_stage(self, model: str) -> bool:
        return self.engine.can_stage(model)

    def hold_host_kv(self, session_id: str, held: bool) -> None:
        """Have the engine's host KV store evict the session's KV last (``held``) or as any
        other's; nothing on an engine without the method (the simulated one: its host store
        evicts least recently used first, whatever is reserved)."""
        if self._hold_host_kv is not None:
            self._check_idle("hold_host_kv")
            self._hold_host_kv(session_id, held)

    def take_staging_failures(self) -> list[str]:
        """Models whose background staging copies failed since the last call; none from an
        engine whose copies cannot fail in the background (it has no such method)."""
        if self._staging_failures is None:
            return []
        self._check_idle("take_staging_failures")
        return self._staging_failures()

    def kv_capacity_blocks(self, model: str, lent: bool = False) -> int:
        return self.engine.kv_capacity_blocks(model, lent)

    def pin_session_kv(self, session_id: str) -> int:
        self._check_idle("pin_session_kv")
        return self.engine.pin_session_kv(session_id)

    def unpin_session_kv(self, session_id: str) -> None:
        self._check_idle("unpin_session_kv")
        self.engine.unpin_session_kv(session_id)

    def session_kv_tokens(self, session_id: str) -> tuple[int, int]:
        self._check_idle("session_kv_tokens")
        return self.engine.session_kv_tokens(session_id)

    def forget_session(self, session_id: str) -> None:
        self._check_idle("forget_session")
        self.engine.forget_session(session_id)

    @property
    def active_model(self) -> str | None:
        """The engine's active model (a plain read, safe while an operation is in flight)."""
        return self.engine.active_model

    @property
    def busy(self) -> str | None:
        """Name of the operation in flight, or None."""
        return self._busy

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # internals --------------------------------------------------------------------------

    def _without_abort_events(self, events: list[TokenEvent]) -> list[TokenEvent]:
        """``events`` less the first abort event of each id aborted here (the engine reports
        one per request it held); once the engine has nothing left to report, no such event
        can come, so the ids it never held are forgotten."""
        kept = []
        for event in events:
            if event.finish_reason is FinishReason.ABORT and event.request_id in self._aborted:
                self._aborted.discard(event.request_id)
            else:
                kept.append(event)
        if self._aborted and not self.engine.has_unfinished():
            self._aborted.clear()
        return kept

    async def _timed(self, name: str, op: Callable[[], T], seconds: Callable[[T], float]) -> T:
        """Run ``op``: live on the engine thread, which stays busy until ``op`` returns even
        if the awaiting task is cancelled meanwhile (nothing else may touch the engine until
        then); in simulation, then sleep the seconds it reports on the loop's clock."""
        self._check_idle(name)
        loop = asyncio.get_running_loop()
        self._busy = name
        self.busy_since = loop.time()
        if not self.simulated:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="engine", initializer=self._thread_init
                )
            job = self._pool.submit(op)
            # Registered before wrap_future's own callback, so the engine is idle again
            # before the awaiting task resumes; if that task is cancelled, only when the
            # thread is really done.
            job.add_done_callback(lambda _job: loop.call_soon_threadsafe(self._idle))
            return await asyncio.wrap_future(job, loop=loop)
        try:
            if self.device is not None:
                for callback in self.on_device_wait:
                    callback(True)
                model = self.engine.active_model or ""
                await self.device.acquire(model, *self.device_request())
                try:
                    for callback in self.on_device_wait:
                        callback(False)
                    result = op()
                    await asyncio.sleep(max(0.0, seconds(result)))
                finally:
                    self.device.release(model)
            else:
                result = op()
                if name == "step" and getattr(result, "num_steps", 1) > 1:
                    await self._fused_sleep(loop, seconds(result))
                else:
                    await asyncio.sleep(max(0.0, seconds(result)))
        finally:
            self._idle()
        return result

    async def _fused_sleep(self, loop: asyncio.AbstractEventLoop, seconds: float) -> None:
        """Sleep through a fused simulated step, which ``interrupt`` may end sooner."""
        done: asyncio.Future[None] = loop.create_future()
        start = loop.time()
        self._fused = (start, done, loop.call_at(start + seconds, _resolve, done))
        try:
            await done
        finally:
            self._fused = None

    def interrupt(self) -> None:
        """Something for the admission loop to act on arrived (a call, an abort): a fused
        simulated step in flight ends at its next step boundary, as a live engine's loop
        would act after the step it is running (``engine.sim.fused``). Otherwise nothing.
        It touches the engine while that step is in flight, which only the simulation allows
        (its op has returned; the virtual clock runs nothing beside this callback); live,
        no step is ever fused, so this returns at once."""
        if self._fused is None:
            return
        cut = getattr(self.engine, "cut_fused", None)
        if cut is None:
            return
        start, done, timer = self._fused
        loop = asyncio.get_running_loop()
        seconds = cut(loop.time() - start)
        if seconds is not None:
            timer.cancel()
            self._fused = (start, done, loop.call_at(start + seconds, _resolve, done))

    def _idle(self) -> None:
        self._busy = None
        self.busy_since = None

    def _check_idle(self, name: str) -> None:
        if self._busy is not None:
            raise EngineBusy(f"engine call {name!r} while {self._busy!r} is in flight")

    def _report(self, kind: str, result: StepResult | MoveReport, model: str | None) -> None:
        for callback in self.on_report:
            callback(kind, result, model)


def _secs(report: MoveReport) -> float:
    return report.seconds


def _resolve(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)
