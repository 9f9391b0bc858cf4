"""What the router and the instances agree on: the only part of ``talaria`` the router imports.

- ``messages``: the dataclasses that cross the router/instance boundary (calls, events,
  instance state) and the ``InstanceClient`` protocol (HTTP live, direct call in simulation);
- ``errors``: the HTTP error type and middleware both servers answer errors with;
- ``http``: what both servers do alike (key check, body deadline, a client that left);
- ``fields``: reading untrusted JSON field by field (type and range, named errors);
- ``text``: how both sides name prompt prefixes (the engine's block-hash chain) and turn
  tokens into text (one detokenizer, one stop-string matcher).

May import: ``engine`` (its interface, sampling parameters, block hash and detokenizer).
"""

from talaria.protocol.messages import (
    SHUTTING_DOWN,
    CallEvent,
    CallRequest,
    CallUsage,
    InstanceClient,
    InstanceShuttingDown,
    InstanceState,
    InstanceUnavailable,
    InstanceUnreachable,
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
    "InstanceShuttingDown",
    "InstanceState",
    "InstanceUnavailable",
    "InstanceUnreachable",
    "ModelState",
    "Overloaded",
    "Residency",
    "SamplingParams",
    "SHUTTING_DOWN",
    "SessionKV",
    "to_json",
]
