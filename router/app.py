"""The router's aiohttp application: the OpenAI-compatible front door.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (SSE when ``stream``),
``GET /v1/models``, ``GET /health``, ``GET /metrics``. The handlers validate, tokenize and
build a :class:`~talaria.protocol.CallRequest`; :class:`~router.core.RouterCore` places and
forwards it. Errors before the first token get their HTTP status; after it, a streamed
error event (or a 502 for a non-streamed call), never a silent truncation. A client that
goes away, or a stop string reached, aborts the call on its instance.
"""

from __future__ import annotations

import contextlib
import hmac
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import structlog
from aiohttp import web

from router import openai_schema as schema
from router import openai_tools
from router.core import CallRejected, NoHealthyInstance, RouterCore
from router.health import HealthPoller
from router.instance_http import HttpInstanceClient
from router.metrics import RouterMetrics
from router.placement import POLICIES, PlacementContext
from router.sessions import SessionTable
from router.stream_output import OutputAssembler
from router.tokenization import ModelTokenizer
from router.tool_calls import TOOL_FORMATS, AnswerParser, ToolCall, detect_tool_format
from talaria.protocol import CallEvent, CallRequest, InstanceClient, Overloaded, SamplingParams
from talaria.protocol.errors import (
    ApiError,
    bad_request,
    error_body,
    error_middleware,
    no_healthy_instance,
    overloaded,
    unauthorized,
    unknown_model,
)

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
    tool_formats: dict[str, str] = field(default_factory=dict)  # model -> tool-call format

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
        unknown = set(self.tool_formats) - set(self.models)
        if unknown:
            raise ValueError(f"tool_formats names models not in the catalog: {sorted(unknown)}")
        bad = {m: f for m, f in self.tool_formats.items() if f not in TOOL_FORMATS}
        if bad:
            raise ValueError(f"unknown tool-call formats {bad}; choose from {sorted(TOOL_FORMATS)}")


CONFIG_KEY = web.AppKey("router_config", RouterConfig)
CORE_KEY = web.AppKey("router_core", RouterCore)
TOKENIZERS_KEY = web.AppKey("router_tokenizers", dict[str, ModelTokenizer])
POLLER_KEY = web.AppKey("router_poller", HealthPoller)


def create_app(
    config: RouterConfig,
    clients: dict[str, InstanceClient] | None = None,
    tokenizers: dict[str, ModelTokenizer] | None = None,
) -> web.Application:
    """Build the router app. ``clients`` defaults to one HttpInstanceClient per configured
    instance (closed at cleanup); ``tokenizers`` defaults to loading each model's."""
    if clients is None:
        clients = {i: HttpInstanceClient(i, url) for i, url in config.instances.items()}
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
        sessions=SessionTable(config.session_ttl_s),
        metrics=RouterMetrics(),
        context=PlacementContext(),
        block_size=config.block_size,
    )
    app = web.Application(
        client_max_size=config.max_body_bytes, middlewares=[error_middleware, _auth_middleware]
    )
    app[CONFIG_KEY] = config
    app[CORE_KEY] = core
    app[TOKENIZERS_KEY] = tokenizers
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
    app.router.add_get("/metrics", metrics)
    return app


