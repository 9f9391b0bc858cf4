"""Calls on an instance that shuts down on its own (SIGTERM to ``talaria instance``, ``talaria
serve`` stopping its children): past its drain (``drain_timeout_s``) it aborts the calls it
still has, each last event marked ``abort_reason`` ``shutting_down``, and refuses new calls
with a 503 saying so (``talaria.serving.instance_server``; the HTTP client raises that as
``InstanceShuttingDown``).

The router reads either as the instance going away, not failing:
- before the call's first event (nothing of it has reached the client) the call is re-placed
  on the next-best instance, and that costs it none of its attempts (``RouterCore._open``);
  when no other instance takes it, the client is told the server is shutting down (a 503
  ``server_shutting_down``: ``InstancesShuttingDown``);
- after it, the call ends with a ``ShutDownEvent`` (``ShutDown.INSTANCE``), which its API
  tells as that 503 (a stream: its error event), never "the call failed on its instance".
Either way the instance takes no new call until a state poll finds it answering (its
restart, or a drain that did not end), and the call counts in ``call_failures`` with kind
``instance_shutdown``, not against the instance's health.
"""

from __future__ import annotations

from router.outcomes import InstancesShuttingDown, ShutDown, ShutDownEvent, cut_by
from talaria.protocol import SHUTTING_DOWN, CallEvent, InstanceShuttingDown

__all__ = ["ends_call", "ends_unanswered", "refusal", "told"]


def ends_call(event: CallEvent) -> bool:
    """``event`` ends its call because its instance shuts down."""
    return event.finished and event.abort_reason == SHUTTING_DOWN


def ends_unanswered(first: CallEvent) -> bool:
    """The call's first event is its end by its instance's shut-down, with no token: the
    client has had nothing of it, so it may go elsewhere."""
    return ends_call(first) and not first.token_ids


def told(event: CallEvent) -> ShutDownEvent:
    """The end by the shut-down as the router's API layer tells it (``OutputAssembler.add``):
    its tokens kept, a ``ShutDownEvent`` of the instance."""
    return cut_by(event, ShutDown.INSTANCE)


def refusal(errors: list[Exception]) -> InstancesShuttingDown | None:
    """Why a call no instance took is refused, when an instance it went to shut down under
    it (and none was only overloaded: that refusal says when to come back); None otherwise."""
    shut = [e for e in errors if isinstance(e, InstanceShuttingDown)]
    return InstancesShuttingDown(f"{shut[-1]}; no other instance could take the call") if shut else None
