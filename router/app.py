"""The router's aiohttp application: the OpenAI-compatible front door.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (SSE when ``stream``),
``POST /v1/messages`` (Anthropic's API), ``POST /v1/responses`` (OpenAI's Responses API),
``GET /v1/models`` (and ``/v1/models/{id}``), ``GET /health`` (503 while no instance is healthy), ``GET /live``
(200 while the process serves), ``GET /metrics``; CORS for the origins ``cors`` allows (``router.cors``). The handlers validate, tokenize and
build a :class:`~talaria.protocol.CallRequest`; :class:`~router.core.RouterCore` places and
forwards it. A stream sends its headers at its first token, or before it once it has waited
``stream_commit_s`` (then keep-alives: ``router.api.stream_commit``). Errors before that get
their HTTP status; after it, a streamed error event (then ``[DONE]`` on the OpenAI API), or a
502 for a non-streamed call, never a silent truncation; an instance's failure reaches the
client as a generic message naming the request id, the detail goes to the log. A client that goes away (noticed while its call
waits too), or a stop string reached, aborts the call on its instance. Bounds on what
requests may take: ``router.limits``. At shut-down (the router no longer listens), calls in
flight get ``drain_timeout_s`` to finish; then those waiting on an instance end as failed
calls (an error event, or a 503 before any answer) and are aborted there, and what is left
is cancelled, each call aborting itself on its instance.
"""

from __future__ import annotations

import contextlib
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import orjson
import structlog
from aiohttp import web

from router.api import anthropic_api, anthropic_schema, openai_api, responses_api, responses_schema
from router.api import openai_schema as schema
from router.api.answer_parser import AnswerParser, answer_parser
from router.api.body_limits import BODY_DECODER_KEY, BodyDecoder, parsed_body
from router.api.model_list import model_routes
from router.api.output_budget import OVERFLOW_RULES, OutputBudget, output_budget
from router.api.prompt_tokens import ContextOverflow, PromptTooLarge, tokenize_prompt
from router.api.reasoning import (
    ReasoningSplitter,
    answer_splitter,
    check_reasoning_settings,
    reasoning_parser_for,
    thinking_budget_fields,
)
from router.api.stream_commit import FirstEvent, Responder, check_stream_settings
from router.api.stream_output import OutputAssembler
from router.api.tool_calls import TOOL_FORMATS, detect_tool_format
from router.core import RouterCore
from router.cors import CorsConfig, install_cors
from router.instances.deadlines import Deadlines
from router.instances.health import HealthPoller
from router.instances.http import HttpInstanceClient
from router.instances.kv_room import OutputRoom, kv_capacity, output_room
from router.instances.placement import POLICIES, PlacementContext
from router.limits import LIMITS_KEY, InflightGate, RouterLimits, body_items_bound
from router.metrics import RouterMetrics
from router.route_slashes import add_merged_slash_routes, add_trailing_slash_routes, merged_path
from router.sessions.identity import SessionHeaders, resolve_session
from router.sessions.inference import SessionInference, process_prefix
from router.sessions.table import SessionTable
from router.tokenization import ModelTokenizer, Prompt
from talaria.protocol import CallRequest, InstanceClient, SamplingParams
from talaria.protocol.drain import drain_hurry
from talaria.protocol.errors import (
    ApiError,
    bad_request,
    error_middleware,
    unauthorized,
    unknown_model,
)
from talaria.protocol.http import bearer_matches, key_matches, key_problem

log = structlog.get_logger(__name__)


