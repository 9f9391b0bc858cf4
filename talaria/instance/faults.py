"""How an admission loop lives through engine faults.

An exception from the engine (or from the loop's own bookkeeping around it) is a *fault*: the
loop fails the calls the engine held, takes them out of the engine, waits a backoff, and goes
on. Faults in a row without progress in between (a step that delivered events, or a switch
that completed) mean the engine is broken beyond one call: after ``max_consecutive`` of them
the loop gives up, fails every call and stops, so the instance reports unhealthy and its
supervisor can restart it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FaultBudget"]


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
