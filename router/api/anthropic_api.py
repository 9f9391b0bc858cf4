"""The Anthropic Messages API's answers: messages, their SSE stream, usage and errors.

The router's chat path (tokenize, place, forward, assemble text, find tool calls) is shared
with the OpenAI API; this module writes its result as Anthropic's clients read it:
- a ``message`` with ``text`` and ``tool_use`` content blocks, ``stop_reason``
  (``end_turn`` | ``max_tokens`` | ``stop_sequence`` | ``tool_use``) and usage whose
  ``input_tokens`` excludes the prompt tokens served from cache (``cache_read_input_tokens``);
- the stream as named SSE events: ``message_start`` (the message, empty, its input usage split
  as the first event reports it; all of it ``input_tokens`` when the stream commits before
  that event, ``router.api.stream_commit``) and ``ping``, sent at the first event or at the
  commit, then a ``ping`` every ``stream_keepalive_s`` until the first event, and after it
  whenever the stream was silent that long (``router.api.stream_keepalive``); per content
  block ``content_block_start`` / ``_delta`` / ``_stop`` (indices 0, 1, ... in order; a
  ``tool_use`` block starts with ``input: {}`` once the call's name is known and its input
  follows as ``input_json_delta`` events as the model writes it, whose ``partial_json``
  joined is the JSON of the block's ``input``), ``message_delta`` (stop reason, cumulative usage with the input's final split),
  ``message_stop``; a failure before the stream began is an HTTP status, after it an
  ``error`` event (its type the status's, ``api_error``, ``invalid_request_error`` or
  ``overloaded_error``, but full queues after the commit are ``overloaded_error`` too, as
  Anthropic's streams tell an overload, not ``rate_limit_error``; so is a streamed call that
  broke, see ``router.api.answer_parser``; one cut short by ``max_tokens`` ends the message
  with ``stop_reason: "max_tokens"``, as Anthropic's do);
- a model's reasoning (``router.api.reasoning``) as one ``thinking`` block before the others
  (``signature: ""``; streamed as its ``content_block_start``, ``thinking_delta`` events and
  ``content_block_stop``) when the request enabled thinking (``thinking.type`` ``enabled``,
  whose ``budget_tokens`` caps it, or ``adaptive``), else left out of the answer: the
  prompt then asked the model not to think (``router.api.anthropic_schema``), and a model
  whose template ignores that thinks anyway (streamed, a ``ping`` every
  ``stream_keepalive_s`` while it thinks, so the stream is not silent for as long as it
  thinks); ``output_tokens`` counts it either way;
- errors as ``{"type": "error", "error": {"type", "message"}}`` on every ``/v1/messages`` path;
  a prompt over the model's context in Anthropic's words, ``prompt is too long: N tokens > M
  maximum`` (``router.api.prompt_tokens``), and so a ``max_tokens`` refused under the rule
  ``"refuse"`` (``router.api.output_budget``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
import structlog
from aiohttp import web

from router.api.answer_parser import (
    AnswerItem,
    AnswerParser,
    ToolCall,
    ToolCallDelta,
    ToolCallStart,
)
from router.api.openai_schema import CompletionBody
from router.api.output_budget import OutputOverflow
from router.api.prompt_tokens import ContextOverflow
from router.api.stream_commit import FirstEvent
from router.api.stream_keepalive import KeepAlive, WatchedStream
from router.api.stream_output import OutputAssembler, Piece, collect
from router.route_slashes import merged_path
from talaria.protocol import CallEvent, CallRequest
from talaria.protocol.errors import ApiError

log = structlog.get_logger(__name__)

__all__ = ["TOOL_ID_PREFIX", "anthropic_errors", "anthropic_shaped", "error_response", "respond"]

TOOL_ID_PREFIX = "toolu_"
PATH_PREFIX = "/v1/messages"
_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
    500: "api_error", 502: "api_error", 503: "overloaded_error", 504: "timeout_error",
}


def error_body(status: int, message: str, streamed: bool = False) -> dict[str, Any]:
    """An error of ``status`` in Anthropic's shape; ``streamed``: an ``error`` event, where a
    429 (the instances' queues full, not the client's rate) is Anthropic's in-stream
    overload, ``overloaded_error``. A status the table lacks is a request error below 500 (a
    405, a 408), else ``api_error``."""
    kind = ("overloaded_error" if streamed and status == 429
            else _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error"))
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(error_body(status, message)),
                        content_type="application/json", headers=headers or {})


def anthropic_shaped(request: web.Request) -> bool:
    """Whether the request's errors take Anthropic's shape: the Messages API's paths, and the
    catalog's (both SDKs read ``/v1/models``) when the Anthropic SDK sends the request."""
    path = merged_path(request.path)
    if path.startswith(PATH_PREFIX):
        return True
    return path.startswith("/v1/models") and "anthropic-version" in request.headers


