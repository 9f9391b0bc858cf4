"""The OpenAI API's answers: chat completions and text completions, whole or as SSE chunks.

A chat answer's tool calls (found by ``router.api.answer_parser``) become ``message.tool_calls``
and ``finish_reason: "tool_calls"``; streamed, each call's id, type and name come once, in its
first delta (arguments ""), then its arguments in pieces as the model writes them (deltas
holding only ``index`` and ``function.arguments``; the client joins them per index). A call
cut short by the answer's length limit ends with ``finish_reason: "length"``, its arguments
incomplete, as OpenAI's do. A stream begins (its 200 and, on the chat API, the one chunk
with ``delta.role``) at the call's first token or at its commit before it
(``router.api.stream_commit``), then sends an SSE comment (``: keep-alive``) every
``stream_keepalive_s`` until that token, and after it whenever the stream has been silent
that long (``router.api.stream_keepalive``); before it begins a failure is an HTTP status. A
failure after it began is an error chunk, never a silent truncation (a streamed call that
broke is one, code ``malformed_tool_call``; a call refused after the commit carries the
status's type and code, e.g. ``rate_limit_exceeded``); the stream ends with
``data: [DONE]``, after an error chunk when anything failed (the instance, or this side).

A model with a reasoning parser (``router.api.reasoning``) answers its chat completions with
the reasoning in ``message.reasoning`` (null when it had none) and, streamed, in
``delta.reasoning`` chunks before the content's, as vLLM does, each also named
``reasoning_content`` (DeepSeek's name, vLLM's earlier one, which many clients read); ``usage`` then has
``completion_tokens_details.reasoning_tokens``. Text completions are never split.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
import structlog
from aiohttp import web

from router.api import openai_schema as schema
from router.api import openai_tools
from router.api.answer_parser import AnswerItem, AnswerParser, ToolCallDelta, ToolCallStart
from router.api.stream_commit import FirstEvent
from router.api.stream_keepalive import KeepAlive, WatchedStream
from router.api.stream_output import OutputAssembler, Piece, collect
from talaria.protocol import CallEvent, CallRequest

log = structlog.get_logger(__name__)

__all__ = ["respond"]

KEEP_ALIVE = b": keep-alive\n\n"  # an SSE comment: clients skip it, the connection stays busy


async def respond(
    request: web.Request, body: schema.CompletionBody, call: CallRequest, out: OutputAssembler,
    first: FirstEvent, events: AsyncIterator[CallEvent], answer: AnswerParser | None,
) -> web.StreamResponse:
    if body.stream:
        return await _stream(request, body, call, out, first, events, answer)
    return await _collect(request, body, call, out, first.event, events, answer)


async def _collect(
    request: web.Request, body: schema.CompletionBody, call: CallRequest, out: OutputAssembler,
    event: CallEvent, events: AsyncIterator[CallEvent], answer: AnswerParser | None = None,
) -> web.Response:
    if not await collect(request, out, event, events, answer=answer):
        return web.Response(status=499)  # the client left; the caller aborts the call
    out.raise_if_failed()
    created = int(time.time())
    usage = out.usage()
    if body.kind == "chat":
        text, finish, calls = out.text, out.finish_reason, None
        if answer is not None:
            items = answer.parse(text, cut=finish == "length")
            text = "".join(i for i in items if isinstance(i, str))
            calls = [openai_tools.tool_call_dict(c.id, c.name, c.arguments) for c in answer.calls]
            finish = answer.finish_reason(finish)
        data = schema.chat_completion(call.call_id, body.model, created, text, finish,
                                      usage, out.chat_logprobs(), calls)
        if out.reasoning_splitter is not None:
            message = data["choices"][0]["message"]
            message["reasoning"] = message["reasoning_content"] = out.reasoning or None
    else:
        data = schema.text_completion(call.call_id, body.model, created, out.text, out.finish_reason,
                                      usage, out.completion_logprobs())
    return web.Response(body=orjson.dumps(data), content_type="application/json",
                        headers={"X-Session-ID": call.session_id})


async def _stream(
    request: web.Request, body: schema.CompletionBody, call: CallRequest, out: OutputAssembler,
    first: FirstEvent, events: AsyncIterator[CallEvent], answer: AnswerParser | None = None,
) -> web.StreamResponse:
    response = WatchedStream(
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

    async def opening(_first: CallEvent | None) -> None:
        await response.prepare(request)
        if chat:  # the role, once: no later chunk repeats it
            await _send(response, schema.chat_chunk(
                call.call_id, body.model, created, {"role": "assistant", "content": ""}))

    async def keep_alive() -> None:
        await response.write(KEEP_ALIVE)

    try:
        event = await first.stream(out, opening, keep_alive)
        if event is None:
            return response  # the client left; the caller aborts the call

        async def emit(piece: Piece) -> None:
            if not chat:
                if piece.text or piece.logprobs:
                    await _send(response, chunk(piece.text, logprobs=out.completion_logprobs(piece)))
                return
            items: list[AnswerItem] = [piece.text]
            if answer is not None:
                items = answer.feed(piece.text)
                out.check_calls(answer)
            lp = out.chat_logprobs(piece) if piece.logprobs else None
            await _send_answer(response, piece.reasoning, items, call, body, created, lp)

        if not await collect(request, out, event, events, emit, answer,
                             KeepAlive(response, keep_alive, first.keepalive_s)):
            return response  # the client left; the caller aborts the call
        rest = out.flush() if out.error is None else Piece()
        if chat and (answer is not None or rest.reasoning):
            items = answer.feed(rest.text) + answer.finish() if answer is not None else []
            await _send_answer(response, rest.reasoning, items, call, body, created, None)
            if answer is not None:
                out.check_calls(answer, ended=True)
        if out.error is not None:
            await _send(response, out.stream_error().body())
        else:
            if answer is not None:
                await _send(response, chunk("", answer.finish_reason(out.finish_reason)))
            else:
                await _send(response, chunk(rest.text, out.finish_reason))
            if body.include_usage:
                await _send(response, chunk(None, usage=out.usage()))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionError:
        log.info("router.client_disconnected", call_id=call.call_id)
    return response


async def _send_answer(
    response: web.StreamResponse, reasoning: str, items: list[AnswerItem], call: CallRequest,
    body: schema.CompletionBody, created: int, logprobs: dict[str, Any] | None,
) -> None:
    """One piece of a chat answer as chunks: its reasoning, then its content and calls."""
    deltas = [{"reasoning": reasoning, "reasoning_content": reasoning}] if reasoning else []
    for delta in deltas + _deltas(items, with_logprobs=logprobs is not None and not deltas):
        await _send(response, schema.chat_chunk(call.call_id, body.model, created, delta, logprobs=logprobs))
        logprobs = None


def _deltas(items: list[AnswerItem], with_logprobs: bool = False) -> list[dict[str, Any]]:
    """Chat-chunk deltas for an answer's content pieces and tool calls, in order, as OpenAI
    streams a call: id, type and name once (arguments ""), then the arguments' pieces; one
    empty content delta to carry logprobs when nothing else does."""
    deltas: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, str):
            if item:
                deltas.append({"content": item})
        elif isinstance(item, ToolCallStart):
            deltas.append({"tool_calls": [{"index": item.index, "id": item.id, "type": "function",
                                           "function": {"name": item.name, "arguments": ""}}]})
        elif isinstance(item, ToolCallDelta):
            deltas.append({"tool_calls": [{"index": item.index, "function": {"arguments": item.arguments}}]})
    if with_logprobs and not deltas:
        deltas.append({"content": ""})
    return deltas


async def _send(response: web.StreamResponse, data: dict[str, Any]) -> None:
    await response.write(b"data: " + orjson.dumps(data) + b"\n\n")