@dataclass
class RouterConfig:
    models: dict[str, str]  # catalog name -> model directory (tokenizer, config.json)
    instances: dict[str, str]  # instance id -> base URL of its internal API
    policy: str = "talaria"  # "load" | "cache_aware" | "talaria"
    api_key: str | None = None  # when set, /v1/* and /metrics need "Authorization: Bearer <key>"
    max_body_bytes: int = 32 * 1024 * 1024
    poll_interval_s: float | None = 1.0  # None: no background poller
    max_model_len: int | None = None  # caps every model's context length when set
    block_size: int = 16
    session_ttl_s: float = 1800.0
    max_model_lens: dict[str, int] = field(default_factory=dict)  # per-model override
    tool_formats: dict[str, str] = field(default_factory=dict)  # model -> tool-call format
    # model -> reasoning parser ("qwen3" | "deepseek_r1" | "none"; unset: from its chat template)
    reasoning_parsers: dict[str, str] = field(default_factory=dict)
    session_headers: SessionHeaders = field(default_factory=SessionHeaders)
    infer_sessions: bool = True  # calls naming no session join the session their prompt extends
    instance_key: str | None = None  # sent to every instance (`talaria serve` generates it)
    limits: RouterLimits = field(default_factory=RouterLimits)
    deadlines: Deadlines = field(default_factory=Deadlines)
    # A max_tokens beyond the room the prompt leaves: "clamp" to it or "refuse" (router.api.output_budget)
    max_tokens_overflow: str = "clamp"
    max_tokens_overflows: dict[str, str] = field(default_factory=dict)  # per-model override
    drain_timeout_s: float = 30.0  # at shut-down, for calls in flight (`serve`: its instances')
    # A stream still without its first token then sends its 200 and opening (0: at once; None:
    # at the first token), then a keep-alive every stream_keepalive_s (router.api.stream_commit)
    stream_commit_s: float | None = 10.0
    stream_keepalive_s: float = 15.0
    cors: CorsConfig = field(default_factory=CorsConfig)  # browser origins allowed (router.cors)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown placement policy {self.policy!r}; choose one of {sorted(POLICIES)}")
        if not self.models:
            raise ValueError("the router config needs at least one model")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        problem = None if self.api_key is None else key_problem(self.api_key)
        if problem is not None:
            raise ValueError(f"api_key {problem}")
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
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
        check_reasoning_settings(self.reasoning_parsers, self.models)
        check_stream_settings(self.stream_commit_s, self.stream_keepalive_s)
        unknown = set(self.max_tokens_overflows) - set(self.models)
        if unknown:
            raise ValueError(f"max_tokens_overflows names models not in the catalog: {sorted(unknown)}")
        rules = {"max_tokens_overflow": self.max_tokens_overflow,
                 **{f"max_tokens_overflows[{m!r}]": r for m, r in self.max_tokens_overflows.items()}}
        bad = {k: r for k, r in rules.items() if r not in OVERFLOW_RULES}
        if bad:
            raise ValueError(f"unknown max_tokens overflow rules {bad}; choose from {OVERFLOW_RULES}")

    def overflow_rule(self, model: str) -> str:
        return self.max_tokens_overflows.get(model, self.max_tokens_overflow)


