"""The round scheduler: models with pending work take slots round-robin.

A slot of model m admits m's queued calls until its quantum expires, or earlier by its closing
rule once another model waits (``slot_closes``: when m's queue is empty; when it is empty and
none of m's calls is in flight; only at the quantum). Then it closes: calls of m arriving
later wait for m's next slot, in-flight calls finish (or are suspended, with preemption), and
the next model in round order with pending work gets the instance. If m is the only model with
pending work its slot continues (or reopens) instead: there is nothing to switch to.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

__all__ = ["Slot", "RoundScheduler", "rotated_after", "slot_closes"]


def slot_closes(rule: str, *, queue_empty: bool, in_flight: bool, others_waiting: bool) -> bool:
    """Whether an open slot closes before its quantum under closing ``rule``
    (``talaria.policies.config.SLOT_CLOSE_RULES``). Never while no other model waits."""
    if not others_waiting:
        return False
    if rule == "empty":
        return queue_empty
    if rule == "drained":
        return queue_empty and not in_flight
    if rule == "quantum":
        return False
    raise ValueError(f"unknown slot closing rule {rule!r}")


@dataclass
class Slot:
    model: str
    opened: float
    quantum_s: float
    closed_at: float | None = None  # loop time the slot closed (None: open)
    sp_used_s: float = 0.0  # estimated extra slot time session-prefill has added
    sp_given_up: set[str] = field(default_factory=set)  # sessions SP stopped waiting for
    switch_s: float = 0.0  # what the switch that opened it cost (0: no switch)

    @property
    def open(self) -> bool:
        return self.closed_at is None

    @property
    def ends(self) -> float:
        """When its quantum expires."""
        return self.opened + self.quantum_s

    def quantum_expired(self, now: float) -> bool:
        return now >= self.ends

    def close(self, now: float) -> None:
        if self.closed_at is None:
            self.closed_at = now


def rotated_after(order: Sequence[str], current: str | None) -> list[str]:
    """``order`` rotated to start after ``current`` (``current`` last; unchanged when
    ``current`` is None or not in it)."""
    start = order.index(current) + 1 if current in order else 0
    return [order[(start + i) % len(order)] for i in range(len(order))]


class RoundScheduler:
    def __init__(self, models: list[str]) -> None:
        if not models:
            raise ValueError("an instance needs at least one model")
        self.order = list(models)

    def after(self, current: str | None) -> list[str]:
        """Every model in round order starting after ``current`` (``current`` last; from the
        first model when ``current`` is None or unknown)."""
        return rotated_after(self.order, current)

    def next_model(self, current: str | None, has_work: Callable[[str], bool]) -> str | None:
        """The next model after ``current`` in round order with pending work; ``current``
        itself comes last (it is chosen only when no other model has work)."""
        return next((m for m in self.after(current) if has_work(m)), None)

    def models_before(self, current: str | None, target: str) -> list[str]:
        """Models that come after ``current`` and before ``target`` in round order."""
        if target not in self.order:
            raise ValueError(f"unknown model {target!r}")
        rotation = self.after(current)
        return rotation[: rotation.index(target)]

    def wait_s(
        self,
        current: str | None,
        target: str,
        *,
        current_open: bool,
        current_left_s: float,
        has_work: Callable[[str], bool],
        slot_s: Callable[[str], float],
        switch_s: Callable[[str], float],
    ) -> float:
        """Estimated seconds until ``target``'s slot opens.

        0 when ``target`` holds the open slot. Otherwise: what is left of the current slot,
        then each model ahead of ``target`` in round order that has work (its switch and its
        slot), then the switch to ``target``. A closed slot of ``target`` itself waits for
        a whole round unless no other model has work (then it reopens at once).
        """
        if target == current and current_open:
            return 0.0
        ahead = [m for m in self.models_before(current, target) if m != current and has_work(m)]
        if target == current and not ahead:
            return current_left_s
        return current_left_s + sum(switch_s(m) + slot_s(m) for m in ahead) + switch_s(target)
