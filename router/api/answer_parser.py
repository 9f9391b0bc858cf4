"""One answer's tool calls as the APIs return them: numbered, each with an id, whole in a
collected answer and piece by piece in a stream.

A stream gives, in order, content text and for each call a :class:`ToolCallStart` (index,
id, name), :class:`ToolCallDelta` pieces of its arguments and a :class:`ToolCallEnd` (the
call, whole). Joined, a call's deltas are its ``arguments``, which for a complete call are
exactly what :meth:`AnswerParser.parse` gives for the same text. A call announced and then
broken, or ended other than by the answer's length limit (``router.api.tool_calls``), is
where a stream disagrees with the collected answer, which reads it as text (or as a call,
where Python's JSON is laxer than a client's: ``NaN``, the call's name or arguments written
twice); the stream then fails (:meth:`AnswerParser.failure`).

An answer its length limit cut inside a call (a forced call whose arguments outgrew
``max_tokens``) ends as truncated answers end, finish reason ``length``, not ``tool_calls``.
On the OpenAI APIs that call is a call, its arguments the JSON text written so far, as OpenAI
returns one: streamed (``cut_short``) and collected alike (``parse(text, cut=True)``). The
Anthropic API collects it as text (``parse(text)``; its stop reason is ``max_tokens``):
``tool_use.input`` is an object, and a partial one would read as a call to run. Its stream
has sent the call's block and ``input_json_delta`` pieces by then and cannot take them back,
the one place the two differ there.

Text the model writes after a complete call (before a later call, or before it ends its turn)
is dropped, streamed and collected, as vLLM's Hermes parser drops it: the content is the text
before the first call. A chat history's assistant message (``content`` beside ``tool_calls``)
and a Messages one (its blocks merged into that message) cannot say that text came after the
calls, and the chat templates write a turn's text first: kept, it was resent where the model
never wrote it, so the next prompt parted from the session's KV where the answer began, and
the model read itself saying before its call what it wrote after. (A Responses history can
order it, as a second assistant turn, which parts at the same place as dropping it.) Dropped,
every API's resent turn repeats the answer token for token to the end of its calls. Written
before any call ran, such text is a guess at a result or narration no agent acts on; its
tokens still count in the usage.

With parallel calls off, nothing the model writes after its first whole call can reach the
answer (text after a call is dropped, and so is a second call): the answer is
:attr:`AnswerParser.settled` there, and the router ends the call on its instance as a
finished one (``router.api.stream_output.collect``) rather than let it write unseen until
its end of turn or its ``max_tokens``, the stream silent meanwhile.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from router.api.openai_tools import ToolRequest
from router.api.tool_calls import (
    TOOL_FORMATS,
    ArgumentsText,
    CallClosed,
    CallOpened,
    CallState,
    CutCall,
    ParsedToolCall,
    ToolCallParser,
    ToolFormat,
    ToolOutput,
)
from talaria.protocol.errors import bad_request

__all__ = [
    "AnswerItem",
    "AnswerParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallEnd",
    "ToolCallStart",
    "answer_parser",
    "new_tool_call_id",
    "whole_call_items",
]


# A streamed call's argument pieces go out at least this long (about 16 tokens of JSON): a
# client that re-parses the call's whole JSON at every delta (the Anthropic SDKs' stream
# helpers; Claude Code's Write of a large file) does that a sixteenth as often as with a
# delta per token, for at most 16 tokens' delay on a piece.
ARGUMENT_DELTA_CHARS = 64


def new_tool_call_id(prefix: str = "call_") -> str:
    return prefix + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ToolCall:
    """A parsed call as an API returns it: its position in the answer and its id."""

    index: int
    id: str
    name: str
    arguments: str
    state: CallState = "complete"  # another state only in a stream, for a call that broke

    def arguments_object(self) -> dict[str, Any]:
        return ParsedToolCall(self.name, self.arguments).arguments_object()


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallDelta:
    index: int
    arguments: str  # the next piece of the call's arguments


@dataclass(frozen=True)
class ToolCallEnd:
    call: ToolCall


AnswerItem = str | ToolCallStart | ToolCallDelta | ToolCallEnd


def whole_call_items(items: list[str | ToolCall]) -> list[AnswerItem]:
    """A collected answer's items in the stream's form (each call as start, delta, end)."""
    out: list[AnswerItem] = []
    for item in items:
        if isinstance(item, str):
            out.append(item)
        else:
            out += [ToolCallStart(item.index, item.id, item.name), ToolCallDelta(item.index, item.arguments),
                    ToolCallEnd(item)]
    return out


class AnswerParser:
    """One answer's text -> content pieces and numbered tool calls: :meth:`parse` a collected
    answer, or :meth:`feed` and :meth:`finish` a stream (one or the other, once).

    ``function``: the call ``tool_choice`` forces (its opening was written into the prompt,
    see :attr:`prefill`); ``any_call``: a call of any function is forced. ``parallel=False``
    keeps the first call only (later ones are dropped, as ``parallel_tool_calls`` asks).

    ``min_delta_chars``: a stream's argument pieces are held until they are this long, or
    the arguments object has closed, or the call ends (0: each piece as it comes). A client
    that re-parses a call's whole JSON at every delta (the Anthropic SDKs' stream helpers)
    then does a fraction of the work on a long call, and every piece is still out by the
    time the arguments are whole."""

    def __init__(
        self, fmt: ToolFormat, *, any_call: bool = False, function: str | None = None,
        parallel: bool = True, id_prefix: str = "call_", min_delta_chars: int = 0,
    ) -> None:
        self._forced = (any_call, function)  # tool_choice, for ``watcher``
        self.prefill = fmt.forced_prefix(function) if (any_call or function) else ""
        self.tags = fmt.tags
        self._fmt = fmt
        self._parser: ToolCallParser | None = None
        self._streaming = False
        self._parallel = parallel
        self._id_prefix = id_prefix
        self.calls: list[ToolCall] = []  # the calls ended so far, in order
        self.dropped_calls = 0
        self._open: ToolCallStart | None = None  # the streamed call under way
        self._open_arguments: list[str] = []
        self._min_delta_chars = min_delta_chars
        self._held = 0  # the open call's argument pieces not yet sent (the last ones)
        self._held_chars = 0
        self._dropping = False  # the call under way is dropped (not parallel)
        self._called = False  # a call ended whole: text after it is dropped (see the module)

    @property
    def settled(self) -> bool:
        """Nothing more the model writes can reach the answer: parallel calls are off and
        its first call is whole (see the module)."""
        return not self._parallel and bool(self.calls) and self.calls[0].state == "complete"

    def watcher(self) -> AnswerParser | None:
        """A new parser like this one, for a collected answer's text to be streamed through
        as it comes, so that it may end once :attr:`settled` (this one parses it whole); None
        with parallel calls on, as such an answer never settles."""
        if self._parallel:
            return None
        any_call, function = self._forced
        return AnswerParser(self._fmt, any_call=any_call, function=function, parallel=False,
                            id_prefix=self._id_prefix, min_delta_chars=self._min_delta_chars)

    def parse(self, text: str, cut: bool = False) -> list[str | ToolCall]:
        """A whole answer: its content pieces and its calls, in order. ``cut``: the answer's
        length limit ended it, and a call it ended inside (one a stream announced) is a call
        ``cut_short``, its arguments as far as they were written; else that call is text."""
        parser = self._reader(stream=False)
        items: list[str | ToolCall] = []
        for item in parser.feed(text).items + parser.finish(cut).items:
            if isinstance(item, str):
                if not self._called:
                    items.append(item)
            else:
                assert isinstance(item, ParsedToolCall | CutCall), "a whole answer's calls are whole or cut"
                if self._keep_whole(item):
                    items.append(self.calls[-1])
                self._called = self._called or isinstance(item, ParsedToolCall)
        return items

    def feed(self, text: str) -> list[AnswerItem]:
        return self._items(self._reader(stream=True).feed(text)) if text else []

    def finish(self) -> list[AnswerItem]:
        return self._items(self._reader(stream=True).finish())

    def finish_reason(self, reason: str | None) -> str | None:
        """``tool_calls`` when the answer called tools, every call whole, and did not fail."""
        if self.calls and reason not in ("error", "abort") and all(c.state == "complete" for c in self.calls):
            return "tool_calls"
        return reason

    def failure(self, reason: str | None = None) -> str | None:
        """Why a stream must end in an error (None: it need not): a call it announced broke
        (``malformed``), or the answer ended inside it (``reason``, the finish reason; None
        while it runs) other than at its length limit, which is a truncated answer like any."""
        for call in self.calls:
            if call.state == "malformed":
                return (f"the model's tool call {call.index} ({call.name!r}) broke off after it was "
                        "streamed: its text stopped being valid JSON or its closing tag came early")
            if call.state == "cut_short" and reason != "length":
                return f"the answer ended inside tool call {call.index} ({call.name!r}) after it was streamed"
        return None

    def _reader(self, stream: bool) -> ToolCallParser:
        if self._parser is None:
            self._parser, self._streaming = self._fmt.make_parser(self.prefill, stream), stream
        assert self._streaming == stream, "an answer is parsed whole or streamed, not both"
        return self._parser

    def _keep_whole(self, call: ParsedToolCall | CutCall) -> bool:
        if not self._parallel and self.calls:
            self.dropped_calls += 1
            return False
        state: CallState = "cut_short" if isinstance(call, CutCall) else "complete"
        self.calls.append(ToolCall(len(self.calls), new_tool_call_id(self._id_prefix), call.name, call.arguments,
                                   state))
        return True

    def _items(self, out: ToolOutput) -> list[AnswerItem]:
        items: list[AnswerItem] = []
        for item in out.items:
            if isinstance(item, str):
                if not self._called:
                    items.append(item)
            elif isinstance(item, ParsedToolCall):
                items += self._whole(item)
            elif isinstance(item, CallOpened):
                items += self._start(item.name)
            elif isinstance(item, ArgumentsText):
                items += self._delta(item.text, send=item.last)
            elif isinstance(item, CallClosed):
                items += self._end(item.state)
        return items

    def _whole(self, call: ParsedToolCall) -> list[AnswerItem]:
        return self._start(call.name) + self._delta(call.arguments, send=True) + self._end("complete")

    def _start(self, name: str) -> list[AnswerItem]:
        self._dropping = not self._parallel and bool(self.calls)
        if self._dropping:
            self.dropped_calls += 1
            return []
        self._open = ToolCallStart(len(self.calls), new_tool_call_id(self._id_prefix), name)
        self._open_arguments, self._held, self._held_chars = [], 0, 0
        return [self._open]

    def _delta(self, text: str, send: bool = False) -> list[AnswerItem]:
        """The call's next argument piece: held, or sent with those held before it."""
        if self._dropping:
            return []
        assert self._open is not None
        if text:
            self._open_arguments.append(text)
            self._held += 1
            self._held_chars += len(text)
        if not self._held or not (send or self._held_chars >= self._min_delta_chars):
            return []
        piece = "".join(self._open_arguments[-self._held:])
        self._held, self._held_chars = 0, 0
        return [ToolCallDelta(self._open.index, piece)]

    def _end(self, state: CallState) -> list[AnswerItem]:
        self._called = self._called or state == "complete"
        if self._dropping:
            self._dropping = False
            return []
        held = self._delta("", send=True)
        start, self._open = self._open, None
        assert start is not None
        call = ToolCall(start.index, start.id, start.name, "".join(self._open_arguments), state)
        self.calls.append(call)
        return [*held, ToolCallEnd(call)]


def answer_parser(
    tools: ToolRequest, model: str, format_name: str | None, id_prefix: str = "call_"
) -> AnswerParser | None:
    """The parser of tool calls in one answer (None when the call offers no tools to use)."""
    if not tools.parse_calls:
        return None
    if format_name is None:
        raise bad_request(f"model {model!r} has no tool-call format in its chat template (set "
                          "tool_formats in the router config); it cannot take tools", "tools")
    return AnswerParser(TOOL_FORMATS[format_name], any_call=tools.choice == "required",
                        function=tools.function, parallel=tools.parallel, id_prefix=id_prefix,
                        min_delta_chars=ARGUMENT_DELTA_CHARS)
