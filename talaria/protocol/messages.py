"""What crosses the router/instance boundary, as plain dataclasses.

Serialised with orjson (``to_json`` / ``from_json``). The router speaks to instances only
through these types and the :class:`InstanceClient` protocol: over HTTP live, by direct call
inside a simulation.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Protocol

import orjson

from engine.block_hash import BlockChain
from engine.interface import Residency
from engine.sampling_params import SamplingParams
from talaria.protocol.fields import (
    boolean,
    check_keys,
    int_list,
    integer,
    is_number,
    number,
    optional_text,
    printable_id,
)

__all__ = [
    "CallRequest",
    "CallEvent",
    "CallUsage",
    "ModelState",
    "SessionKV",
    "InstanceState",
    "InstanceClient",
    "InstanceShuttingDown",
    "InstanceUnavailable",
    "InstanceUnreachable",
    "Residency",
    "SHUTTING_DOWN",
    "SamplingParams",
    "to_json",
]


class InstanceUnavailable(RuntimeError):
    """The instance could not be reached or failed before producing a first token."""


class InstanceUnreachable(InstanceUnavailable):
    """Nothing answered at the instance's address (no process, refused connection)."""


class InstanceShuttingDown(InstanceUnavailable):
    """The instance is shutting down on its own: it refused the call (a 503 whose code is
    ``SHUTTING_DOWN``) or aborted it before its first event. Not a failure of the instance."""


# Why an instance ended a call it aborted (``CallEvent.abort_reason``), and the code of its
# 503 to a new call: it is shutting down (its drain over), not failing.
SHUTTING_DOWN = "shutting_down"


class Overloaded(RuntimeError):
    """The instance's queue is full; retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class CallRequest:
    call_id: str
    session_id: str  # to an instance: one KV chain of the client's session (router.sessions.table)
    model: str
    prompt_token_ids: Sequence[int]  # read only, never changed (a list, or a replay's view)
    params: SamplingParams
    expected_gap_s: float | None = None  # client hint: tool gap expected after this call
    last_call: bool = False  # client hint: the session ends after this call
    parent_session_id: str | None = None  # a subagent's session: the session that spawned it
    # False: the caller reads only the first token's time and the finish (a simulated
    # replay), so after the first event with tokens the instance holds each step's tokens
    # and sends them with the last event instead of one event per engine step.
    step_events: bool = True
    # In-process only, never serialized: the prompt's block-hash chain when the sender built
    # the prompt from its last one and so has it for the new blocks' hashing alone (the
    # simulated replay); the router and the simulated engine then read it instead of the
    # tokens (``BlockChain.of``). None: they hash the prompt, as for every call live.
    prompt_chain: BlockChain | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (the prompt as a list: any sequence of ids may be sent in)."""
        data = asdict(replace(self, prompt_token_ids=[], prompt_chain=None))
        data["prompt_token_ids"] = list(self.prompt_token_ids)
        del data["prompt_chain"]
        return data

    @classmethod
    def from_dict(cls, data: Any) -> CallRequest:
        """Parse an untrusted call: every field checked by type and range, unknown fields
        refused by name; ValueError says what is wrong."""
        if not isinstance(data, dict):
            raise ValueError(f"a call must be a JSON object, got {type(data).__name__}")
        check_keys(data, _CALL_FIELDS, "the call")
        missing = [k for k in ("call_id", "session_id", "model", "prompt_token_ids") if k not in data]
        if missing:
            raise ValueError(f"the call is missing field(s): {', '.join(missing)}")
        params = data.get("params")
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise ValueError("params must be a JSON object")
        check_keys(params, _SAMPLING_FIELDS, "params")
        gap = data.get("expected_gap_s")
        return cls(
            call_id=printable_id(data["call_id"], "call_id"),
            session_id=printable_id(data["session_id"], "session_id"),
            model=printable_id(data["model"], "model"),
            prompt_token_ids=int_list(data["prompt_token_ids"], "prompt_token_ids"),
            params=SamplingParams(**params),
            expected_gap_s=None if gap is None else number(gap, "expected_gap_s", lo=0.0),
            last_call=boolean(data.get("last_call", False), "last_call"),
            parent_session_id=(
                None if data.get("parent_session_id") is None
                else printable_id(data["parent_session_id"], "parent_session_id")
            ),
            step_events=boolean(data.get("step_events", True), "step_events"),
        )


_CALL_FIELDS = frozenset(f.name for f in fields(CallRequest)) - {"prompt_chain"}
_SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))


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
    # Why the instance aborted the call, on its last event: ``SHUTTING_DOWN`` (it shuts down
    # past its drain). None: any other end (an instance that predates the field sends none).
    abort_reason: str | None = None

    @classmethod
    def from_dict(cls, data: Any) -> CallEvent:
        """Parse an event from an instance's stream: known fields checked by type, fields
        this side does not know ignored (a newer instance may add some); ValueError if
        malformed."""
        if not isinstance(data, dict):
            raise ValueError(f"an event must be a JSON object, got {type(data).__name__}")
        if "call_id" not in data:
            raise ValueError("the event has no call_id")
        usage = data.get("usage")
        if usage is not None and not isinstance(usage, dict):
            raise ValueError("usage must be a JSON object or null")
        logprobs = data.get("logprobs")
        if logprobs is not None and not (
            isinstance(logprobs, list) and all(v is None or is_number(v) for v in logprobs)
        ):
            raise ValueError("logprobs must be a list of numbers or null")
        return cls(
            call_id=printable_id(data["call_id"], "call_id"),
            token_ids=int_list(data.get("token_ids") or [], "token_ids"),
            logprobs=logprobs,
            finished=boolean(data.get("finished", False), "finished"),
            finish_reason=optional_text(data.get("finish_reason"), "finish_reason"),
            error=optional_text(data.get("error"), "error"),
            usage=None if usage is None else CallUsage(**{
                f: integer(usage.get(f, 0), f"usage.{f}", lo=0) for f in _USAGE_FIELDS
            }),
            instance_id=optional_text(data.get("instance_id"), "instance_id"),
            abort_reason=optional_text(data.get("abort_reason"), "abort_reason"),
        )


