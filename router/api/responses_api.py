"""The OpenAI Responses API's answers: the ``response`` object and its SSE stream.

The router's chat path (tokenize, place, forward, assemble text, find tool calls) is shared
with the other APIs; this module writes its result as Responses clients (Codex) read it:
- a ``response`` (``id`` ``resp_...``, ``status`` ``completed``, or ``incomplete`` with
  ``incomplete_details.reason: "max_output_tokens"`` when the answer hit the client's
  ``max_output_tokens``) whose ``output`` holds, in the answer's order, a ``message`` item per
  run of text (one ``output_text`` part, ``annotations: []``), a ``function_call`` item per
  call of a function tool (``id`` ``fc_...``, ``call_id`` ``call_...``, ``arguments`` a JSON
  object as a string; ``namespace`` for a tool a namespace offered) and a ``custom_tool_call``
  item per call of a custom tool (``id`` ``ctc_...``, ``call_id``, ``name``, ``input`` the
  string, see ``router.api.responses_tools``), all after a ``reasoning`` item (``id``
  ``rs_...``, ``summary: []``, one ``reasoning_text`` content part) when a model with a
  reasoning parser reasoned (``router.api.reasoning``); an empty answer is one message with
  empty text; ``usage`` counts ``input_tokens`` with the cached ones among them
  (``input_tokens_details.cached_tokens``; ``cache_write_tokens`` 0), ``output_tokens`` and
  among them ``output_tokens_details.reasoning_tokens``; the request's settings are repeated
  as OpenAI repeats them;
- the stream as named SSE events, each with a ``sequence_number`` one above the last (from 0):
  ``response.created``, ``response.in_progress`` (sent at the first event, or at the stream's
  commit before it, ``router.api.stream_commit``; then ``response.in_progress`` again every
  ``stream_keepalive_s`` until the first event, and after it whenever the stream was silent
  that long, ``router.api.stream_keepalive``: Codex's idle timer counts the events it
  parses, not SSE comments); per message ``response.output_item.added``,
  ``response.content_part.added``, ``response.output_text.delta``...,
  ``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done``
  (the reasoning item alike, with ``response.reasoning_text.delta`` / ``.done`` events);
  per call ``response.output_item.added`` once its name is known, then
  ``response.function_call_arguments.delta`` events with its arguments' pieces as the model
  writes them (joined, the ``arguments`` of its ``.done``; see ``router.api.answer_parser``),
  ``response.function_call_arguments.done``, ``response.output_item.done`` (a custom tool's:
  ``response.custom_tool_call_input.delta`` events with its input's pieces as they are
  decoded, or one with the whole input at the call's end where the arguments do not begin
  with it, see ``router.api.responses_tools``, and ``.done``); then ``response.completed``
  or ``response.incomplete`` (a call cut short by ``max_output_tokens`` is an
  ``incomplete`` item with the arguments written so far). A failure before the stream
  began is an HTTP status; after it, a streamed call that broke among them, an ``error``
  event then ``response.failed`` (``status: "failed"``, ``error.code: "server_error"``, or
  for a call refused after the commit ``rate_limit_exceeded`` / ``invalid_prompt`` by its
  status), never a silent truncation. There is no ``[DONE]`` line.
- an answer that ran out of context when the client set no ``max_output_tokens`` (the router
  then allows the whole remaining context), or one larger than that room (clamped to it:
  ``router.api.output_budget``), is a failure, not ``incomplete``: Codex retries
  an incomplete response as it is, which would rerun the same full-context generation. The
  stream ends with ``response.failed`` whose ``error.code`` is ``context_length_exceeded``
  (the code OpenAI sends and Codex reads; the openai SDK's ``ResponseError.code`` literal does
  not list it); the whole answer is a 400 with that code.
A successful answer names the tools skipped (``router.api.responses_tools``) in the header
``X-Talaria-Tools-Skipped`` (comma-separated types), and its session in ``X-Session-ID``.
Errors before the stream are OpenAI's ``{"error": {...}}`` (``talaria.protocol.errors``).
Nothing is stored: a response cannot be fetched or continued by id.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
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
    whole_call_items,
)
from router.api.openai_schema import CompletionBody
from router.api.responses_schema import ResponsesRequest
from router.api.responses_tools import CustomInputStream, Tools, custom_input
from router.api.stream_commit import FirstEvent, Responder
from router.api.stream_keepalive import KeepAlive, WatchedStream
from router.api.stream_output import OutputAssembler, Piece, collect
from talaria.protocol import CallEvent, CallRequest
from talaria.protocol.errors import ApiError

log = structlog.get_logger(__name__)

__all__ = ["responder"]


def responder(parsed: ResponsesRequest) -> Responder:
    """The Responder of one Responses request (its settings go back in the response)."""

    async def respond(
        request: web.Request, body: CompletionBody, call: CallRequest, out: OutputAssembler,
        first: FirstEvent, events: AsyncIterator[CallEvent], answer: AnswerParser | None,
    ) -> web.StreamResponse:
        shape = _Shape(parsed, call)
        if parsed.tools.skipped:
            shape.headers["X-Talaria-Tools-Skipped"] = ",".join(parsed.tools.skipped)
        if body.stream:
            return await _stream(request, shape, call, out, first, events, answer)
        return await _collect(request, shape, call, out, first.event, events, answer)

    return respond


class _Shape:
    """The response object around an output list: id, time, status and the echoed request."""

    def __init__(self, parsed: ResponsesRequest, call: CallRequest) -> None:
        self.echo = parsed.echo
        self.tools = parsed.tools
        self.model = parsed.body.model
        self.headers = {"X-Session-ID": call.session_id}
        asked = parsed.body.max_tokens
        # The client's max_output_tokens bounds the answer (not one clamped to the context's room).
        self.limited = asked is not None and asked <= call.params.max_tokens
        self.id = f"resp_{call.call_id}"
        self.created_at = int(time.time())

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "error": error, "incomplete_details": incomplete, "model": self.model, "output": output,
            "usage": usage, "previous_response_id": None, "reasoning": {"effort": None, "summary": None},
            "store": False, "text": {"format": {"type": "text"}}, "truncation": "disabled", **self.echo,
        }


# A call refused after its stream committed: its status's code among those ResponseError knows.
_ERROR_CODES = {429: "rate_limit_exceeded", 400: "invalid_prompt"}


def _status(out: OutputAssembler) -> str:
    return "incomplete" if out.finish_reason == "length" else "completed"


def _context_full(shape: _Shape, out: OutputAssembler) -> str | None:
    """The error message when the answer filled the model's context with no client limit: a
    failure (``context_length_exceeded``), not ``incomplete``, which Codex would retry as is."""
    if shape.limited or out.finish_reason != "length":
        return None
    return (f"the conversation filled the context of model {shape.model!r} ({out.prompt_tokens} prompt "
            "tokens) before the answer ended; shorten or compact the input")


def _usage(out: OutputAssembler) -> dict[str, Any]:
    usage = out.usage()
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                                 "cache_write_tokens": 0},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": usage.get("completion_tokens_details", {})
                                  .get("reasoning_tokens", 0)},
        "total_tokens": usage["total_tokens"],
    }


@dataclass
class _Call:
    """A call item under way: its item as added, where it is, and what of its arguments (a
    custom tool's: of its input) was sent so far."""

    item: dict[str, Any]
    index: int
    custom: bool
    pieces: list[str] = field(default_factory=list)
    input: CustomInputStream = field(default_factory=CustomInputStream)

    @property
    def key(self) -> str:
        return "input" if self.custom else "arguments"

    @property
    def sent(self) -> str:
        return "".join(self.input.sent if self.custom else self.pieces)

    @property
    def events(self) -> str:
        return "response.custom_tool_call_input" if self.custom else "response.function_call_arguments"


class _Output:
    """Builds the output items from the answer's pieces, in order, and writes their stream
    events when it has a response to write to (none: the non-streamed answer, same items).
    Invariant: at most one item is open (the reasoning, a message, or a call whose arguments
    are under way), and it is the last item of ``items``."""

    def __init__(self, tools: Tools, response: web.StreamResponse | None = None) -> None:
        self.tools = tools
        self.response = response
        self.sequence = 0
        self.items: list[dict[str, Any]] = []
        self._reasoning: list[str] | None = None  # the open reasoning item's text so far
        self._text: list[str] | None = None  # the open message's text so far; None: none open
        self._call: _Call | None = None  # the open call

    async def send(self, kind: str, data: dict[str, Any]) -> None:
        if self.response is None:
            return
        payload = orjson.dumps({"type": kind, "sequence_number": self.sequence, **data})
        self.sequence += 1
        await self.response.write(b"event: " + kind.encode() + b"\ndata: " + payload + b"\n\n")

    async def reason(self, text: str) -> None:
        """The answer's next reasoning text (it precedes every other item)."""
        if not text:
            return
        if self._reasoning is None:
            item = {"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "summary": [], "content": [],
                    "status": "in_progress"}
            self.items.append(item)
            self._reasoning = []
            await self.send("response.output_item.added", {"output_index": len(self.items) - 1, "item": item})
            await self.send("response.content_part.added", {**self._where(), "part": _reasoning_part("")})
        self._reasoning.append(text)
        await self.send("response.reasoning_text.delta", {**self._where(), "delta": text})

    async def close_reasoning(self, status: str) -> None:
        if self._reasoning is None:
            return
        text, where = "".join(self._reasoning), self._where()
        self._reasoning = None
        item = self.items[-1] = _reasoning(self.items[-1]["id"], text, status)
        await self.send("response.reasoning_text.done", {**where, "text": text})
        await self.send("response.content_part.done", {**where, "part": _reasoning_part(text)})
        await self.send("response.output_item.done", {"output_index": where["output_index"], "item": item})

    async def feed(self, pieces: list[AnswerItem]) -> None:
        for piece in pieces:
            if isinstance(piece, str):
                if piece:
                    await self.close_reasoning("completed")
                    await self._add_text(piece)
            elif isinstance(piece, ToolCallStart):
                await self.close_reasoning("completed")
                await self.close_text("completed")
                await self._open_call(piece)
            elif isinstance(piece, ToolCallDelta):
                await self._add_arguments(piece.arguments)
            else:
                await self._close_call(piece.call)

    async def finish(self, status: str) -> None:
        """Close the open message (``status`` is the answer's); an empty answer is one empty message."""
        if not self.items:
            await self._open_text()
        await self.close_reasoning("incomplete" if status == "incomplete" else "completed")
        await self.close_text("incomplete" if status == "incomplete" else "completed")

    def snapshot(self, open_status: str = "incomplete") -> list[dict[str, Any]]:
        """The items so far, an open one with its content so far and ``open_status``."""
        if self._call is not None:
            call = self._call
            return [*self.items[:-1], {**call.item, call.key: call.sent, "status": open_status}]
        if self._reasoning is not None:
            return [*self.items[:-1], _reasoning(self.items[-1]["id"], "".join(self._reasoning), open_status)]
        if self._text is None:
            return list(self.items)
        return [*self.items[:-1], _message(self.items[-1]["id"], "".join(self._text), open_status)]

    async def _open_text(self) -> None:
        item = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "status": "in_progress",
                "role": "assistant", "content": []}
        self.items.append(item)
        self._text = []
        await self.send("response.output_item.added", {"output_index": len(self.items) - 1, "item": item})
        await self.send("response.content_part.added", {**self._where(), "part": _part("")})

    async def _add_text(self, text: str) -> None:
        if self._text is None:
            await self._open_text()
        assert self._text is not None
        self._text.append(text)
        await self.send("response.output_text.delta", {**self._where(), "delta": text, "logprobs": []})

    async def close_text(self, status: str) -> None:
        if self._text is None:
            return
        text, where = "".join(self._text), self._where()
        self._text = None
        item = self.items[-1] = _message(self.items[-1]["id"], text, status)
        await self.send("response.output_text.done", {**where, "text": text, "logprobs": []})
        await self.send("response.content_part.done", {**where, "part": _part(text)})
        await self.send("response.output_item.done", {"output_index": where["output_index"], "item": item})

    async def _open_call(self, start: ToolCallStart) -> None:
        tool = self.tools.offered.get(start.name)
        name, custom = (tool.name, tool.custom) if tool is not None else (start.name, False)
        item = {"id": f"{'ctc' if custom else 'fc'}_{uuid.uuid4().hex}",
                "type": "custom_tool_call" if custom else "function_call", "status": "in_progress",
                "call_id": start.id, "name": name, "input" if custom else "arguments": ""}
        if tool is not None and tool.namespace is not None:
            item["namespace"] = tool.namespace
        self._call = _Call(item, len(self.items), custom)
        self.items.append(item)
        await self.send("response.output_item.added", {"output_index": self._call.index, "item": item})

    async def _add_arguments(self, text: str) -> None:
        """A function's arguments go out as they come; a custom tool's input, the string
        inside them, as it is decoded (``CustomInputStream``)."""
        call = self._call
        assert call is not None
        call.pieces.append(text)
        delta = call.input.feed(text) if call.custom else text
        if delta:
            await self.send(f"{call.events}.delta", {**self._call_where(call), "delta": delta})

    async def _close_call(self, parsed: ToolCall) -> None:
        """The call's last events; an unfinished custom call's input is what was decoded of it."""
        call, self._call = self._call, None
        assert call is not None
        complete = parsed.state == "complete"
        value = parsed.arguments if not call.custom else (
            custom_input(parsed.arguments) if complete or not call.sent else call.sent)
        item = self.items[call.index] = {**call.item, call.key: value,
                                         "status": "completed" if complete else "incomplete"}
        where = self._call_where(call)
        if call.custom:
            rest = call.input.rest(value)
            if rest or not value:
                await self.send(f"{call.events}.delta", {**where, "delta": rest})
            await self.send(f"{call.events}.done", {**where, "input": value})
        else:
            await self.send(f"{call.events}.done", {**where, "name": item["name"], "arguments": value})
        await self.send("response.output_item.done", {"output_index": call.index, "item": item})

    @staticmethod
    def _call_where(call: _Call) -> dict[str, Any]:
        return {"item_id": call.item["id"], "output_index": call.index}

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1, "content_index": 0}


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def _reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def _reasoning(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [], "content": [_reasoning_part(text)], "status": status}