@web.middleware
async def _auth_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    key = request.app[CONFIG_KEY].api_key
    if key and request.path.startswith("/v1/"):
        given = request.headers.get("Authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise unauthorized()
    return await handler(request)


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
    core = request.app[CORE_KEY]
    return _json({"status": "ok", "healthy_instances": sorted(core.healthy),
                  "instances": sorted(core.clients)})


async def metrics(request: web.Request) -> web.Response:
    core = request.app[CORE_KEY]
    text = core.metrics.render(core.states, core.healthy, len(core.sessions))
    return web.Response(body=text.encode(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def _json_body(request: web.Request) -> Any:
    raw = await request.read()
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
    answer = _answer_parser(request.app[CONFIG_KEY], body, tok)
    prompt_ids = await _tokenize(tok, body, answer.prefill if answer else "")
    call = _call_request(request, body, tok, prompt_ids)
    events = request.app[CORE_KEY].submit(call)
    try:
        first = await anext(events)
    except NoHealthyInstance as exc:
        raise no_healthy_instance(str(exc)) from exc
    except Overloaded as exc:
        raise overloaded(str(exc), exc.retry_after_s) from exc
    except CallRejected as exc:
        raise ApiError(exc.status, exc.message) from exc
    out = OutputAssembler(tok, prompt_ids, body.stop, body.logprobs)
    async with contextlib.aclosing(events):
        if body.stream:
            return await _stream(request, body, call, out, first, events, answer)
        return await _collect(request, body, call, out, first, events, answer)


def _answer_parser(
    config: RouterConfig, body: schema.CompletionBody, tok: ModelTokenizer, id_prefix: str = "call_"
) -> AnswerParser | None:
    """The parser of tool calls in this call's answer (None: no tools to look for)."""
    tools = body.tools
    if not tools.parse_calls:
        return None
    name = config.tool_formats.get(tok.name) or detect_tool_format(tok.chat_template)
    if name is None:
        raise bad_request(f"model {tok.name!r} has no tool-call format in its chat template (set "
                          "tool_formats in the router config); it cannot take tools", "tools")
    return AnswerParser(TOOL_FORMATS[name], any_call=tools.choice == "required",
                        function=tools.function, parallel=tools.parallel, id_prefix=id_prefix)


async def _tokenize(tok: ModelTokenizer, body: schema.CompletionBody, prefill: str = "") -> list[int]:
    param = "messages" if body.kind == "chat" else "prompt"
    try:
        if body.messages is not None:
            ids = await tok.run(tok.encode_chat, body.messages, body.tools.tools, prefill)
        elif isinstance(body.prompt, str):
            ids = await tok.run(tok.encode_text, body.prompt)
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
    request: web.Request, body: schema.CompletionBody, tok: ModelTokenizer, prompt_ids: list[int]
) -> CallRequest:
    room = tok.context_len - len(prompt_ids)
    max_tokens = body.max_tokens if body.max_tokens is not None else room
    if max_tokens > room:
        raise bad_request(
            f"max_tokens is {max_tokens} but the prompt has {len(prompt_ids)} tokens and the "
            f"context length of {tok.name!r} is {tok.context_len}: at most {room} tokens fit",
            "max_tokens",
        )
    header = request.headers.get("X-Session-ID")
    if header is not None and not header.strip():
        raise bad_request("the X-Session-ID header is empty", "X-Session-ID")
    if header and body.session_id and header != body.session_id:
        raise bad_request("the X-Session-ID header and the session_id field disagree", "session_id")
    call_id = uuid.uuid4().hex
    session_id = header or body.session_id
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
    event: CallEvent, events: AsyncIterator[CallEvent], answer: AnswerParser | None = None,
) -> web.Response:
    while True:
        out.add(event)
        if out.done:
            break
        if request.transport is None or request.transport.is_closing():
            return web.Response(status=499)  # the client left; aclosing aborts the call
        event = await anext(events)
    if out.error is not None:
        raise ApiError(502, out.error, code="instance_failed")
    created = int(time.time())
    usage = out.usage()
    if body.kind == "chat":
        text, finish, calls = out.text, out.finish_reason, None
        if answer is not None:
            items = answer.feed(text) + answer.finish()
            text = "".join(i for i in items if isinstance(i, str))
            calls = [openai_tools.tool_call_dict(c.id, c.name, c.arguments) for c in answer.calls]
            finish = answer.finish_reason(finish)
        data = schema.chat_completion(call.call_id, body.model, created, text, finish,
                                      usage, out.chat_logprobs(), calls)
    else:
        data = schema.text_completion(call.call_id, body.model, created, out.text, out.finish_reason,
                                      usage, out.completion_logprobs())
    response = _json(data)
    response.headers["X-Session-ID"] = call.session_id
    return response


async def _stream(
    request: web.Request, body: schema.CompletionBody, call: CallRequest, out: OutputAssembler,
    event: CallEvent, events: AsyncIterator[CallEvent], answer: AnswerParser | None = None,
) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                 "X-Session-ID": call.session_id}
    )
    created = int(time.time())
    chat = body.kind == "chat"

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
        while True:
            piece = out.add(event)
            if answer is not None:
                lp = out.chat_logprobs(piece) if piece.logprobs else None
                await _send_answer(response, answer.feed(piece.text), call, body, created, lp)
            elif piece.text or piece.logprobs:
                lp = out.chat_logprobs(piece) if chat else out.completion_logprobs(piece)
                await _send(response, chunk(piece.text, logprobs=lp))
            if out.done:
                break
            event = await anext(events)
        if out.error is not None:
            await _send(response, error_body(out.error, "upstream_error", None, "instance_failed"))
        elif answer is not None:
            rest = answer.feed(out.flush()) + answer.finish()
            await _send_answer(response, rest, call, body, created, None)
            await _send(response, chunk("", answer.finish_reason(out.finish_reason)))
        else:
            await _send(response, chunk(out.flush(), out.finish_reason))
            if body.include_usage:
                await _send(response, chunk(None, usage=out.usage()))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:
        log.info("router.client_disconnected", call_id=call.call_id)
    return response


async def _send_answer(
    response: web.StreamResponse, items: list[str | ToolCall], call: CallRequest,
    body: schema.CompletionBody, created: int, logprobs: dict[str, Any] | None,
) -> None:
    """Stream an answer's content and tool calls as chat chunks (logprobs on the first)."""
    deltas: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, str):
            deltas.append({"content": item})
        else:
            deltas += openai_tools.tool_call_deltas(item.index, item.id, item.name, item.arguments)
    if logprobs is not None and not deltas:
        deltas.append({"content": ""})
    for delta in deltas:
        await _send(response, schema.chat_chunk(call.call_id, body.model, created, delta, logprobs=logprobs))
        logprobs = None


async def _send(response: web.StreamResponse, data: dict[str, Any]) -> None:
    await response.write(b"data: " + orjson.dumps(data) + b"\n\n")
