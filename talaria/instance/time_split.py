"""Where each call's time inside an instance goes, by what the instance was doing meanwhile.

The admission loop tells ``TimeSplit`` what the instance is doing (``state``): switching
models (``SWITCH``: weights, and KV moved with the switch), serving a model's slot
(``serving(model, open)``), waiting for a GPU shared with other engines (``DEVICE_WAIT``), or
nothing (``IDLE``); and each call's phase changes (arrive, admit, suspend, resume, finish).
A call's time in each phase is charged to one category per instance state:

- queued (or suspended), its model's slot open: ``queue`` (behind calls of its own model);
- queued, any other model or no slot or a closed one: ``slot_wait``;
- any phase, during a switch: ``switch``; during a device wait: ``slot_wait``;
- running: ``service`` (split further by the benchmark into the call's own compute, KV
  rebuilt by recompute, KV restored from host, and queueing behind its own model).

So a finished call's categories add up exactly to its time in the instance. Time comes from
the caller (the event loop's clock). Bookkeeping is O(1) per event: cumulative seconds per
instance state, snapshotted when a call changes phase.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CATEGORIES", "DEVICE_WAIT", "IDLE", "SWITCH", "TimeSplit", "serving"]

CATEGORIES = ("switch", "slot_wait", "queue", "service")

StateKey = tuple[str, ...]
SWITCH: StateKey = ("switch",)
DEVICE_WAIT: StateKey = ("device_wait",)
IDLE: StateKey = ("idle",)


def serving(model: str, slot_open: bool) -> StateKey:
    return ("serve", model, "open" if slot_open else "closed")


@dataclass
class _Call:
    model: str
    running: bool
    snapshot: dict[StateKey, float]
    split: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))


class TimeSplit:
    """``record``: keep each finished call's split in ``done`` (the benchmark reads them);
    a live instance leaves it off, so it keeps nothing per finished call."""

    def __init__(self, now: float, record: bool = False) -> None:
        self.record = record
        self._key: StateKey = IDLE
        self._since = now
        self._cumulative: dict[StateKey, float] = {}
        self._before_wait: StateKey | None = None
        self._calls: dict[str, _Call] = {}
        self.done: dict[str, dict[str, float]] = {}  # call id -> seconds per category

    def state(self, now: float, key: StateKey) -> None:
        """From ``now`` the instance is doing ``key``."""
        self._advance(now)
        if self._before_wait is not None:
            self._before_wait = key  # a device wait ends by returning to this
        else:
            self._key = key

    def device_wait(self, now: float, waiting: bool) -> None:
        """The instance's engine waits for (``waiting``) or got the shared device."""
        self._advance(now)
        if waiting and self._before_wait is None:
            self._before_wait, self._key = self._key, DEVICE_WAIT
        elif not waiting and self._before_wait is not None:
            self._key, self._before_wait = self._before_wait, None

    def arrive(self, call_id: str, model: str, now: float) -> None:
        self._advance(now)
        self._calls[call_id] = _Call(model, False, dict(self._cumulative))

    def admit(self, call_id: str, now: float) -> None:
        self._phase(call_id, now, running=True)

    def suspend(self, call_id: str, now: float) -> None:
        self._phase(call_id, now, running=False)

    def finish(self, call_id: str, now: float) -> None:
        """The call left the instance; its split is in ``done``."""
        call = self._calls.pop(call_id, None)
        if call is None:
            return
        self._advance(now)
        if self.record:
            self._charge(call)
            self.done[call_id] = call.split

    def _phase(self, call_id: str, now: float, running: bool) -> None:
        call = self._calls.get(call_id)
        if call is None:
            return
        self._advance(now)
        self._charge(call)
        call.running = running
        call.snapshot = dict(self._cumulative)

    def _charge(self, call: _Call) -> None:
        for key, total in self._cumulative.items():
            seconds = total - call.snapshot.get(key, 0.0)
            if seconds > 0:
                call.split[self._category(key, call)] += seconds

    @staticmethod
    def _category(key: StateKey, call: _Call) -> str:
        if key == SWITCH:
            return "switch"
        if key == DEVICE_WAIT:
            return "slot_wait"
        if call.running:
            return "service"
        if key == serving(call.model, True):
            return "queue"
        return "slot_wait"

    def _advance(self, now: float) -> None:
        if now > self._since:
            self._cumulative[self._key] = self._cumulative.get(self._key, 0.0) + now - self._since
        self._since = max(self._since, now)
