"""What the router and the instances agree on: the only part of ``talaria`` the router imports.

- ``messages``: the dataclasses that cross the router/instance boundary (calls, events,
  instance state) and the ``InstanceClient`` protocol (HTTP live, direct call in simulation);
- ``errors``: the HTTP error type and middleware both servers answer errors with;
- ``text``: how both sides name prompt prefixes (the engine's block-hash chain) and turn
  tokens into text (one detokenizer, one stop-string matcher).

May import: ``engine`` (its interface, sampling parameters, block hash and detokenizer).
"""

from talaria.protocol.messages import (
    CallEvent,
    CallRequest,
    CallUsage,
    InstanceClient,
    InstanceState,
    InstanceUnavailable,
    ModelState,
    Overloaded,
    Residency,
    SamplingParams,
    SessionKV,
    to_json,
)

__all__ = [
    "CallEvent",
    "CallRequest",
    "CallUsage",
    "InstanceClient",
    "InstanceState",
    "InstanceUnavailable",
    "ModelState",
    "Overloaded",
    "Residency",
    "SamplingParams",
    "SessionKV",
    "to_json",
]