_USAGE_FIELDS = tuple(f.name for f in fields(CallUsage))


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
    # The most tokens (prompt and output) one call of the model can hold in the instance's
    # KV cache whenever it runs (the staging region included where the instance lends it
    # under pressure); 0: not reported.
    kv_capacity_tokens: int = 0


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
    kv_demotions: int = 0  # sessions' KV copied to host under pressure, since start
    staging_lends: int = 0  # slots that lent the staging region to the KV cache
    # The reporting process's id, new at each start: its report's ``sessions_epoch``, set by
    # ``state_delta.parse_report`` on the router's side (None: a report without one).
    epoch: str | None = None

    @classmethod
    def from_dict(cls, data: Any) -> InstanceState:
        """Parse an instance's report: known fields checked by type and range (a wrong one is
        a ValueError, so a failed poll, never a bad value in placement later); fields this
        side does not know are ignored (a newer instance may add some); absent ones take
        their defaults (an older instance may lack some)."""
        data = _object(data, "the state")
        out = cls(instance_id=printable_id(data.get("instance_id"), "instance_id"))
        _read_fields(out, data, _STATE_READERS, "")
        active = data.get("active_model")
        out.active_model = None if active is None else printable_id(active, "active_model")
        out.models = {
            printable_id(k, "models key"): _model_state(k, v)
            for k, v in _object(_or_empty(data.get("models")), "models").items()
        }
        out.sessions = {
            printable_id(k, "sessions key"): _session_kv(k, v)
            for k, v in _object(_or_empty(data.get("sessions")), "sessions").items()
        }
        return out


def _object(value: Any, name: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}")
    return value


def _or_empty(value: Any) -> Any:
    return {} if value is None else value


def _count(name: str, value: Any) -> int:
    return integer(value, name, lo=0)


def _rate(name: str, value: Any) -> float:
    return number(value, name, lo=0.0)


def _optional_number(name: str, value: Any) -> float | None:
    return None if value is None else number(value, name)


_Reader = Callable[[str, Any], Any]


def _read_fields(out: Any, data: dict[str, Any], readers: dict[str, _Reader], where: str) -> None:
    """Set each field of ``out`` that ``data`` has, read by its reader."""
    for name, read in readers.items():
        if name in data:
            setattr(out, name, read(f"{where}{name}", data[name]))


_STATE_READERS: dict[str, _Reader] = {
    "now": lambda n, v: number(v, n),
    "healthy": lambda n, v: boolean(v, n),
    "total_kv_blocks": _count,
    "free_kv_blocks": _count,
    "reserved_kv_blocks": _count,
    "block_size": lambda n, v: integer(v, n, lo=1),
    "switches": _count,
    "kv_restored_bytes": _count,
    "kv_offloaded_bytes": _count,
    "kv_demotions": _count,
    "staging_lends": _count,
}
_MODEL_READERS: dict[str, _Reader] = {
    "queued_calls": _count,
    "queued_tokens": _count,
    "running_calls": _count,
    "running_tokens": _count,
    "wait_s": lambda n, v: number(v, n),
    "prefill_tokens_per_s": _rate,
    "decode_step_s": _rate,
    "switch_host_s": _rate,
    "switch_staged_s": _rate,
    "kv_restore_bytes_per_s": _rate,
    "kv_bytes_per_token": _count,
    "kv_capacity_tokens": _count,
}
_SESSION_READERS: dict[str, _Reader] = {
    "device_tokens": _count,
    "host_tokens": _count,
    "reserved_until": _optional_number,
    "expected_return": _optional_number,
}
_RESIDENCIES = {r.value: r for r in Residency}


def _model_state(key: str, value: Any) -> ModelState:
    where = f"models[{key!r}]"
    data = _object(value, where)
    residency = data.get("residency", Residency.ABSENT.value)
    if not isinstance(residency, str):
        raise ValueError(f"{where}.residency must be a string")
    # A residency this side does not know (a newer instance's) counts as absent: no call of
    # the model is placed there on its strength.
    out = ModelState(name=printable_id(data.get("name", key), f"{where}.name"),
                     residency=_RESIDENCIES.get(residency, Residency.ABSENT))
    _read_fields(out, data, _MODEL_READERS, f"{where}.")
    return out


def _session_kv(key: str, value: Any) -> SessionKV:
    where = f"sessions[{key!r}]"
    data = _object(value, where)
    out = SessionKV(session_id=printable_id(data.get("session_id", key), f"{where}.session_id"),
                    model=printable_id(data.get("model"), f"{where}.model"))
    _read_fields(out, data, _SESSION_READERS, f"{where}.")
    return out


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

    async def abort(self, call_id: str, answered: bool = False) -> None:
        """End the call there (``answered``: the caller has the answer it wanted, so it ends
        as a finished call, its session's KV and books kept)."""
        ...

    async def state(self) -> InstanceState: ...
