"""What a policy may read of an instance: a narrow, read-only view (structural Protocols).

The instance (``talaria.instance.Instance``) satisfies ``InstanceView`` and its estimator
satisfies ``Estimates``; policies are written against these Protocols and never import the
instance, so the runtime depends on its policies and not the other way round. A policy
returns a decision; the instance carries it out (policies mutate nothing they are shown).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from engine.interface import Residency
from talaria.policies.config import PolicyConfig
from talaria.policies.priority import Service
from talaria.policies.reservations import Reservation
from talaria.policies.round_scheduler import RoundScheduler, Slot
from talaria.protocol import CallRequest

__all__ = ["Estimates", "InstanceView", "QueuedCall", "ReservationsView"]


class QueuedCall(Protocol):
    """A call waiting in a model's queue."""

    @property
    def call(self) -> CallRequest: ...

    @property
    def continuation(self) -> bool:
        """Its session has finished a call of this model on this instance before."""
        ...

    @property
    def arrived(self) -> float:
        """Loop time it arrived."""
        ...


class ReservationsView(Protocol):
    """The instance's live soft reservations, read-only."""

    def all(self) -> list[Reservation]: ...

    def for_model(self, model: str) -> list[Reservation]: ...

    def get(self, session_id: str) -> Reservation | None: ...


class Estimates(Protocol):
    """Time estimates in seconds, from the instance's measured (live) or modelled (sim) rates."""

    def service_s(self, call: CallRequest) -> float:
        """Prefill of the call's new suffix plus decode of its expected output."""
        ...

    def reserved_service_s(self, reservation: Reservation) -> float:
        """The same for the call a reservation expects (its size learned from the session)."""
        ...

    def rebuild_s(self, session_id: str, model: str) -> float:
        """What the session's KV costs to rebuild after a switch away and back."""
        ...

    def round_wait_s(self, model: str) -> float:
        """Other models' slots and switches a call of ``model`` waits for if its slot ends now."""
        ...

    def switch_back_s(self, model: str) -> float:
        """The switch back to ``model`` after a round."""
        ...

    def drain_left_s(self) -> float:
        """Until the calls in flight finish."""
        ...


class InstanceView(Protocol):
    """The facts of one instance a policy decides with."""

    @property
    def policy(self) -> PolicyConfig: ...

    @property
    def models(self) -> Sequence[str]: ...

    @property
    def rounds(self) -> RoundScheduler: ...

    @property
    def active_model(self) -> str | None: ...

    @property
    def slot(self) -> Slot | None: ...

    @property
    def residency(self) -> Mapping[str, Residency]: ...

    @property
    def reservations(self) -> ReservationsView: ...

    def now(self) -> float:
        """The instance clock: the event loop's time (virtual in simulation)."""
        ...

    def queued(self, model: str) -> Sequence[QueuedCall]: ...

    def others_waiting(self, model: str) -> int:
        """Calls queued for models other than ``model``."""
        ...

    def can_stage(self, model: str) -> bool:
        """Whether the model's weights fit the engine's staging region."""
        ...

    def most_call_blocks(self, model: str) -> int:
        """The most KV blocks one call of ``model`` can hold whenever it runs
        (``talaria.policies.staging.call_capacity_blocks``)."""
        ...

    def service(self, session_id: str, waiting_s: float) -> Service:
        """What the session has had so far (its current call waiting ``waiting_s``)."""
        ...

    def best_waiting_key(self, calls: Sequence[QueuedCall]) -> tuple[float, ...] | None:
        """The best priority key among ``calls`` now under the policy's admission order, each
        one's wait counted from its arrival (``priority.best_key`` over their ``service``);
        None when there are none."""
        ...
