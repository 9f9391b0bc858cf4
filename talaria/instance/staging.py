"""Staging copies that fail: counted, and their model not staged again before a backoff.

A staging copy fails either at once (the engine's ``stage`` raises) or in the background
(the live engine tells of it once the copy has ended: ``take_staging_failures``). Either
way it staged nothing: the model is in host memory only, and a switch to it is the ordinary
host-to-device copy. Its next try waits ``staging_retry_backoff_s``, doubling with each
failure in a row up to ``2**MAX_BACKOFF_DOUBLINGS`` times that, on the instance's clock: a
failed copy most likely fails again (a broken link, pinned memory exhausted), and the
admission loop, which looks for a model to stage at every turn with calls running, would
otherwise start another copy beside the running model at every engine step. A copy of the
model seen complete (``Residency.STAGED``) ends its run of failures, and so does a switch to
the model from the staging region (``on_report``: a copy that completed while the last calls
of the outgoing model ended is switched to before any turn sees it STAGED).

Such a failure is no engine fault: the calls running on the active model are not touched.
The simulated engine's copies never fail, so the simulation never meets any of this.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import structlog

from engine.interface import MoveReport, Residency, StepResult
from substrate.moves import MoveKind

log = structlog.get_logger("talaria.staging")

__all__ = ["MAX_BACKOFF_DOUBLINGS", "StagingRetries"]

MAX_BACKOFF_DOUBLINGS = 8  # the longest wait is 256 x the first


class StagingRetries:
    """Per model: failures in a row and when it may be staged again. Counts every failure
    in ``counters["staging_failures"]``."""

    def __init__(self, instance_id: str, backoff_s: float, counters: dict[str, int]) -> None:
        if not backoff_s > 0:
            raise ValueError(f"a staging retry backoff must be > 0 s, got {backoff_s!r}")
        self.instance_id = instance_id
        self.backoff_s = backoff_s
        self.counters = counters
        self._failures: dict[str, int] = {}  # failures in a row
        self._retry_at: dict[str, float] = {}

    def may_stage(self, model: str, now: float) -> bool:
        """Whether ``model``'s backoff (if any) is over at loop time ``now``."""
        return now >= self._retry_at.get(model, now)

    def failed(self, model: str, now: float) -> float:
        """A copy of ``model`` failed (seen at ``now``); returns the wait before its next."""
        failures = self._failures.get(model, 0) + 1
        self._failures[model] = failures
        wait = self.backoff_s * 2 ** min(failures - 1, MAX_BACKOFF_DOUBLINGS)
        self._retry_at[model] = now + wait
        self.counters["staging_failures"] = self.counters.get("staging_failures", 0) + 1
        log.warning("staging_backoff", instance=self.instance_id, model=model,
                    failures_in_a_row=failures, retry_in_s=wait)
        return wait

    def on_report(self, op: str, report: StepResult | MoveReport, model: str | None) -> None:
        """An executor report (``EngineExecutor.on_report``): a switch that copied the
        weights from the staging region proves its model's last copy whole."""
        if (model is not None and model in self._failures
                and getattr(report, "kind", None) == MoveKind.ACTIVATE_D2D):
            del self._failures[model]
            self._retry_at.pop(model, None)

    def observe(self, failed: Iterable[str], residency: Mapping[str, Residency],
                now: float) -> None:
        """Book the background failures the engine told of (``failed``); a model now
        STAGED has staged whole since its failures, which end."""
        for model in failed:
            self.failed(model, now)
        if self._failures:
            for model in [m for m in self._failures if residency.get(m) == Residency.STAGED]:
                del self._failures[model]
                self._retry_at.pop(model, None)
