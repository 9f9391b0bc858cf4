"""The instance's internal HTTP API (aiohttp), spoken by ``router.instances.http``.

Routes:
- ``POST /internal/v1/calls`` (body: ``CallRequest.to_dict()`` JSON): 200 streams NDJSON, one
  ``CallEvent`` per line, the last with ``finished`` set; 400 malformed body / bad params /
  prompt too long / prompt and ``max_tokens`` beyond the model's KV capacity here (so a
  call that can never fit is the client's error, not a failure after it was accepted) /
  token id outside the vocabulary; 404 unknown model; 429 queue full
  (``{"error": {...}, "retry_after_s": x}`` and a ``Retry-After`` header); 503 not accepting
  (its code ``shutting_down`` once the server shuts down).
- ``POST /internal/v1/calls/{call_id}/abort`` -> ``{"aborted": bool}`` (``?answered=1``: the
  caller has the answer it wanted, so the call ends as a finished one, its session kept).
- ``GET /internal/v1/state`` -> ``InstanceState`` JSON (every session); ``POST
  /internal/v1/state`` (a ``StateAsk``) -> the sessions changed since the version the poller
  holds, and the sessions it names forgotten (``talaria.protocol.state_delta``);
  ``GET /health`` -> ``{"status": "ok"}``.

Every route needs ``Authorization: Bearer <key>`` when the settings hold a key (``talaria
serve`` generates one and gives it to the router and its instances); 401 otherwise. A call's
body is parsed field by field (``CallRequest.from_dict``): a wrong type, an out-of-range
value or an unknown field is a 400, never a failure inside the instance. A body that has not
arrived within ``body_timeout_s`` is a 408.

Who frees what: a call's blocks belong to the engine while it runs; the handler that
submitted it owns its ``CallHandle`` and aborts it in ``finally`` unless it finished, so a
client that disconnects (noticed on a failed write, or by polling the transport while no
event arrives) or a handler cancelled at shutdown never leaves a call running. A queued
call is also checked at admission: one whose client has gone is dropped, never prefilled.

Life cycle: the admission loop starts in ``cleanup_ctx``. At shutdown new calls get 503,
in-flight calls are given ``drain_timeout_s`` to finish, the rest are aborted, then the loop
stops. The last event of a call aborted so carries ``abort_reason`` ``shutting_down`` (and an
error saying so), so the router re-places it or tells its client the server is shutting
down, rather than that it failed here.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import orjson
import structlog
from aiohttp import web

from engine.interface import ModelLimits, MultiModelEngineProtocol
from talaria.instance.calls import CallHandle
from talaria.instance.instance import Instance
from talaria.protocol import (
    SHUTTING_DOWN,
    CallEvent,
    CallRequest,
    InstanceUnavailable,
    Overloaded,
    to_json,
)
from talaria.protocol.drain import drain_hurry, wait_unless_hurried
from talaria.protocol.errors import ApiError, error_middleware, overloaded
from talaria.protocol.fields import json_depth
from talaria.protocol.http import client_gone, key_middleware, key_problem, next_or_gone, read_body
from talaria.protocol.state_delta import StateAsk, encode_report

log = structlog.get_logger("talaria.serving.instance_server")

__all__ = [
    "InstanceServerSettings",
    "create_instance_app",
    "engine_limits",
    "INSTANCE_KEY",
    "SETTINGS_KEY",
    "INFLIGHT_KEY",
]


@dataclass
class InstanceServerSettings:
    limits: dict[str, ModelLimits] = field(default_factory=dict)  # empty: the engine checks
    drain_timeout_s: float = 30.0
    disconnect_poll_s: float = 0.5  # how often a waiting stream checks its client is there
    max_body_bytes: int = 64 * 1024 * 1024
    key: str | None = None  # the bearer key every route requires; None: no check
    body_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        problem = None if self.key is None else key_problem(self.key)
        if problem is not None:  # the bearer token is compared as read, stripped
            raise ValueError(f"the instance key {problem}")
        if self.key is not None and len(self.key) < 16:
            raise ValueError("the instance key must be at least 16 characters")
        if self.body_timeout_s <= 0:
            raise ValueError(f"body_timeout_s must be > 0, got {self.body_timeout_s}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.disconnect_poll_s <= 0:
            raise ValueError(f"disconnect_poll_s must be > 0, got {self.disconnect_poll_s}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")


class _Calls:
    """The calls this server has in flight (handle by call id), whether it still takes new
    ones, and those of them it aborted because it shuts down (a subset of ``handles``)."""

    def __init__(self) -> None:
        self.handles: dict[str, CallHandle] = {}
        self.accepting = True
        self.cut: set[str] = set()
        self.empty = asyncio.Event()
        self.empty.set()

    def add(self, handle: CallHandle) -> None:
        self.handles[handle.call_id] = handle
        self.empty.clear()

    def remove(self, handle: CallHandle) -> None:
        if self.handles.get(handle.call_id) is handle:
            del self.handles[handle.call_id]
            self.cut.discard(handle.call_id)
        if not self.handles:
            self.empty.set()


INSTANCE_KEY = web.AppKey("talaria_instance", Instance)
SETTINGS_KEY = web.AppKey("talaria_instance_settings", InstanceServerSettings)
INFLIGHT_KEY = web.AppKey("talaria_instance_calls", _Calls)


def engine_limits(
    engine: MultiModelEngineProtocol, max_model_lens: Mapping[str, int] | None = None
) -> dict[str, ModelLimits]:
    """The engine's per-model prompt limits, each ``max_model_len`` capped by
    ``max_model_lens``: a call that breaks them is refused with 400 before it queues."""
    caps = dict(max_model_lens or {})
    return {
        name: replace(lim, max_model_len=min(lim.max_model_len, int(caps.get(name, lim.max_model_len))))
        for name, lim in engine.model_limits().items()
    }


def create_instance_app(
    instance: Instance, settings: InstanceServerSettings | None = None
) -> web.Application:
    """The instance's aiohttp app. Its admission loop starts and stops with the app."""
    if settings is None:
        settings = InstanceServerSettings(limits=engine_limits(instance.engine))
    middlewares = [error_middleware]
    if settings.key is not None:
        middlewares.append(key_middleware(settings.key, lambda _path: True))
    app = web.Application(client_max_size=settings.max_body_bytes, middlewares=middlewares)
    app[INSTANCE_KEY] = instance
    app[SETTINGS_KEY] = settings
    app[INFLIGHT_KEY] = _Calls()
    app.cleanup_ctx.append(_admission_loop)
    app.on_shutdown.append(_drain)
    app.router.add_post("/internal/v1/calls", _submit)
    app.router.add_post("/internal/v1/calls/{call_id}/abort", _abort)
    app.router.add_get("/internal/v1/state", _state)
    app.router.add_post("/internal/v1/state", _state_since)
    app.router.add_get("/health", _health)
    return app


