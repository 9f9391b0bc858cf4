"""Tool calls in generated text: how a model family writes them, and a parser that finds them.

A model asked to call a tool writes the call as text, in its family's syntax; the router
turns that text back into structured calls. Each syntax is a :class:`ToolFormat` in
:data:`TOOL_FORMATS`, found from the model's chat template (:func:`detect_tool_format`) or
named in the router config. The first is ``hermes``, the ``<tool_call>{json}</tool_call>``
form of the Qwen2.5/Qwen3 and Hermes templates::

    I'll check.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A parser is fed the text as it streams and returns, in order, content text and complete
tool calls. The non-streaming answer feeds the whole text at once, so both agree. Invariants:
- content text is released as soon as it cannot be the start of a tool call (a held tail is
  at most the opening tag's length, plus whitespace that may precede a call);
- a call is released whole when its closing tag arrives (or at the end, for a final call
  left open), so a streamed call's arguments are always complete JSON;
- text that looks like a call but is not valid JSON with a string ``name`` and an object of
  ``arguments`` comes back as content, verbatim: malformed model output is text, not an error;
- whitespace between a call and its neighbours is dropped; other text is kept as written.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from router.api.openai_tools import ToolRequest
from talaria.protocol.errors import bad_request

__all__ = [
    "TOOL_FORMATS",
    "AnswerParser",
    "ParsedToolCall",
    "ToolCall",
    "ToolCallParser",
    "ToolFormat",
    "ToolOutput",
    "answer_parser",
    "detect_tool_format",
    "new_tool_call_id",
]


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # a JSON object, as text (what OpenAI's ``function.arguments`` holds)

    def arguments_object(self) -> dict[str, Any]:
        value = json.loads(self.arguments)
        assert isinstance(value, dict), "a parsed tool call's arguments are always an object"
        return value


@dataclass
class ToolOutput:
    """What one feed released, in order: content text pieces and complete tool calls."""

    items: list[str | ParsedToolCall] = field(default_factory=list)

    def add_text(self, text: str) -> None:
        if not text:
            return
        if self.items and isinstance(self.items[-1], str):
            self.items[-1] += text
        else:
            self.items.append(text)

    @property
    def text(self) -> str:
        return "".join(i for i in self.items if isinstance(i, str))

    @property
    def calls(self) -> list[ParsedToolCall]:
        return [i for i in self.items if isinstance(i, ParsedToolCall)]


class ToolCallParser(Protocol):
    """One call's stateful parser."""

    def feed(self, text: str) -> ToolOutput: ...

    def finish(self) -> ToolOutput: ...


@dataclass(frozen=True)
class ToolFormat:
    """A model family's tool-call syntax: how to parse it, how to recognise a template that
    uses it, the text that opens a call (written after the generation prompt to make the
    model call a tool when ``tool_choice`` requires one), and its tags: answers are decoded
    with special tokens skipped, so where a vocabulary marks a tag special (``<tool_call>``
    in some), the tag is decoded all the same while this parser reads the answer."""

    name: str
    make_parser: Callable[[str], ToolCallParser]  # forced prefix -> parser
    template_marker: str
    forced_prefix: Callable[[str | None], str]  # function name or None (any) -> prefix
    tags: tuple[str, ...] = ()


def new_tool_call_id(prefix: str = "call_") -> str:
    return prefix + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ToolCall:
    """A parsed call as an API returns it: its position in the answer and its id."""

    index: int
    id: str
    name: str
    arguments: str

    def arguments_object(self) -> dict[str, Any]:
        return ParsedToolCall(self.name, self.arguments).arguments_object()


class AnswerParser:
    """One answer's text -> content pieces and numbered tool calls, as it streams.

    ``function``: the call ``tool_choice`` forces (its opening was written into the prompt,
    see :attr:`prefill`); ``any_call``: a call of any function is forced. ``parallel=False``
    keeps the first call only (later ones are dropped, as ``parallel_tool_calls`` asks)."""

    def __init__(
        self, fmt: ToolFormat, *, any_call: bool = False, function: str | None = None,
        parallel: bool = True, id_prefix: str = "call_",
    ) -> None:
        self.prefill = fmt.forced_prefix(function) if (any_call or function) else ""
        self.tags = fmt.tags
        self._parser = fmt.make_parser(self.prefill)
        self._parallel = parallel
        self._id_prefix = id_prefix
        self.calls: list[ToolCall] = []
        self.dropped_calls = 0

    def feed(self, text: str) -> list[str | ToolCall]:
        return self._number(self._parser.feed(text)) if text else []

    def finish(self) -> list[str | ToolCall]:
        return self._number(self._parser.finish())

    def finish_reason(self, reason: str | None) -> str | None:
        """``tool_calls`` when the answer called tools and did not fail."""
        if self.calls and reason not in ("error", "abort"):
            return "tool_calls"
        return reason

    def _number(self, out: ToolOutput) -> list[str | ToolCall]:
        items: list[str | ToolCall] = []
        for item in out.items:
            if isinstance(item, str):
                items.append(item)
            elif self._parallel or not self.calls:
                call = ToolCall(len(self.calls), new_tool_call_id(self._id_prefix), item.name, item.arguments)
                self.calls.append(call)
                items.append(call)
            else:
                self.dropped_calls += 1
        return items