@web.middleware
async def anthropic_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Errors on the Messages API's paths in Anthropic's shape, and on the model routes when
    the Anthropic SDK asks (its ``anthropic-version`` header); the rest keep OpenAI's."""
    if not anthropic_shaped(request):
        return await handler(request)
    try:
        return await handler(request)
    except (ContextOverflow, OutputOverflow) as exc:
        return error_response(exc.status, exc.anthropic_message(), exc.headers)
    except ApiError as exc:
        return exc.closing(error_response(exc.status, exc.message, exc.headers))
    except web.HTTPRequestEntityTooLarge as exc:
        return error_response(413, exc.text or "request body too large")
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        allow = exc.headers.get("Allow")  # a 405 names the methods allowed (RFC 9110)
        return error_response(exc.status, exc.reason or "error", {"Allow": allow} if allow else None)
    except Exception:
        log.exception("unhandled_error", path=request.path)
        return error_response(500, "internal error")


async def respond(
    request: web.Request, body: CompletionBody, call: CallRequest, out: OutputAssembler,
    first: FirstEvent, events: AsyncIterator[CallEvent], answer: AnswerParser | None,
) -> web.StreamResponse:
    if body.stream:
        return await _stream(request, body, call, out, first, events, answer)
    if not await collect(request, out, first.event, events, answer=answer):
        return web.Response(status=499)  # the client left; the caller aborts the call
    out.raise_if_failed()
    text = out.text
    items: list[str | ToolCall] = [text]
    if answer is not None:
        items = _runs(answer.parse(text))
    content = [_block(item) for item in items if not isinstance(item, str) or item]
    if body.show_reasoning and out.reasoning:
        content.insert(0, _thinking(out.reasoning))
    message = _message(call, body.model, content or [{"type": "text", "text": ""}])
    message.update(_stop(out, answer))
    message["usage"] = _usage(out)
    response = web.Response(body=orjson.dumps(message), content_type="application/json")
    response.headers["X-Session-ID"] = call.session_id
    return response


