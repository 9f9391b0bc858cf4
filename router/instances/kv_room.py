"""How much a call may hold: its model's context length, and the KV cache of the instances
that serve the model.

Each instance reports, per model, the most tokens (prompt and output) one call can hold in
its KV cache whenever it runs (``ModelState.kv_capacity_tokens``). A call beyond that on
every instance serving its model can never run: admission refuses it with a 400 naming the
limit before it is accepted (the instance would otherwise accept it and fail it later, which
clients take for the server's fault and retry). Until every instance that may serve the
model has reported, the capacity is unknown and only the context bounds the call (each
instance still refuses, with a 400, what it cannot hold).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from talaria.protocol import InstanceState, Residency

__all__ = ["OutputRoom", "kv_capacity", "output_room"]


def kv_capacity(
    states: Mapping[str, InstanceState], instances: Collection[str], model: str
) -> int | None:
    """The most tokens one call of ``model`` can hold on any of ``instances`` that serves
    it, from their last reports; None while one of them has not reported it."""
    best = 0
    for instance_id in instances:
        state = states.get(instance_id)
        if state is None:
            return None
        ms = state.models.get(model)
        if state.models and (ms is None or ms.residency == Residency.ABSENT):
            continue  # it does not serve the model
        if ms is None or ms.kv_capacity_tokens <= 0:
            return None
        best = max(best, ms.kv_capacity_tokens)
    return best or None


@dataclass(frozen=True)
class OutputRoom:
    """The most output tokens a call may ask for, and what bounds it (for messages)."""

    tokens: int
    limit: str
    kv_bound: bool  # the KV cache, not the context, is the tighter limit


def output_room(model: str, prompt_len: int, context_len: int, capacity: int | None) -> OutputRoom:
    """Room left after a prompt of ``prompt_len`` tokens: the smaller of the context's and the
    KV cache's (``capacity``, None: unknown). ``tokens`` < 1: the prompt leaves none."""
    context = OutputRoom(context_len - prompt_len,
                         f"the context length of {model!r} is {context_len}", False)
    if capacity is None or capacity >= context_len:
        return context
    return OutputRoom(capacity - prompt_len,
                      f"the KV cache of the instances serving {model!r} holds {capacity} "
                      "tokens of one call (prompt and output)", True)