# ---- hermes: <tool_call>{json}</tool_call> ------------------------------------------------

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"


class HermesToolParser:
    """Parser of ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks."""

    def __init__(self, forced_prefix: str = "") -> None:
        self._pending = ""  # content not yet released (TEXT state)
        self._body: list[str] | None = None  # text inside an open call (CALL state), else None
        self._body_tail = ""  # its last len(HERMES_CLOSE) - 1 characters, where a close may start
        self._space_before_call = ""  # whitespace cut before the open call
        self._after_call = False  # a call just closed: drop leading whitespace
        if forced_prefix:
            self.feed(forced_prefix)

    def feed(self, text: str) -> ToolOutput:
        out = ToolOutput()
        incoming = ""  # text for the open call's body
        if self._body is not None:
            incoming = text
        else:
            self._pending += text
        while True:
            if self._body is not None:
                closed = self._extend_body(incoming)
                if closed is None:
                    return out
                body, self._pending = closed
                self._close_call(body, out, closed=True)
                continue
            if self._after_call:
                self._pending = self._pending.lstrip()
                if not self._pending:
                    return out
                self._after_call = False
            start = self._pending.find(HERMES_OPEN)
            if start >= 0:
                before = self._pending[:start]
                kept = before.rstrip()
                out.add_text(kept)
                self._space_before_call = before[len(kept):]
                self._body, self._body_tail = [], ""
                incoming = self._pending[start + len(HERMES_OPEN):]
                self._pending = ""
                continue
            hold = _held_tail(self._pending, HERMES_OPEN)
            out.add_text(self._pending[: len(self._pending) - hold])
            self._pending = self._pending[len(self._pending) - hold:]
            return out

    def finish(self) -> ToolOutput:
        out = ToolOutput()
        if self._body is not None:
            self._close_call("".join(self._body), out, closed=False)
        elif not (self._after_call and not self._pending.strip()):
            out.add_text(self._pending)
        self._pending = ""
        return out

    def _extend_body(self, text: str) -> tuple[str, str] | None:
        """Add ``text`` to the open call's body; (body, text after the close) once the close
        tag has arrived, else None. Only the new text and the few characters before it are
        searched, and the body is joined once: linear in the body's length."""
        assert self._body is not None
        window = self._body_tail + text
        end = window.find(HERMES_CLOSE)
        if end < 0:
            self._body.append(text)
            self._body_tail = window[-(len(HERMES_CLOSE) - 1):]
            return None
        before = "".join(self._body)
        body = before[: len(before) - len(self._body_tail)] + window[:end]
        return body, window[end + len(HERMES_CLOSE):]

    def _close_call(self, body: str, out: ToolOutput, closed: bool) -> None:
        call = _hermes_call(body)
        if call is None:
            raw = HERMES_OPEN + body + (HERMES_CLOSE if closed else "")
            out.add_text(self._space_before_call + raw)
            self._after_call = False
        else:
            out.items.append(call)
            self._after_call = True
        self._body = None
        self._space_before_call = ""


def _held_tail(text: str, tag: str) -> int:
    """How many trailing characters to hold back: trailing whitespace (it may precede a
    call) plus the longest suffix that could begin ``tag``."""
    partial = 0
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            partial = n
            break
    body = text[: len(text) - partial]
    return partial + (len(body) - len(body.rstrip()))


def _hermes_call(body: str) -> ParsedToolCall | None:
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):  # some models double-encode the arguments
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedToolCall(data["name"], json.dumps(arguments, ensure_ascii=False))


def _hermes_prefix(function: str | None) -> str:
    if function is None:
        return HERMES_OPEN + "\n"
    return HERMES_OPEN + "\n" + '{"name": ' + json.dumps(function, ensure_ascii=False) + ', "arguments":'


TOOL_FORMATS: dict[str, ToolFormat] = {
    "hermes": ToolFormat("hermes", HermesToolParser, HERMES_OPEN, _hermes_prefix,
                         (HERMES_OPEN, HERMES_CLOSE)),
}


def detect_tool_format(chat_template: str | None) -> str | None:
    """The tool format a chat template writes calls in, or None if it has no tool calls."""
    if not chat_template:
        return None
    for fmt in TOOL_FORMATS.values():
        if fmt.template_marker in chat_template:
            return fmt.name
    return None


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
                        function=tools.function, parallel=tools.parallel, id_prefix=id_prefix)