def _message(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": [_part(text)]}


async def _collect(
    request: web.Request, shape: _Shape, call: CallRequest, out: OutputAssembler,
    event: CallEvent, events: AsyncIterator[CallEvent], answer: AnswerParser | None,
) -> web.Response:
    if not await collect(request, out, event, events, answer=answer):
        return web.Response(status=499)  # the client left; the caller aborts the call
    out.raise_if_failed()
    full = _context_full(shape, out)
    if full is not None:
        raise ApiError(400, full, param="input", code="context_length_exceeded", headers=shape.headers)
    text = out.text
    output = _Output(shape.tools)
    await output.reason(out.reasoning)
    cut = out.finish_reason == "length"
    await output.feed(whole_call_items(answer.parse(text, cut)) if answer is not None else [text])
    status = _status(out)
    await output.finish(status)
    return web.Response(body=orjson.dumps(shape.response(status, output.items, _usage(out))),
                        content_type="application/json", headers=shape.headers)


async def _stream(
    request: web.Request, shape: _Shape, call: CallRequest, out: OutputAssembler,
    first: FirstEvent, events: AsyncIterator[CallEvent], answer: AnswerParser | None,
) -> web.StreamResponse:
    response = WatchedStream(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                      **shape.headers})
    output = _Output(shape.tools, response)

    async def opening(_first: CallEvent | None) -> None:
        await response.prepare(request)
        await output.send("response.created", {"response": shape.response("in_progress", [])})
        await keep_alive()

    async def keep_alive() -> None:  # Codex parses it and ignores it: its idle timer restarts
        await output.send("response.in_progress", {"response": shape.response(
            "in_progress", output.snapshot("in_progress"))})  # the answer so far, never stale

    try:
        event = await first.stream(out, opening, keep_alive)
        if event is None:
            return response  # the client left; the caller aborts the call

        async def emit(piece: Piece) -> None:
            await output.reason(piece.reasoning)
            await output.feed(answer.feed(piece.text) if answer is not None else [piece.text])
            out.check_calls(answer)

        keep = KeepAlive(response, keep_alive, first.keepalive_s)
        if not await collect(request, out, event, events, emit, answer, keep):
            return response  # the client left; the caller aborts the call
        if out.error is None:
            await emit(out.flush())
            if answer is not None:
                await output.feed(answer.finish())
            out.check_calls(answer, ended=True)
        if out.error is not None:
            error = {"code": _ERROR_CODES.get(out.stream_error().status, "server_error"), "message": out.error}
            await output.send("error", {**error, "param": None})
            await output.send("response.failed", {"response": shape.response(
                "failed", output.snapshot(), _usage(out), error)})
        else:
            status, full = _status(out), _context_full(shape, out)
            await output.finish(status)
            if full is not None:
                error = {"code": "context_length_exceeded", "message": full}
                await output.send("response.failed", {"response": shape.response(
                    "failed", output.items, _usage(out), error)})
            else:
                final = shape.response(status, output.items, _usage(out))
                await output.send(f"response.{status}", {"response": final})
        await response.write_eof()
    except ConnectionError:
        log.info("router.client_disconnected", call_id=call.call_id)
    return response
