"""How long the router waits on an instance, on every hop of a call.

- ``first_token_s``: from sending a call to its first event (its first token, or its end),
  on top of the wait the instance itself last reported for the call's model (until its slot
  opens, then its queued prefill): a call that waits its turn for a model's slot is not an
  instance that hangs. Missed: the call is aborted there and retried on the next-best
  instance, as when the instance cannot be reached.
- ``stall_s``: between two events of a call after its first. Missed: the call is aborted
  there and its client gets an error event (a retry could repeat tokens already sent).
- ``state_s``: one poll of an instance's state. Missed: the poll counts as failed.
- ``down_grace_s``: once an instance is marked down for not answering, how long any wait of
  a call on it may still last (``router.instances.waits``). Missed: re-placed before the
  first event, an error event after it.

Either call deadline missed counts against the instance's health (``router.instances.health``). A call
deadline of None means none: the simulated cluster runs so (its instances never hang, and a
call may rightly wait minutes for its model's slot: that wait is what the benchmark measures).
"""

from __future__ import annotations

from dataclasses import dataclass

from talaria.protocol import InstanceState, InstanceUnavailable

__all__ = ["Deadlines", "DeadlineMissed", "first_token_deadline"]


@dataclass(frozen=True)
class Deadlines:
    first_token_s: float | None = 300.0
    stall_s: float | None = 60.0
    state_s: float = 2.0
    down_grace_s: float = 1.0

    def __post_init__(self) -> None:
        for name in ("first_token_s", "stall_s", "state_s", "down_grace_s"):
            value = getattr(self, name)
            if value is None and name in ("first_token_s", "stall_s"):
                continue
            if not (isinstance(value, int | float) and value > 0):
                raise ValueError(f"{name} must be > 0, got {value!r}")

    @classmethod
    def none_on_calls(cls) -> Deadlines:
        """No call deadlines (state polls keep theirs): for the simulated cluster."""
        return cls(first_token_s=None, stall_s=None)


def first_token_deadline(
    deadlines: Deadlines, state: InstanceState | None, model: str
) -> float | None:
    """Seconds a call of ``model`` may take to its first event on an instance whose last
    report is ``state``: ``first_token_s`` plus the wait the instance reported (its model's
    slot, then prefilling what is queued ahead). None: no deadline."""
    if deadlines.first_token_s is None:
        return None
    ms = state.models.get(model) if state is not None else None
    if ms is None:
        return deadlines.first_token_s
    queued = ms.queued_tokens / ms.prefill_tokens_per_s if ms.prefill_tokens_per_s > 0 else 0.0
    return deadlines.first_token_s + max(0.0, ms.wait_s) + queued


class DeadlineMissed(InstanceUnavailable):
    """An instance did not produce a call's next event in time."""