# life cycle -------------------------------------------------------------------------------


async def _admission_loop(app: web.Application) -> AsyncIterator[None]:
    instance = app[INSTANCE_KEY]
    await instance.start()
    log.info("instance.started", instance=instance.instance_id, models=instance.models)
    try:
        yield
    finally:
        app[INFLIGHT_KEY].accepting = False
        await _abort_all(app)
        await instance.stop(drain=False)
        log.info("instance.stopped", instance=instance.instance_id)


async def _drain(app: web.Application) -> None:
    """Stop taking calls; let in-flight ones finish for ``drain_timeout_s`` (or until a second
    signal hurries the drain: ``talaria.protocol.drain``), abort the rest."""
    calls = app[INFLIGHT_KEY]
    calls.accepting = False
    timeout = app[SETTINGS_KEY].drain_timeout_s
    if calls.handles:
        log.info("instance.draining", calls=len(calls.handles), timeout_s=timeout)
        if not await wait_unless_hurried(calls.empty.wait(), timeout, drain_hurry(app)):
            log.warning("instance.drain_timeout", aborting=len(calls.handles))
    await _abort_all(app)


async def _abort_all(app: web.Application) -> None:
    """Abort every call in flight, each marked as cut by the shut-down (``_shutdown_end``)."""
    calls = app[INFLIGHT_KEY]
    calls.cut.update(calls.handles)
    for handle in list(calls.handles.values()):
        handle.abort()
    if calls.handles:
        # The handlers deliver the abort events and return; do not wait for a dead client.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(calls.empty.wait(), 5.0)


# handlers ---------------------------------------------------------------------------------


async def _submit(request: web.Request) -> web.StreamResponse:
    app = request.app
    instance = app[INSTANCE_KEY]
    calls = app[INFLIGHT_KEY]
    settings = app[SETTINGS_KEY]
    call = _parse_call(await read_body(request, settings.body_timeout_s))
    _check_call(call, instance, settings.limits)
    if not calls.accepting:
        raise ApiError(503, f"instance {instance.instance_id!r} is shutting down", code=SHUTTING_DOWN)
    try:
        handle = instance.submit(call)
    except Overloaded as exc:
        raise overloaded(str(exc), exc.retry_after_s) from exc
    except InstanceUnavailable as exc:
        raise ApiError(503, str(exc)) from exc
    except ValueError as exc:
        raise ApiError(400, str(exc)) from exc
    handle.client_gone = lambda: client_gone(request)
    calls.add(handle)
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    finished = False
    try:
        await response.prepare(request)
        while True:
            event = await _next_event(handle, request, settings.disconnect_poll_s)
            if event is None:
                log.info("instance.client_gone", call_id=call.call_id)
                break
            if event.finish_reason == "abort" and call.call_id in calls.cut:
                event = _shutdown_end(event, instance.instance_id)
            await response.write(to_json(event) + b"\n")
            if event.finished:
                finished = True
                break
        if finished:
            await response.write_eof()
    except ConnectionError:
        log.info("instance.client_disconnected", call_id=call.call_id)
    finally:
        handle.abort()  # no-op once finished; otherwise frees its queue entry or blocks
        calls.remove(handle)
    return response


