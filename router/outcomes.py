"""How a call ends before its last event: the refusals ``RouterCore.submit`` raises, and the
``outcome`` label each end gets in ``talaria_router_requests_total``."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, fields
from enum import Enum

from talaria.protocol import CallEvent, Overloaded

__all__ = [
    "INSTANCE_SHUTDOWN_ERROR", "SHUTDOWN_ERROR", "CallRejected", "InstancesShuttingDown",
    "NoHealthyInstance", "ShutDown", "ShutDownEvent", "call_outcome", "cut_by",
]

# The error text (for the logs) of a call the router cut as it shut down (the drain over) ...
SHUTDOWN_ERROR = "the router is shutting down"
# ... and of one its instance aborted as that instance shut down, after the call's first
# event (``router.instances.shutdowns``). Neither is read back: the API knows such a call by
# its ``ShutDownEvent``.
INSTANCE_SHUTDOWN_ERROR = "its instance is shutting down"


class ShutDown(Enum):
    """Who shut down under a call after its first event; the value is who its API names."""

    ROUTER = "the server"
    INSTANCE = "the instance serving the call"


@dataclass
class ShutDownEvent(CallEvent):
    """The last event of a call cut by a shut-down: its API tells the client ``shut_down`` is
    shutting down (a 503 ``server_shutting_down``), not that the call failed on its instance.
    Only the router makes one (:func:`cut_by`), never from an instance's stream, so no text an
    instance sends can pass for it."""

    shut_down: ShutDown = ShutDown.ROUTER


def cut_by(event: CallEvent, who: ShutDown) -> ShutDownEvent:
    """``event`` (finished, its tokens kept) as the end of a call ``who``'s shut-down cut."""
    kept = {f.name: getattr(event, f.name) for f in fields(CallEvent)}
    kept.update(finished=True, error=SHUTDOWN_ERROR if who is ShutDown.ROUTER else INSTANCE_SHUTDOWN_ERROR)
    return ShutDownEvent(**kept, shut_down=who)


class NoHealthyInstance(RuntimeError):
    """No healthy instance can take the call (or the router is shutting down)."""


class InstancesShuttingDown(NoHealthyInstance):
    """An instance the call was sent to shut down before its first event, and no other
    could take it: its client is told so, a 503 ``server_shutting_down``
    (``router.api.stream_commit.call_error``)."""


class CallRejected(RuntimeError):
    """The instance refused the call as invalid (its 4xx other than 429)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def call_outcome(exc: BaseException, opened: bool) -> str:
    """How a call that raised before its last event ends in the metrics: ``aborted`` (its
    consumer stopped after the first event: a client gone; an answer whole is ``ok``), ``client_left``
    (cancelled before its first event), ``rejected`` (the instance refused it as invalid: the
    client's error), ``overloaded``, else ``error``."""
    if opened:
        return "aborted"
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        return "client_left"
    if isinstance(exc, CallRejected):
        return "rejected"
    return "overloaded" if isinstance(exc, Overloaded) else "error"