CONFIG_KEY = web.AppKey("router_config", RouterConfig)
CORE_KEY = web.AppKey("router_core", RouterCore)
TOKENIZERS_KEY = web.AppKey("router_tokenizers", dict[str, ModelTokenizer])
REASONING_KEY = web.AppKey("router_reasoning", dict[str, str | None])  # model -> its reasoning parser
POLLER_KEY = web.AppKey("router_poller", HealthPoller)
GATE_KEY = web.AppKey("router_inflight", InflightGate)
ANSWER_HEADERS_KEY = web.RequestKey("answer_headers", dict[str, str])  # headers its answer carries


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
    hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="router-hash")
    decoder = BodyDecoder(body_items_bound(config.limits, (t.context_len for t in tokenizers.values())),
                          config.limits.large_body_bytes)
    core = RouterCore(
        clients,
        config.policy,
        sessions=SessionTable(config.session_ttl_s, config.limits.max_sessions,
                              config.limits.max_branches_per_session),
        metrics=RouterMetrics(),
        context=PlacementContext(),
        block_size=config.block_size,
        inference=(SessionInference(config.block_size, config.limits.max_sessions,
                                    prefix=process_prefix())
                   if config.infer_sessions else None),
        deadlines=config.deadlines,
        hash_executor=hasher,
    )
    app = web.Application(
        client_max_size=config.max_body_bytes,
        middlewares=[error_middleware, anthropic_api.anthropic_errors, _auth_middleware],
    )
    app[CONFIG_KEY] = config
    app[CORE_KEY] = core
    app[TOKENIZERS_KEY] = tokenizers
    app[REASONING_KEY] = {name: reasoning_parser_for(config.reasoning_parsers.get(name), tok.tokenizer)
                          for name, tok in tokenizers.items()}
    app[LIMITS_KEY] = config.limits
    app[BODY_DECODER_KEY] = decoder
    app[GATE_KEY] = InflightGate(config.limits.max_inflight_calls, config.limits.busy_retry_after_s)
    if config.poll_interval_s is not None:
        poller = HealthPoller(core, config.poll_interval_s)
        app[POLLER_KEY] = poller
        app.cleanup_ctx.append(lambda _app: poller.context())

    async def close(_app: web.Application) -> None:
        await core.close()
        hasher.shutdown(wait=False)
        decoder.close()
        for client in owned:
            await client.close()

    async def drain(_app: web.Application) -> None:
        await app[GATE_KEY].drain(config.drain_timeout_s, config.deadlines.state_s, core.shut_down,
                                  drain_hurry(app))

    app.on_shutdown.append(drain)
    app.on_cleanup.append(close)
    app.on_response_prepare.append(_answer_headers)
    install_cors(app, config.cors, config.session_headers)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/messages", messages)  # Claude Code adds ?beta=true: paths match alone
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    app.router.add_post("/v1/responses", responses)
    app.router.add_get("/", root)  # and HEAD /: agents probe the base URL before their first call
    app.router.add_routes(model_routes(tokenizers))  # GET /v1/models and /v1/models/{id}
    app.router.add_get("/health", health)
    app.router.add_get("/live", live)
    app.router.add_get("/metrics", metrics)
    add_trailing_slash_routes(app.router)  # /v1/chat/completions/ is /v1/chat/completions
    add_merged_slash_routes(app.router)  # so is /v1//chat/completions
    return app


@web.middleware
async def _auth_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    key = request.app[CONFIG_KEY].api_key
    if key and _protected(request.path) and not _key_matches(request, key):
        raise unauthorized()
    return await handler(request)


async def _answer_headers(request: web.Request, response: web.StreamResponse) -> None:
    """What the router changed in a request (a clamped max_tokens, media left out) is named
    in headers on its answer, whichever API writes it, streamed or not."""
    response.headers.update(request.get(ANSWER_HEADERS_KEY, {}))


def _protected(path: str) -> bool:
    """The API and /metrics (instance states, session counts) need the key; the probes
    (/, /health, /live) do not."""
    path = merged_path(path)
    return path.startswith("/v1/") or path.rstrip("/") == "/metrics"


def _key_matches(request: web.Request, key: str) -> bool:
    """``Authorization: Bearer <key>``, or ``x-api-key: <key>`` (Anthropic's clients send
    that instead), compared in constant time."""
    other = request.headers.get("x-api-key", "").strip()
    return bearer_matches(request, key) or key_matches(other, key)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, await parsed_body(request, schema.parse_chat))


async def completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, await parsed_body(request, schema.parse_completion))


async def messages(request: web.Request) -> web.StreamResponse:
    parsed = await parsed_body(request, anthropic_schema.parse_messages)
    return await _complete(request, parsed.body, parsed.prefill, anthropic_api.respond,
                           anthropic_api.TOOL_ID_PREFIX)


async def responses(request: web.Request) -> web.StreamResponse:
    parsed = await parsed_body(request, responses_schema.parse_responses)
    return await _complete(request, parsed.body, respond=responses_api.responder(parsed))


