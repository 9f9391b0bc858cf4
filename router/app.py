"""The router's aiohttp application: the OpenAI-compatible front door.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (SSE when ``stream``),
``GET /v1/models``, ``GET /health`` (503 while no instance is healthy), ``GET /live``
(200 while the process serves), ``GET /metrics``. The handlers validate, tokenize and
build a :class:`~talaria.protocol.CallRequest`; :class:`~router.core.RouterCore` places and
forwards it. Errors before the first token get their HTTP status; after it, a streamed
error event then ``[DONE]`` (or a 502 for a non-streamed call), never a silent truncation.
An instance's failure reaches the client as a generic message naming the request id; the
detail goes to the log. A client that goes away (noticed while its call waits too), or a
stop string reached, aborts the call on its instance. Bounds: ``router.limits``.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import structlog
from aiohttp import web

from router import openai_schema as schema
from router.core import CallRejected, NoHealthyInstance, RouterCore
from router.deadlines import Deadlines
from router.health import HealthPoller
from router.instance_http import HttpInstanceClient
from router.limits import (
    InflightGate,
    RouterLimits,
    check_prompt_bytes,
    check_session_id,
    prompt_bytes,
)
from router.metrics import RouterMetrics
from router.placement import POLICIES, PlacementContext
from router.sessions import SessionTable
from router.stream_output import OutputAssembler
from router.tokenization import ModelTokenizer
from talaria.protocol import CallEvent, CallRequest, InstanceClient, Overloaded, SamplingParams
from talaria.protocol.errors import (
    ApiError,
    bad_request,
    error_body,
    error_middleware,
    no_healthy_instance,
    overloaded,
    unknown_model,
)
from talaria.protocol.http import key_middleware, next_or_gone, read_body

log = structlog.get_logger(__name__)


@dataclass
class RouterConfig:
    models: dict[str, str]  # catalog name -> model directory (tokenizer, config.json)
    instances: dict[str, str]  # instance id -> base URL of its internal API
    policy: str = "talaria"  # "load" | "cache_aware" | "talaria"
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <key>"
    max_body_bytes: int = 32 * 1024 * 1024
    poll_interval_s: float | None = 1.0  # None: no background poller
    max_model_len: int | None = None  # caps every model's context length when set
    block_size: int = 16
    session_ttl_s: float = 1800.0
    max_model_lens: dict[str, int] = field(default_factory=dict)  # per-model override
    instance_key: str | None = None  # sent to every instance (`talaria serve` generates it)
    limits: RouterLimits = field(default_factory=RouterLimits)
    deadlines: Deadlines = field(default_factory=Deadlines)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown placement policy {self.policy!r}; choose one of {sorted(POLICIES)}")
        if not self.models:
            raise ValueError("the router config needs at least one model")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.poll_interval_s is not None and self.poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s must be > 0 or None, got {self.poll_interval_s}")
        unknown = set(self.max_model_lens) - set(self.models)
        if unknown:
            raise ValueError(f"max_model_lens names models not in the catalog: {sorted(unknown)}")


CONFIG_KEY = web.AppKey("router_config", RouterConfig)
CORE_KEY = web.AppKey("router_core", RouterCore)
TOKENIZERS_KEY = web.AppKey("router_tokenizers", dict[str, ModelTokenizer])
POLLER_KEY = web.AppKey("router_poller", HealthPoller)
GATE_KEY = web.AppKey("router_inflight", InflightGate)


def create_app(
    config: RouterConfig,
    clients: dict[str, InstanceClient] | None = None,
    tokenizers: dict[str, ModelTokenizer] | None = None,
) -> web.Application:
    """Build the router app. ``clients`` defaults to one HttpInstanceClient per configured
    instance (closed at cleanup); ``tokenizers`` defaults to loading each model's."""
    if clients is None:
        clients = {
            i: HttpInstanceClient(i, url, key=config.instance_key)
            for i, url in config.instances.items()
        }
        owned = list(clients.values())
    else:
        owned = []
    if tokenizers is None:
        tokenizers = {
            name: ModelTokenizer.load(name, path, config.max_model_lens.get(name) or config.max_model_len)
            for name, path in config.models.items()
        }
    core = RouterCore(
        clients,
        config.policy,
        sessions=SessionTable(config.session_ttl_s, config.limits.max_sessions),
        metrics=RouterMetrics(),
        context=PlacementContext(),
        block_size=config.block_size,
        deadlines=config.deadlines,
    )
    middlewares = [error_middleware]
    if config.api_key:
        middlewares.append(key_middleware(config.api_key, lambda path: path.startswith("/v1/")))
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=middlewares)
    app[CONFIG_KEY] = config
    app[CORE_KEY] = core
    app[TOKENIZERS_KEY] = tokenizers
    app[GATE_KEY] = InflightGate(
        config.limits.max_inflight_calls, config.limits.busy_retry_after_s
    )
    if config.poll_interval_s is not None:
        poller = HealthPoller(core, config.poll_interval_s)
        app[POLLER_KEY] = poller
        app.cleanup_ctx.append(lambda _app: poller.context())

    async def close(_app: web.Application) -> None:
        await core.close()
        for client in owned:
            await client.close()

    app.on_cleanup.append(close)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/live", live)
    app.router.add_get("/metrics", metrics)
    return app


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, schema.parse_chat(await _json_body(request)))