def _message(call: CallRequest, model: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": f"msg_{call.call_id}", "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": None, "stop_sequence": None}


def _runs(items: list[str | ToolCall]) -> list[str | ToolCall]:
    """Adjacent text items as one: a run of text is one block, as the stream writes it (the
    parser may release a held tail of the run as an item of its own)."""
    out: list[str | ToolCall] = []
    for item in items:
        last = out[-1] if out else None
        if isinstance(item, str) and isinstance(last, str):
            out[-1] = last + item
        else:
            out.append(item)
    return out


def _thinking(text: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": text, "signature": ""}


def _block(item: str | ToolCall) -> dict[str, Any]:
    if isinstance(item, str):
        return {"type": "text", "text": item}
    return {"type": "tool_use", "id": item.id, "name": item.name, "input": item.arguments_object()}


def _stop(out: OutputAssembler, answer: AnswerParser | None) -> dict[str, Any]:
    if answer is not None and answer.finish_reason(out.finish_reason) == "tool_calls":
        return {"stop_reason": "tool_use", "stop_sequence": None}
    matched = out.matched_stop
    if matched is not None:
        return {"stop_reason": "stop_sequence", "stop_sequence": matched}
    reason = "max_tokens" if out.finish_reason == "length" else "end_turn"
    return {"stop_reason": reason, "stop_sequence": None}


def _usage(out: OutputAssembler) -> dict[str, int]:
    usage = out.usage()
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": usage["prompt_tokens"] - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": usage["completion_tokens"]}


def _start_usage(out: OutputAssembler, first: CallEvent | None) -> dict[str, int]:
    """message_start's usage: the input split as the final usage splits it, from the usage the
    first event carries (the instance reports its cached prompt tokens there); no output yet.
    Sent before the first event (a committed stream, ``router.api.stream_commit``), it counts
    the whole prompt as ``input_tokens`` and none read from cache (not known yet); the
    ``message_delta`` at the end carries the split, which clients take as final."""
    reported = first.usage if first is not None else None
    prompt = reported.prompt_tokens if reported else out.prompt_tokens
    cached = reported.cached_tokens if reported else 0
    return {"input_tokens": prompt - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": 0}


class _Events:
    """Writes the named SSE events; opens and closes content blocks in index order (at most
    one open: ``open`` is its type)."""

    def __init__(self, response: web.StreamResponse) -> None:
        self.response = response
        self.index = -1
        self.open: str | None = None

    async def send(self, name: str, data: dict[str, Any]) -> None:
        await self.response.write(b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n")

    async def ping(self) -> None:
        await self.send("ping", {"type": "ping"})

    async def thinking(self, text: str) -> None:
        if not text:
            return
        if self.open != "thinking":
            await self.start(_thinking(""))
        await self.delta({"type": "thinking_delta", "thinking": text})

    async def items(self, items: list[AnswerItem]) -> None:
        for item in items:
            if isinstance(item, str):
                if not item:
                    continue
                if self.open != "text":
                    await self.start({"type": "text", "text": ""})
                await self.delta({"type": "text_delta", "text": item})
            elif isinstance(item, ToolCallStart):
                await self.start({"type": "tool_use", "id": item.id, "name": item.name, "input": {}})
            elif isinstance(item, ToolCallDelta):
                await self.delta({"type": "input_json_delta", "partial_json": item.arguments})
            else:
                await self.close()

    async def delta(self, delta: dict[str, Any]) -> None:
        await self.send("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    async def start(self, block: dict[str, Any]) -> None:
        """Open the next block (closing the open one)."""
        await self.close()
        self.index += 1
        self.open = block["type"]
        await self.send("content_block_start",
                        {"type": "content_block_start", "index": self.index, "content_block": block})

    async def close(self) -> None:
        if self.open is not None:
            await self.send("content_block_stop", {"type": "content_block_stop", "index": self.index})
            self.open = None


async def _stream(
    request: web.Request, body: CompletionBody, call: CallRequest, out: OutputAssembler,
    first: FirstEvent, events: AsyncIterator[CallEvent], answer: AnswerParser | None,
) -> web.StreamResponse:
    response = WatchedStream(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                      "X-Session-ID": call.session_id})
    sse = _Events(response)

    async def opening(event: CallEvent | None) -> None:
        await response.prepare(request)
        start = _message(call, body.model, [])
        start["usage"] = _start_usage(out, event)
        await sse.send("message_start", {"type": "message_start", "message": start})
        await sse.ping()

    try:
        event = await first.stream(out, opening, sse.ping)
        if event is None:
            return response  # the client left; the caller aborts the call

        async def emit(piece: Piece) -> None:
            if body.show_reasoning:  # else not sent: collect's keep-alive pings meanwhile
                await sse.thinking(piece.reasoning)
            await sse.items(answer.feed(piece.text) if answer is not None else [piece.text])
            out.check_calls(answer)

        if not await collect(request, out, event, events, emit, answer,
                             KeepAlive(response, sse.ping, first.keepalive_s)):
            return response  # the client left; the caller aborts the call
        if out.error is None:
            await emit(out.flush())
            if answer is not None:
                await sse.items(answer.finish())
            out.check_calls(answer, ended=True)
        if out.error is not None:
            await sse.send("error", error_body(out.stream_error().status, out.error, streamed=True))
        else:
            if sse.index < 0:  # an empty answer is one empty text block
                await sse.start({"type": "text", "text": ""})
            await sse.close()
            await sse.send("message_delta", {"type": "message_delta", "delta": _stop(out, answer),
                                             "usage": _usage(out)})
            await sse.send("message_stop", {"type": "message_stop"})
        await response.write_eof()
    except ConnectionError:
        log.info("router.client_disconnected", call_id=call.call_id)
    return response