async def count_tokens(request: web.Request) -> web.Response:
    parsed = await parsed_body(request, anthropic_schema.parse_count_tokens)
    request[ANSWER_HEADERS_KEY] = parsed.body.media.headers()
    tok = _tokenizer(request, parsed.body.model)
    answer = _answer_parser(request.app[CONFIG_KEY], parsed.body, tok)
    with request.app[GATE_KEY].admit():  # its encode takes the tokenizer's thread like a call's
        prompt = await tokenize_prompt(request, tok, parsed.body,
                                       parsed.prefill + (answer.prefill if answer else ""), within_context=False)
    return _json({"input_tokens": len(prompt.ids)})


async def root(request: web.Request) -> web.Response:
    return _json({"status": "ok"})


async def health(request: web.Request) -> web.Response:
    """Readiness: 503 while no instance can take a call, so a load balancer notices."""
    core = request.app[CORE_KEY]
    serving = bool(core.candidates())
    return _json({"status": "ok" if serving else "no_healthy_instance",
                  "healthy_instances": sorted(core.healthy),
                  "suspect_instances": sorted(core.suspect), "instances": sorted(core.clients)},
                 200 if serving else 503)


async def live(request: web.Request) -> web.Response:
    """Liveness: 200 while the router process serves, whatever its instances do."""
    return _json({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    core = request.app[CORE_KEY]
    gate = request.app[GATE_KEY]
    text = core.metrics.render(core.states, core.healthy, len(core.sessions), core.clients,
                               (gate.inflight, gate.limit))
    return web.Response(body=text.encode(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(data), content_type="application/json")


def _tokenizer(request: web.Request, model: str) -> ModelTokenizer:
    tokenizers = request.app[TOKENIZERS_KEY]
    tok = tokenizers.get(model)
    if tok is None:
        raise unknown_model(model, list(tokenizers))
    return tok


async def _complete(
    request: web.Request, body: schema.CompletionBody, prefill: str = "",
    respond: Responder = openai_api.respond, tool_id_prefix: str = "call_",
) -> web.StreamResponse:
    """Tokenize, place and forward one call; ``respond`` writes the answer in its API's shape.
    ``prefill``: text the answer continues (written after the prompt)."""
    tok = _tokenizer(request, body.model)
    answer = _answer_parser(request.app[CONFIG_KEY], body, tok, tool_id_prefix)
    limits = request.app[LIMITS_KEY]
    with request.app[GATE_KEY].admit():
        try:
            prompt = await tokenize_prompt(request, tok, body, prefill + (answer.prefill if answer else ""))
        except ContextOverflow as exc:  # before any output room is priced
            reason = "prompt_bytes" if isinstance(exc, PromptTooLarge) else "context_length"
            request.app[CORE_KEY].metrics.rejected.inc(model=tok.name, reason=reason)
            raise
        budget = _output_budget(request, body, tok, len(prompt.ids))
        request[ANSWER_HEADERS_KEY] = {**budget.headers(), **body.media.headers()}
        reasoning = _reasoning(request, body, prompt, prefill, answer)
        thinking = await thinking_budget_fields(body.thinking_budget, reasoning, tok.think_tag_ids)
        call = _call_request(request, body, prompt.ids, budget, thinking)
        events = request.app[CORE_KEY].submit(call, prompt.repeated)
        config = request.app[CONFIG_KEY]
        async with contextlib.aclosing(events):
            first = FirstEvent(request, events, call.call_id, limits.disconnect_poll_s,
                               config.stream_commit_s if body.stream else None, config.stream_keepalive_s)
            try:
                await first.until_commit()  # a refusal before it is its HTTP status
                if first.client_left:
                    return web.Response(status=499)  # the client left before the first token
                out = OutputAssembler(tok, prompt.ids, body.stop, body.logprobs, call.call_id,
                                      answer.tags if answer else (), reasoning)
                if first.arrived and not first.event.token_ids and OutputAssembler.ends_in_failure(first.event):
                    out.add(first.event)  # failed before its first token and any commit: its HTTP status
                    out.raise_if_failed()
                response = await respond(request, body, call, out, first, events, answer)
            finally:
                await first.close()
            if out.stopped_at_string or out.settled:  # the events close with the answer whole
                request.app[CORE_KEY].answered(call.call_id, out.answered_usage())
            return response


def _answer_parser(config: RouterConfig, body: schema.CompletionBody, tok: ModelTokenizer,
                   id_prefix: str = "call_") -> AnswerParser | None:
    fmt = config.tool_formats.get(tok.name) or detect_tool_format(tok.chat_template)
    return answer_parser(body.tools, tok.name, fmt, id_prefix)


def _reasoning(request: web.Request, body: schema.CompletionBody, prompt: Prompt, prefill: str,
               answer: AnswerParser | None) -> ReasoningSplitter | None:
    """The splitter of a chat answer's reasoning, for a model with a reasoning parser: the
    think tag ``prompt`` ends with sets where the answer starts (``</think>``: the request
    switched thinking off); it continues ``prefill``; a tool call the prompt opened makes it
    content at once."""
    parser = request.app[REASONING_KEY].get(body.model)
    if parser is None or body.kind != "chat":
        return None
    return answer_splitter(parser, prompt.think_tag, prefill, forced_content=bool(answer and answer.prefill))


def _count_refusal(core: RouterCore, model: str, room: OutputRoom) -> None:
    """A call refused for its size: the client's error, counted by what bounds it."""
    core.metrics.rejected.inc(model=model, reason="kv_capacity" if room.kv_bound else "context_length")


def _output_budget(
    request: web.Request, body: schema.CompletionBody, tok: ModelTokenizer, prompt_tokens: int
) -> OutputBudget:
    """The call's output limit by the rule of every API (``router.api.output_budget``), in
    the room the context and the serving instances' KV caches leave (``router.instances.kv_room``). A
    prompt that leaves no room, or a limit beyond it under the rule ``refuse``, is a 400
    counted as a refusal."""
    core = request.app[CORE_KEY]
    room = output_room(tok.name, prompt_tokens, tok.context_len,
                       kv_capacity(core.states, core.clients, tok.name))
    if room.tokens < 1:
        _count_refusal(core, tok.name, room)
        raise ContextOverflow(f"the prompt has {prompt_tokens} tokens and {room.limit}: none is left for output",
                              body.prompt_param, prompt_tokens, prompt_tokens + room.tokens - 1)
    try:
        return output_budget(body.max_tokens, prompt_tokens, room.tokens, room.limit,
                             request.app[CONFIG_KEY].overflow_rule(tok.name),
                             body.max_tokens_param, body.default_max_tokens)
    except ApiError:
        _count_refusal(core, tok.name, room)
        raise


def _call_request(
    request: web.Request, body: schema.CompletionBody, prompt_ids: list[int], budget: OutputBudget,
    thinking: dict[str, Any],
) -> CallRequest:
    """The call to place; ``thinking``: the sampling fields of its thinking budget, if any."""
    identity = resolve_session(request.headers, body.session_id, body.metadata_session_id,
                               body.last_call, request.app[CONFIG_KEY].session_headers,
                               request.app[LIMITS_KEY].max_session_id_chars)
    try:
        params = SamplingParams(
            max_tokens=budget.max_tokens, temperature=body.temperature, top_k=body.top_k,
            top_p=body.top_p, seed=body.seed, ignore_eos=body.ignore_eos, logprobs=body.logprobs,
            **thinking,
        )
    except ValueError as exc:
        raise bad_request(str(exc)) from exc
    return CallRequest(
        call_id=uuid.uuid4().hex,
        session_id=identity.session_id or "",  # "": the core infers it (or makes a session of one)
        model=body.model,
        prompt_token_ids=prompt_ids,
        params=params,
        expected_gap_s=body.expected_gap_s,
        last_call=identity.final,
        parent_session_id=identity.parent_id,
    )