async def completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, schema.parse_completion(await _json_body(request)))


async def models(request: web.Request) -> web.Response:
    created = int(time.time())
    data = [
        {"id": name, "object": "model", "created": created, "owned_by": "talaria",
         "max_model_len": tok.context_len}
        for name, tok in sorted(request.app[TOKENIZERS_KEY].items())
    ]
    return _json({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    """Readiness: 503 while no instance is healthy, so a load balancer notices."""
    core = request.app[CORE_KEY]
    status = 200 if core.healthy else 503
    return _json({"status": "ok" if core.healthy else "no_healthy_instance",
                  "healthy_instances": sorted(core.healthy), "instances": sorted(core.clients)},
                 status)


async def live(request: web.Request) -> web.Response:
    """Liveness: 200 while the router process serves, whatever its instances do."""
    return _json({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    core = request.app[CORE_KEY]
    text = core.metrics.render(core.states, core.healthy, len(core.sessions))
    return web.Response(body=text.encode(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def _json_body(request: web.Request) -> Any:
    raw = await read_body(request, request.app[CONFIG_KEY].limits.body_timeout_s)
    if not raw:
        raise bad_request("the request body is empty; send a JSON object")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from exc


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(data), content_type="application/json")


async def _complete(request: web.Request, body: schema.CompletionBody) -> web.StreamResponse:
    tokenizers = request.app[TOKENIZERS_KEY]
    tok = tokenizers.get(body.model)
    if tok is None:
        raise unknown_model(body.model, list(tokenizers))
    limits = request.app[CONFIG_KEY].limits
    with request.app[GATE_KEY].admit():
        session_id = _session_id(request, body, limits)
        prompt_ids = await _tokenize(tok, body, limits)
        call = _call_request(body, tok, prompt_ids, session_id)
        events = request.app[CORE_KEY].submit(call)
        async with contextlib.aclosing(events):
            try:
                first = await next_or_gone(events, request, limits.disconnect_poll_s)
            except NoHealthyInstance as exc:
                raise no_healthy_instance(f"{exc} (request id {call.call_id})") from exc
            except Overloaded as exc:
                raise overloaded(str(exc), exc.retry_after_s) from exc
            except CallRejected as exc:
                raise ApiError(exc.status, exc.message) from exc
            if first is None:
                return web.Response(status=499)  # the client left before the first token
            out = OutputAssembler(tok, prompt_ids, body.stop, body.logprobs)
            if body.stream:
                return await _stream(request, body, call, out, first, events)
            return await _collect(request, body, call, out, first, events)


def _session_id(
    request: web.Request, body: schema.CompletionBody, limits: RouterLimits
) -> str | None:
    """The client's session id (header or body), checked; None: a session of one call."""
    header = request.headers.get("X-Session-ID")
    if header is not None:
        header = check_session_id(header, limits.max_session_id_chars, "X-Session-ID")
    if body.session_id is not None:
        check_session_id(body.session_id, limits.max_session_id_chars)
    if header and body.session_id and header != body.session_id:
        raise bad_request("the X-Session-ID header and the session_id field disagree", "session_id")
    return header or body.session_id


async def _tokenize(
    tok: ModelTokenizer, body: schema.CompletionBody, limits: RouterLimits
) -> list[int]:
    param = "messages" if body.kind == "chat" else "prompt"
    size = prompt_bytes(body.messages, body.prompt)
    check_prompt_bytes(size, tok.context_len, limits.max_prompt_bytes_per_token, param)
    try:
        if body.messages is not None:
            ids = await tok.tokenize_chat(body.messages, size)
        elif isinstance(body.prompt, str):
            ids = await tok.tokenize_text(body.prompt, size)
        elif body.prompt is not None:
            tok.check_token_ids(body.prompt)
            ids = list(body.prompt)
        else:
            raise bad_request("the request has neither messages nor prompt", param)
    except ValueError as exc:
        raise bad_request(str(exc), param) from exc
    except ApiError:
        raise
    except Exception as exc:  # a chat template that rejects the conversation raises its own types
        raise bad_request(f"cannot apply the chat template: {exc}", param) from exc
    if not ids:
        raise bad_request("the prompt tokenizes to nothing", param)
    if len(ids) >= tok.context_len:
        raise bad_request(
            f"the prompt has {len(ids)} tokens; model {tok.name!r} allows at most "
            f"{tok.context_len - 1} prompt tokens (context length {tok.context_len})",
            param,
        )
    return ids


def _call_request(
    body: schema.CompletionBody, tok: ModelTokenizer, prompt_ids: list[int], session_id: str | None
) -> CallRequest:
    room = tok.context_len - len(prompt_ids)
    max_tokens = body.max_tokens if body.max_tokens is not None else room
    if max_tokens > room:
        raise bad_request(
            f"max_tokens is {max_tokens} but the prompt has {len(prompt_ids)} tokens and the "
            f"context length of {tok.name!r} is {tok.context_len}: at most {room} tokens fit",
            "max_tokens",
        )
    call_id = uuid.uuid4().hex
    try:
        params = SamplingParams(
            max_tokens=max_tokens, temperature=body.temperature, top_k=body.top_k,
            top_p=body.top_p, seed=body.seed, ignore_eos=body.ignore_eos, logprobs=body.logprobs,
        )
    except ValueError as exc:
        raise bad_request(str(exc)) from exc
    return CallRequest(
        call_id=call_id,
        session_id=session_id or f"anon-{call_id}",
        model=body.model,
        prompt_token_ids=prompt_ids,
        params=params,
        expected_gap_s=body.expected_gap_s,
        last_call=body.last_call or session_id is None,
    )


async def _collect(
    request: web.Request, body: schema.CompletionBody, call: CallRequest, out: OutputAssembler,
    event: CallEvent, events: AsyncIterator[CallEvent],
) -> web.Response:
    poll_s = request.app[CONFIG_KEY].limits.disconnect_poll_s
    while True:
        out.add(event)
        if out.done:
            break
        following = await next_or_gone(events, request, poll_s)
        if following is None:
            return web.Response(status=499)  # the client left; aclosing aborts the call
        event = following
    if out.error is not None:
        log.warning("router.call_failed", call_id=call.call_id, error=out.error)
        raise ApiError(502, _failed(call), code="instance_failed")
    created = int(time.time())
    usage = out.usage()
    if body.kind == "chat":
        data = schema.chat_completion(call.call_id, body.model, created, out.text, out.finish_reason,
                                      usage, out.chat_logprobs())
    else:
        data = schema.text_completion(call.call_id, body.model, created, out.text, out.finish_reason,
                                      usage, out.completion_logprobs())
    response = _json(data)
    response.headers["X-Session-ID"] = call.session_id
    return response


async def _stream(
    request: web.Request, body: schema.CompletionBody, call: CallRequest, out: OutputAssembler,
    event: CallEvent, events: AsyncIterator[CallEvent],
) -> web.StreamResponse:
    """SSE. Ends with ``[DONE]`` after the finish, or after an error event: an instance's
    failure, or anything unexpected here."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                 "X-Session-ID": call.session_id}
    )
    created = int(time.time())
    chat = body.kind == "chat"
    poll_s = request.app[CONFIG_KEY].limits.disconnect_poll_s

    def chunk(text: str | None, finish: str | None = None, usage: dict[str, Any] | None = None,
              logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        if chat:
            delta = None if text is None else ({"content": text} if finish is None or text else {})
            return schema.chat_chunk(call.call_id, body.model, created, delta, finish, usage, logprobs)
        return schema.text_completion(call.call_id, body.model, created, text, finish, usage, logprobs)

    try:
        await response.prepare(request)
        if chat:
            await _send(response, schema.chat_chunk(
                call.call_id, body.model, created, {"role": "assistant", "content": ""}))
        try:
            while True:
                piece = out.add(event)
                if piece.text or piece.logprobs:
                    lp = out.chat_logprobs(piece) if chat else out.completion_logprobs(piece)
                    await _send(response, chunk(piece.text, logprobs=lp))
                if out.done:
                    break
                following = await next_or_gone(events, request, poll_s)
                if following is None:
                    log.info("router.client_disconnected", call_id=call.call_id)
                    return response
                event = following
        except ConnectionError:
            raise
        except Exception as exc:  # never end a 200 stream without saying why
            log.exception("router.stream_failed", call_id=call.call_id)
            out.error = out.error or f"{type(exc).__name__}: {exc}"
        if out.error is not None:
            log.warning("router.call_failed", call_id=call.call_id, error=out.error)
            await _send(response, error_body(_failed(call), "upstream_error", None, "instance_failed"))
        else:
            await _send(response, chunk(out.flush(), out.finish_reason))
            if body.include_usage:
                await _send(response, chunk(None, usage=out.usage()))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionError:
        log.info("router.client_disconnected", call_id=call.call_id)
    return response


def _failed(call: CallRequest) -> str:
    """What a client is told when its call fails on an instance (the detail is logged)."""
    return f"the call failed on its instance; request id {call.call_id}"


async def _send(response: web.StreamResponse, data: dict[str, Any]) -> None:
    await response.write(b"data: " + orjson.dumps(data) + b"\n\n")
