"""What crosses the router/instance boundary, as plain dataclasses.

Serialised with orjson (``to_json`` / ``from_json``). The router speaks to instances only
through these types and the :class:`InstanceClient` protocol: over HTTP live, by direct call
inside a simulation.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import orjson

from engine.interface import Residency
from engine.sampling_params import SamplingParams

__all__ = [
    "CallRequest",
    "CallEvent",
    "CallUsage",
    "ModelState",
    "SessionKV",
    "InstanceState",
    "InstanceClient",
    "InstanceUnavailable",
    "Residency",
    "SamplingParams",
    "to_json",
]


class InstanceUnavailable(RuntimeError):
    """The instance could not be reached or failed before producing a first token."""


class Overloaded(RuntimeError):
    """The instance's queue is full; retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class CallRequest:
    call_id: str
    session_id: str
    model: str
    prompt_token_ids: list[int]
    params: SamplingParams
    expected_gap_s: float | None = None  # client hint: tool gap expected after this call
    last_call: bool = False  # client hint: the session ends after this call
    parent_session_id: str | None = None  # a subagent's session: the session that spawned it

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CallRequest:
        params = data.get("params") or {}
        return cls(
            call_id=str(data["call_id"]),
            session_id=str(data["session_id"]),
            model=str(data["model"]),
            prompt_token_ids=list(data["prompt_token_ids"]),
            params=SamplingParams(**params),
            expected_gap_s=data.get("expected_gap_s"),
            last_call=bool(data.get("last_call", False)),
            parent_session_id=data.get("parent_session_id"),
        )


@dataclass
class CallUsage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens not prefilled (device cache + host restore)
    restored_tokens: int = 0  # of those, restored from the host KV store


@dataclass
class CallEvent:
    """A streamed piece of a call: new tokens, and on the last event the finish."""

    call_id: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    usage: CallUsage | None = None
    instance_id: str | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CallEvent:
        usage = data.get("usage")
        return cls(
            call_id=data["call_id"],
            token_ids=list(data.get("token_ids") or []),
            logprobs=data.get("logprobs"),
            finished=bool(data.get("finished", False)),
            finish_reason=data.get("finish_reason"),
            error=data.get("error"),
            usage=CallUsage(**usage) if usage else None,
            instance_id=data.get("instance_id"),
        )


@dataclass
class ModelState:
    """One model on one instance: residency, pressure, and rates for placement estimates."""

    name: str
    residency: Residency = Residency.ABSENT
    queued_calls: int = 0
    queued_tokens: int = 0  # prompt tokens still to prefill of queued calls
    running_calls: int = 0
    running_tokens: int = 0  # prompt + expected output tokens still to process
    wait_s: float = 0.0  # instance's estimate of time until this model's slot opens
    prefill_tokens_per_s: float = 0.0
    decode_step_s: float = 0.0
    switch_host_s: float = 0.0  # activation from the host weight store
    switch_staged_s: float = 0.0  # activation from the staging region (D2D)
    kv_restore_bytes_per_s: float = 0.0
    kv_bytes_per_token: int = 0


@dataclass
class SessionKV:
    session_id: str
    model: str
    device_tokens: int = 0
    host_tokens: int = 0
    reserved_until: float | None = None  # instance clock; None: no live reservation
    expected_return: float | None = None


@dataclass
class InstanceState:
    instance_id: str
    now: float = 0.0  # the instance's clock when the report was made
    healthy: bool = True
    active_model: str | None = None
    models: dict[str, ModelState] = field(default_factory=dict)
    sessions: dict[str, SessionKV] = field(default_factory=dict)
    total_kv_blocks: int = 0
    free_kv_blocks: int = 0
    reserved_kv_blocks: int = 0
    block_size: int = 16
    switches: int = 0
    kv_restored_bytes: int = 0
    kv_offloaded_bytes: int = 0

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> InstanceState:
        data = dict(data)
        data["models"] = {
            k: ModelState(**{**v, "residency": Residency(v["residency"])})
            for k, v in (data.get("models") or {}).items()
        }
        data["sessions"] = {k: SessionKV(**v) for k, v in (data.get("sessions") or {}).items()}
        return cls(**data)


def to_json(obj: Any) -> bytes:
    """Serialise a protocol dataclass (enums become their values)."""
    return orjson.dumps(obj, option=orjson.OPT_PASSTHROUGH_DATACLASS, default=_default)


def _default(obj: Any) -> Any:
    if hasattr(obj, "__dataclass_fields__"):
        return asdict(obj)
    if isinstance(obj, enum.Enum):
        return obj.value
    raise TypeError(f"cannot serialise {type(obj).__name__}")


class InstanceClient(Protocol):
    """How the router reaches one instance (HTTP live, direct call in simulation)."""

    instance_id: str

    def submit(self, call: CallRequest) -> AsyncIterator[CallEvent]:
        """Stream the call's events. Raises InstanceUnavailable before the first event if
        the instance cannot take it, Overloaded if its queue is full."""
        ...

    async def abort(self, call_id: str) -> None: ...

    async def state(self) -> InstanceState: ...
