"""Where each session's time goes: its SCT split into what it would take alone and why it
took longer.

Per session, the parts (seconds) add up to its SCT:

- ``own``: its calls' own compute, what each call takes with the session alone on the server
  (the isolated bound's duration of the same call);
- ``queue``: queueing behind calls of its own model (waiting in an open slot of its model, or
  running slower than alone because the batch is shared);
- ``slot_wait``: waiting for its model's slot (other models served, or a closed slot);
- ``switch``: model switches (weights, and KV moved with them) while it waited;
- ``recompute``: prefilling KV an earlier call of the session had computed;
- ``restore``: copying its KV back from host memory (what the copy adds to its prefill);
- ``tool_gaps``: the client's time between its calls.

The instance's ``TimeSplit`` gives each call's switch / slot-wait / queue / service seconds;
service is split here with the cost model: recompute and restore are priced, own compute is
the isolated duration, and queueing takes what is left.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from engine.sim.engine import SimEngine

__all__ = ["PARTS", "CallTimes", "attach_splits", "call_parts", "session_parts"]

PARTS = ("own", "queue", "slot_wait", "switch", "recompute", "restore", "tool_gaps")


class CallTimes(Protocol):
    """What the split needs of one replayed call (``workloads.replay.driver.CallRecord``)."""

    index: int
    sent_s: float
    done_s: float
    prompt_tokens: int
    cached_tokens: int
    restored_tokens: int
    instance_id: str | None
    split: dict[str, float] | None
    recompute_s: float
    restore_s: float

    @property
    def recomputed_tokens(self) -> int: ...


class SessionCalls(Protocol):
    session_id: str
    model: str

    @property
    def calls(self) -> Sequence[CallTimes]: ...


def attach_splits(
    sessions: Iterable[SessionCalls], splits: Mapping[str, dict[str, float]],
    engines: Mapping[str, SimEngine],
) -> None:
    """Give every call its instance time split and the price of its KV rebuild."""
    for session in sessions:
        for call in session.calls:
            call.split = splits.get(f"{session.session_id}#{call.index}")
            engine = engines.get(call.instance_id or "")
            if engine is None:
                continue
            cost = engine.cost_model(session.model)
            prefilled = call.prompt_tokens - call.cached_tokens
            recomputed = min(call.recomputed_tokens, max(0, prefilled - 1))
            if recomputed:
                call.recompute_s = cost.prefill_seconds(prefilled, call.cached_tokens) - (
                    cost.prefill_seconds(prefilled - recomputed, call.cached_tokens + recomputed)
                )
            if call.restored_tokens:
                # what the copy adds to the call's prefill, as the tier overlaps them
                tier = engine.host_tier
                compute = cost.prefill_seconds(max(1, prefilled), call.cached_tokens)
                copy = tier.restore_seconds(cost, call.restored_tokens)
                call.restore_s = max(0.0, tier.step_seconds(cost, compute, copy) - compute)


def call_parts(call: CallTimes, own_s: float | None) -> dict[str, float]:
    """The call's time (sent -> done) by part; ``own_s``: its duration alone (None: unknown,
    then whatever its service does not spend on KV rebuild counts as its own)."""
    duration = call.done_s - call.sent_s
    split = call.split or {}
    inside = sum(split.values())
    service = split.get("service", 0.0)
    rebuild = call.recompute_s + call.restore_s
    own = own_s if own_s is not None else max(0.0, service - rebuild)
    if call.split is None:  # the instance kept no record (e.g. the call failed)
        return {**dict.fromkeys(PARTS, 0.0), "slot_wait": duration}
    return {
        "own": own,
        "queue": split.get("queue", 0.0) + service - own - rebuild,
        "slot_wait": split.get("slot_wait", 0.0) + duration - inside,
        "switch": split.get("switch", 0.0),
        "recompute": call.recompute_s,
        "restore": call.restore_s,
        "tool_gaps": 0.0,
    }


def session_parts(
    calls: Sequence[CallTimes], own_of: Mapping[int, float] | None
) -> dict[str, float]:
    """A session's SCT by part; ``own_of``: each call's duration alone, by call index (None
    for the isolated run itself: every call is then all its own)."""
    total = dict.fromkeys(PARTS, 0.0)
    for k, call in enumerate(calls):
        if own_of is None:
            total["own"] += call.done_s - call.sent_s
        else:
            for part, seconds in call_parts(call, own_of.get(call.index)).items():
                total[part] += seconds
        if k + 1 < len(calls):
            total["tool_gaps"] += calls[k + 1].sent_s - call.done_s
    return total
