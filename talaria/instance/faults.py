"""How an admission loop lives through engine faults.

An exception from the engine (or from the loop's own bookkeeping around it) is a *fault*: the
calls the engine held fail with an error naming it and are taken out of the engine (their
blocks freed), and the loop goes on after a backoff. Faults in a row without progress in
between (a step that delivered events, or a switch that completed) mean the engine is broken
beyond one call: after ``max_consecutive`` of them the loop gives up, every call it still
has fails, and the instance reports unhealthy so its supervisor can restart it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import structlog

from talaria.instance.calls import CallBook
from talaria.instance.executor import EngineExecutor

log = structlog.get_logger("talaria.faults")

__all__ = ["EngineFaults", "FaultBudget"]


@dataclass
class FaultBudget:
    max_consecutive: int
    backoff_s: float
    max_backoff_s: float = 2.0
    consecutive: int = 0
    total: int = 0

    def __post_init__(self) -> None:
        if self.max_consecutive < 1:
            raise ValueError(f"max_consecutive must be >= 1, got {self.max_consecutive}")
        if self.backoff_s < 0:
            raise ValueError(f"backoff_s must be >= 0, got {self.backoff_s}")

    def fault(self) -> float | None:
        """Count a fault; the seconds to wait before going on (doubling with each fault in
        a row), or None when the budget is spent."""
        self.total += 1
        self.consecutive += 1
        if self.consecutive >= self.max_consecutive:
            return None
        return min(self.max_backoff_s, self.backoff_s * 2 ** (self.consecutive - 1))

    def progress(self) -> None:
        """The engine did useful work: earlier faults no longer count against it."""
        self.consecutive = 0


class EngineFaults:
    """What a fault does to an instance's calls. ``finish(pending, reason, event, error=)``
    is the loop's one way to end a call."""

    def __init__(
        self, instance_id: str, calls: CallBook, executor: EngineExecutor,
        finish: Callable[..., None], budget: FaultBudget,
    ) -> None:
        self.instance_id = instance_id
        self.calls = calls
        self.executor = executor
        self.finish = finish
        self.budget = budget

    def handle(self, exc: Exception) -> float | None:
        """Fail the calls in the engine and take them out of it; the backoff before going
        on, or None when the loop must give up (then every call has ended)."""
        log.exception("engine_fault", instance=self.instance_id, running=len(self.calls.running))
        error = f"engine fault: {type(exc).__name__}: {exc}"
        for pending in list(self.calls.running.values()):
            self.drop(pending.call.call_id)
            self.finish(pending, "error", None, error=error)
        backoff = self.budget.fault()
        if backoff is None:
            log.error("admission_loop_gave_up", instance=self.instance_id,
                      faults=self.budget.consecutive)
            self.fail_all(f"the instance failed: {error}")
        return backoff

    def fail_all(self, error: str) -> None:
        """End every call the instance still has (the loop is ending)."""
        for pending in self.calls:
            self.finish(pending, "error", None, error=error)

    def drop(self, call_id: str) -> None:
        """Take a call out of the engine (a failure to is logged: the engine is suspect)."""
        try:
            self.executor.abort(call_id)
        except Exception:
            log.exception("abort_after_fault_failed", instance=self.instance_id, call=call_id)
