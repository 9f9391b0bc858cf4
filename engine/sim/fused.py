"""A fused decode step in flight, and cutting it short when the admission loop must act.

The simulated engine prices a run of consecutive decode-only steps as one step
(``engine.sim.step_time.fusable_steps``); a live engine would run them one by one, with the
admission loop free to act between any two. ``FusedRun`` keeps what the engine did for the
run so that a call reaching the instance meanwhile (``SimEngine.cut_fused``, called by the
executor on the virtual clock) ends it at the first step boundary at or after that moment,
as a live loop would admit the call after the step in progress: the steps past the cut are
undone (each request gives back its tokens past the boundary, the result reports the steps
kept and their time).

Invariants the cut relies on: no request finishes inside a fused run (fusion stops one step
before the first request's last token, so the finishing step runs alone); a run's steps are
priced by one ``DecodeLine``, so the boundary of step j is the line's first j steps (scaled
by the run's own price, which may include host-store time spread evenly over its steps).
Blocks allocated and prefix-cached for tokens that are then undone stay with the request:
its synthetic tokens are a function of position, so it samples the same ones again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.interface import StepResult
from engine.request import Request, token_event
from engine.sim.step_time import DecodeLine

__all__ = ["FusedRun"]


@dataclass
class FusedRun:
    result: StepResult  # the step's result, handed to the executor (cut in place)
    line: DecodeLine
    context: int  # the decodes' summed context at the run's first step
    steps: int
    decoded: list[tuple[int, Request, list[int]]]  # (index in result.events, request, tokens)
    scale: float = field(init=False)  # the run's price over its line's: fixed by a cut too

    def __post_init__(self) -> None:
        whole = self.line.seconds(self.context, self.steps)
        self.scale = self.result.seconds / whole if whole > 0 else 0.0

    def boundary_s(self, steps: int) -> float:
        """Seconds from the run's start to the end of its ``steps``-th step."""
        if steps >= self.steps:
            return self.result.seconds
        return self.scale * self.line.seconds(self.context, steps)

    def steps_by(self, elapsed_s: float) -> int:
        """The fewest steps whose end is at or after ``elapsed_s`` (at least 1)."""
        lo, hi = 1, self.steps
        while lo < hi:
            mid = (lo + hi) // 2
            if self.boundary_s(mid) >= elapsed_s:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def cut(self, keep: int) -> float:
        """Keep the run's first ``keep`` steps (1 <= keep < steps); returns the seconds given
        back. Each request loses its tokens past the cut; the result reports what is kept."""
        if not 1 <= keep < self.steps:
            raise ValueError(f"a fused run of {self.steps} steps cannot be cut to {keep}")
        drop = self.steps - keep
        for index, req, tokens in self.decoded:
            if req.is_finished:
                raise RuntimeError(f"request {req.request_id!r} finished inside a fused run")
            del req.output_token_ids[-drop:]
            req.num_computed_tokens -= drop
            self.result.events[index] = token_event(req, tokens[:keep])
        before = self.result.seconds
        kept_s = self.boundary_s(keep)
        self.result.seconds = kept_s
        self.result.num_decode_tokens = len(self.decoded) * keep
        self.result.num_steps = keep
        self.steps = keep
        return before - kept_s