async def _next_event(
    handle: CallHandle, request: web.Request, poll_s: float
) -> CallEvent | None:
    """The call's next event, or None once the client has gone away."""
    if not handle.queue.empty():
        return await anext(handle)
    return await next_or_gone(handle, request, poll_s)


def _shutdown_end(event: CallEvent, instance_id: str) -> CallEvent:
    """The abort that ends a call cut by the shut-down, saying so: ``abort_reason`` for a
    router that knows it; the error for one that predates it (a failed call, as before)."""
    return replace(event, abort_reason=SHUTTING_DOWN,
                   error=f"instance {instance_id!r} is shutting down: the call was aborted past its drain")


async def _abort(request: web.Request) -> web.Response:
    call_id = request.match_info["call_id"]
    aborted = request.app[INSTANCE_KEY].abort(call_id, answered=request.query.get("answered") == "1")
    return _json({"aborted": aborted, "call_id": call_id})


async def _state(request: web.Request) -> web.Response:
    """The whole table (encoded by orjson itself: at 10k sessions 1 ms, not 100 ms)."""
    instance = request.app[INSTANCE_KEY]
    state = instance.state()
    full = instance.sessions.report.since(None, None)
    return web.Response(body=encode_report(state, full), content_type="application/json")


async def _state_since(request: web.Request) -> web.Response:
    raw = await read_body(request, request.app[SETTINGS_KEY].body_timeout_s)
    try:
        ask = StateAsk.from_dict(orjson.loads(raw or b"{}"))
    except (orjson.JSONDecodeError, ValueError) as exc:
        raise ApiError(400, f"bad state ask: {exc}") from exc
    instance = request.app[INSTANCE_KEY]
    instance.release_reservations(ask.release)
    instance.forget_sessions(ask.forget)
    state = instance.state()
    delta = instance.sessions.report.since(ask.epoch, ask.since)
    return web.Response(body=encode_report(state, delta), content_type="application/json")


async def _health(request: web.Request) -> web.Response:
    instance = request.app[INSTANCE_KEY]
    if not instance.healthy:
        raise ApiError(503, f"instance {instance.instance_id!r} failed")
    if not request.app[INFLIGHT_KEY].accepting:
        raise ApiError(503, f"instance {instance.instance_id!r} is shutting down", code=SHUTTING_DOWN)
    return _json({"status": "ok", "instance_id": instance.instance_id})


# validation -------------------------------------------------------------------------------


def _parse_call(raw: bytes) -> CallRequest:
    if not raw:
        raise ApiError(400, "the request body is empty; send a CallRequest JSON object")
    try:
        data = orjson.loads(raw)
        json_depth(data)  # before any field's check can repr a deep value
        return CallRequest.from_dict(data)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from exc
    except ValueError as exc:
        raise ApiError(400, f"bad call: {exc}") from exc


def _check_call(call: CallRequest, instance: Instance, limits: Mapping[str, ModelLimits]) -> None:
    if call.model not in instance.models:
        raise ApiError(
            404,
            f"model {call.model!r} is not served by instance {instance.instance_id!r} "
            f"(models: {', '.join(instance.models)})",
            param="model",
        )
    if not call.prompt_token_ids:
        raise ApiError(400, "prompt_token_ids is empty", param="prompt_token_ids")
    n = len(call.prompt_token_ids)
    limit = limits.get(call.model)
    if limit is not None and n >= limit.max_model_len:
        raise ApiError(
            400,
            f"the prompt has {n} tokens; model {call.model!r} allows at most "
            f"{limit.max_model_len - 1} (max_model_len {limit.max_model_len})",
            param="prompt_token_ids",
        )
    if limit is not None and n + call.params.max_tokens > limit.max_model_len:
        raise ApiError(
            400,
            f"the prompt has {n} tokens and max_tokens is {call.params.max_tokens}: model "
            f"{call.model!r} holds {limit.max_model_len} (at most {limit.max_model_len - n} fit)",
            param="max_tokens",
        )
    capacity = instance.kv_capacity_tokens.get(call.model, 0)
    if capacity and n + call.params.max_tokens > capacity:
        raise ApiError(
            400,
            f"the prompt has {n} tokens and max_tokens is {call.params.max_tokens}: the KV "
            f"cache of instance {instance.instance_id!r} holds {capacity} tokens of one call "
            f"of {call.model!r}",
            param="max_tokens" if n < capacity else "prompt_token_ids",
        )
    if limit is None:
        return
    bad = next((t for t in call.prompt_token_ids if not 0 <= t < limit.vocab_size), None)
    if bad is not None:
        raise ApiError(
            400,
            f"token id {bad} is outside the vocabulary of {call.model!r} "
            f"(ids in [0, {limit.vocab_size}))",
            param="prompt_token_ids",
        )


# helpers ----------------------------------------------------------------------------------


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        status=status, body=orjson.dumps(data), content_type="application/json", headers=headers
    )
