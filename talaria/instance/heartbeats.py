"""Heartbeats: an empty event for a call mid-answer that the engine holds without a step.

Once a call has sent its first token, its consumer expects its events to keep coming: the
router ends a call whose next event is later than its stall deadline (``Deadlines.stall_s``,
60 s) as a failed instance, and a client or proxy cuts a stream silent past its idle timeout.
Yet the engine can hold a running call for long without a step of its own: preempted for KV
blocks, it is recomputed only once the calls holding them have freed enough. The loop is alive
and serving then. (A call that token-level preemption parks until its model's next slot is
not running and gets none: no live engine suspends calls.)

So every ``period_s`` of the loop's clock, each running call whose output has not moved since
the previous sweep (at least ``period_s`` ago) and that has sent its first token gets an event
with no tokens (``CallEvent`` with ``token_ids`` empty, not finished): the router sees its
instance alive and the client's stream gets a keep-alive (``router.api.stream_keepalive``).
A call waits at most two periods for one. Calls whose consumer reads their ends only
(``CallHandle.holds_steps``: the simulated replay) get none; before the first token the
router's first-token deadline, which counts the instance's reported wait, applies instead.
Heartbeats come from the admission loop's own turns, so a wedged loop sends none and the
stall deadline still finds it; and only after a sweep period in which the engine ran a step,
so a loop whose engine runs nothing at all (a request waiting for blocks that never free)
sends none either. Nor do they keep a call alive for ever: one that has made no
progress for ``limit_s`` (the instance's ``engine_op_timeout_s``, after which an engine
operation counts as wedged) gets no more, so a request stuck in a live loop still ends at the
router's stall deadline.
"""

from __future__ import annotations

from collections.abc import Mapping

import structlog

from talaria.instance.calls import PendingCall
from talaria.protocol import CallEvent

__all__ = ["Heartbeats"]

log = structlog.get_logger("talaria.heartbeats")


class Heartbeats:
    def __init__(self, instance_id: str, period_s: float, limit_s: float,
                 counters: dict[str, int]) -> None:
        """``period_s``: seconds between sweeps, 0 sends none; ``limit_s``: a call held that
        long gets no more (0: no limit). Each heartbeat counts in ``counters["heartbeats"]``."""
        self.instance_id = instance_id
        self.period_s = period_s
        self.limit_s = limit_s
        self.counters = counters
        self._engine_ran = False  # a step ran something since the last sweep
        self._next_sweep = float("-inf")
        self._last_sweep = float("-inf")
        # call id -> (its output tokens at the last sweep, the sweep that first saw that many)
        self._seen: dict[str, tuple[int, float]] = {}

    def sweep(self, now: float, running: Mapping[str, PendingCall], stepped: bool) -> None:
        """After an engine step (``stepped``: it ran something), put a heartbeat on each
        running call that made no progress since the last sweep."""
        self._engine_ran |= stepped
        if self.period_s <= 0 or now < self._next_sweep:
            return
        self._next_sweep = now + self.period_s
        previous, self._last_sweep = self._last_sweep, now
        before, self._seen = self._seen, {}
        ran, self._engine_ran = self._engine_ran, False
        for call_id, pending in running.items():
            out = pending.out_tokens
            if out <= 0 or pending.handle.holds_steps:
                continue
            last, since = before.get(call_id, (-1, now))
            if last != out:
                since = now
            self._seen[call_id] = (out, since)
            if not ran or last != out:
                continue
            held_s = now - since
            if 0 < self.limit_s <= held_s:
                if previous - since < self.limit_s:  # the first sweep past the limit
                    log.warning("call_held_past_limit", instance=self.instance_id,
                                call_id=call_id, held_s=round(held_s, 3))
                continue
            pending.handle.put(CallEvent(call_id=call_id, instance_id=self.instance_id))
            self.counters["heartbeats"] = self.counters.get("heartbeats", 0) + 1
