"""One server's GPUs shared by simulated engines of several resident models (the oracle
schedule's machine, ``workloads.bounds.oracle``: every model resident at once, one engine per session).
Benchmark code: the instance's executor sees it only as a ``DeviceGate``.

A timed engine operation holds the device. Engines of the model holding it run together and
never slow one another (perfect batching within a model); engines of other models wait, so
steps of different models never overlap: the server's compute is time-shared step by step.
When the holding model's last operation ends, the device goes, at the end of that instant
(``call_soon``, so an engine that asks again at once competes too), to the model that
``DeviceSchedule`` picks among those waiting, with all of that model's waiting engines:

- ``fair``: the model that has waited longest (models take turns step by step);
- ``las`` / ``mas``: the model whose waiting session has the least / the most attained
  service (each request's ``priority``; smaller goes first);
- ``slots``: the next model in catalog order, after the holder has had the device for
  ``quantum_s`` (a slot schedule with free switches). Until then the holder's new requests
  join even while others wait; ``slot_close="quantum"`` keeps the device for the holder
  until its quantum ends even when it runs out of work (``"drained"`` hands it over then).
  After the quantum only requests of calls already in flight (``continuing``) may still
  join, unless ``preempt``.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from talaria.policies.round_scheduler import rotated_after

__all__ = ["DEVICE_ORDERS", "DeviceSchedule", "SharedDevice", "claim", "device_priority"]

DEVICE_ORDERS = ("fair", "las", "mas", "slots")


@dataclass(frozen=True)
class DeviceSchedule:
    order: str = "fair"
    slot_close: str = "drained"  # slots: "drained" | "quantum"
    quantum_s: float = math.inf  # slots
    preempt: bool = True  # slots: at the quantum, calls in flight wait too

    def __post_init__(self) -> None:
        if self.order not in DEVICE_ORDERS:
            raise ValueError(f"unknown device order {self.order!r}; known: {DEVICE_ORDERS}")
        if self.slot_close not in ("drained", "quantum"):
            raise ValueError(f"unknown slot close {self.slot_close!r}: drained | quantum")
        if not self.quantum_s > 0:
            raise ValueError(f"quantum_s must be > 0, got {self.quantum_s}")

    def to_dict(self) -> dict[str, Any]:
        """As JSON can hold it (an unbounded quantum is None)."""
        q = self.quantum_s if math.isfinite(self.quantum_s) else None
        return {"order": self.order, "slot_close": self.slot_close, "quantum_s": q,
                "preempt": self.preempt}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DeviceSchedule:
        q = data.get("quantum_s")
        return cls(data["order"], data["slot_close"], math.inf if q is None else q,
                   data["preempt"])

    @property
    def name(self) -> str:
        if self.order != "slots":
            return self.order
        mode = "preempt" if self.preempt else "drain"
        return f"slots {self.slot_close}/{self.quantum_s:g}s {mode}"


def device_priority(order: str, attained_s: Sequence[float]) -> float:
    """An engine's priority under ``order`` from the attained service of the sessions it
    has calls of (smaller goes first)."""
    if order in ("fair", "slots") or not attained_s:
        return 0.0
    if order == "las":
        return min(attained_s)
    if order == "mas":
        return -max(attained_s)
    raise ValueError(f"unknown device order {order!r}; known: {', '.join(DEVICE_ORDERS)}")


def claim(
    order: str, calls: Sequence[tuple[float, float | None]], now: float
) -> tuple[float, bool]:
    """An engine's request for the device: its priority under ``order`` and whether a call
    already in flight asks (not only calls admitted now). ``calls``: (the attained service
    of the call's session before it, when the call was admitted or None) for each call."""
    attained = [before + (now - admitted if admitted is not None else 0.0)
                for before, admitted in calls]
    continuing = any(admitted is not None and admitted < now for _, admitted in calls)
    return device_priority(order, attained), continuing


@dataclass(order=True)
class _Waiter:
    priority: float
    seq: int
    model: str
    continuing: bool
    future: asyncio.Future[None]


class SharedDevice:
    def __init__(
        self, models: Sequence[str], schedule: DeviceSchedule, clock: Callable[[], float]
    ) -> None:
        self.models = list(models)
        self.schedule = schedule
        self.clock = clock
        self.holder: str | None = None
        self.active = 0  # operations of the holder in progress
        self.since = 0.0  # when the holder got the device
        self._waiters: list[_Waiter] = []
        self._seq = itertools.count()
        self._handover_pending = False
        self._timer: asyncio.TimerHandle | None = None

    def claim(self, calls: Sequence[tuple[float, float | None]], now: float) -> tuple[float, bool]:
        """An engine's request under this device's order (``claim``)."""
        return claim(self.schedule.order, calls, now)

    async def acquire(self, model: str, priority: float = 0.0, continuing: bool = False) -> None:
        if self.holder is None and not self._handover_pending:
            self._take(model)
            self.active = 1
            return
        if self.holder == model and self._may_join(continuing):
            self.active += 1
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(priority, next(self._seq), model, continuing, future)
        self._waiters.append(waiter)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release(model)  # granted as it was cancelled
            raise

    def release(self, model: str) -> None:
        if model != self.holder or self.active <= 0:
            raise RuntimeError(f"{model!r} releases a device it does not hold")
        self.active -= 1
        if self.active == 0 and not self._handover_pending:
            self._handover_pending = True
            asyncio.get_running_loop().call_soon(self._handover)

    # internals --------------------------------------------------------------------------

    def _take(self, model: str) -> None:
        if model != self.holder:
            self.holder, self.since = model, self.clock()

    def _others_waiting(self) -> bool:
        return any(w.model != self.holder and not w.future.done() for w in self._waiters)

    def _within_quantum(self) -> bool:
        return self.clock() < self.since + self.schedule.quantum_s

    def _may_join(self, continuing: bool) -> bool:
        """Whether a request of the holder's model runs now, beside the holder's others."""
        if not self._others_waiting():
            return True
        if self.schedule.order != "slots":
            return False
        if self._within_quantum():
            return True
        return continuing and not self.schedule.preempt

    def _handover(self) -> None:
        self._handover_pending = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.active > 0:
            return  # the holder's engines asked again meanwhile
        self._waiters = [w for w in self._waiters if not w.future.done()]
        own = [w for w in self._waiters if w.model == self.holder]
        if self.schedule.order == "slots" and self.holder is not None and self._within_quantum():
            if own:
                self._grant(self.holder)
                return
            if self.schedule.slot_close == "quantum" and self._waiters:
                # the slot keeps the device until its quantum ends
                delay = self.since + self.schedule.quantum_s - self.clock()
                self._timer = asyncio.get_running_loop().call_later(delay, self._handover)
                return
        if not self._waiters:
            self.holder = None
            return
        self._grant(self._next_model())

    def _next_model(self) -> str:
        waiting = {w.model for w in self._waiters}
        order = self.schedule.order
        if order == "slots":
            return next(m for m in rotated_after(self.models, self.holder) if m in waiting)
        if order == "fair":
            return min(self._waiters, key=lambda w: w.seq).model
        return min(self._waiters).model  # las / mas: by priority, then arrival

    def _grant(self, model: str) -> None:
        self._take(model)
        granted = [w for w in self._waiters if w.model == model]
        self._waiters = [w for w in self._waiters if w.model != model]
        for waiter in granted:
            self.active += 1
            waiter.future.set_result(None)
