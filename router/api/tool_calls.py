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

A parser is fed the text as it streams and returns, in order, content text and tool calls.
It reads a whole answer (``stream=False``: every call released whole, when it is decided) or
a stream (``stream=True``: a call written in the canonical form is announced as soon as its
name is known and its arguments object has begun, then its arguments follow piece by piece
as they arrive, see ``router.api.call_body``). Invariants:
- content text is released as soon as it cannot be the start of a tool call (a held tail is
  at most the opening tag's length, plus whitespace that may precede a call);
- a call's arguments are the JSON text the model wrote for them, as written, when it wrote
  the canonical form; the pieces a stream releases joined are exactly the ``arguments`` the
  whole answer gives for the same text (other forms, and string-encoded arguments, are
  parsed whole and re-serialised, streamed or not);
- text that looks like a call but is not valid JSON with a string ``name`` and an object of
  ``arguments`` comes back as content, verbatim: malformed model output is text, not an
  error. In a stream, a call already announced cannot become text again: it ends
  ``malformed`` (a character that cannot continue its JSON, or its closing tag before its
  object closed) or ``cut_short`` (the answer ended inside it), and the answer decides
  (``router.api.answer_parser``). A whole answer its length limit cut (``finish(cut=True)``)
  gives the call a stream would have announced as a :class:`CutCall`, its arguments those
  the stream sent;
- whitespace between a call and its neighbours is dropped; other text is kept as written.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from router.api.call_body import CallBodyScanner

__all__ = [
    "TOOL_FORMATS",
    "ArgumentsText",
    "CallClosed",
    "CallOpened",
    "CallState",
    "CutCall",
    "ParsedToolCall",
    "ToolCallParser",
    "ToolFormat",
    "ToolOutput",
    "detect_tool_format",
]

CallState = Literal["complete", "cut_short", "malformed"]


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # a JSON object, as text (what OpenAI's ``function.arguments`` holds)

    def arguments_object(self) -> dict[str, Any]:
        value = whole_characters(json.loads(self.arguments))
        assert isinstance(value, dict), "a parsed tool call's arguments are always an object"
        return value


def whole_characters(value: Any) -> Any:
    """``value`` (parsed JSON) with every half of a surrogate pair in its strings as U+FFFD:
    JSON may escape one, but no client can be sent one (orjson refuses to write it)."""
    if isinstance(value, str):
        return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    if isinstance(value, dict):
        return {whole_characters(k): whole_characters(v) for k, v in value.items()}
    if isinstance(value, list):
        return [whole_characters(v) for v in value]
    return value


@dataclass(frozen=True)
class CutCall:
    """A whole answer's last call, in the canonical form, cut short by the answer's length
    limit: its arguments are the JSON text written so far (not an object yet)."""

    name: str
    arguments: str


@dataclass(frozen=True)
class CallOpened:
    """A streamed call begins: its name is known; its arguments follow as :class:`ArgumentsText`."""

    name: str


@dataclass(frozen=True)
class ArgumentsText:
    """The next piece of the open call's arguments, as the model wrote it (``last``: the
    arguments object closed in it)."""

    text: str
    last: bool = False


@dataclass(frozen=True)
class CallClosed:
    """The open streamed call ended (how: see the module's invariants)."""

    state: CallState


ParserItem = str | ParsedToolCall | CutCall | CallOpened | ArgumentsText | CallClosed


@dataclass
class ToolOutput:
    """What one feed released, in order: content text pieces and tool calls (whole, or in
    pieces when streamed)."""

    items: list[ParserItem] = field(default_factory=list)

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
    """One answer's stateful parser."""

    def feed(self, text: str) -> ToolOutput: ...

    def finish(self, cut: bool = False) -> ToolOutput:
        """The answer ended (``cut``: at its length limit, which a whole answer's call left
        open in the canonical form is released as a :class:`CutCall`, not as text)."""
        ...


@dataclass(frozen=True)
class ToolFormat:
    """A model family's tool-call syntax: how to parse it, how to recognise a template that
    uses it, the text that opens a call (written after the generation prompt to make the
    model call a tool when ``tool_choice`` requires one), and its tags: answers are decoded
    with special tokens skipped, so where a vocabulary marks a tag special (``<tool_call>``
    in some), the tag is decoded all the same while this parser reads the answer."""

    name: str
    make_parser: Callable[[str, bool], ToolCallParser]  # (forced prefix, stream) -> parser
    template_marker: str
    forced_prefix: Callable[[str | None], str]  # function name or None (any) -> prefix
    tags: tuple[str, ...] = ()


# ---- hermes: <tool_call>{json}</tool_call> ------------------------------------------------

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"


class HermesToolParser:
    """Parser of ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks. An open
    call's body is read by a :class:`CallBodyScanner` as it arrives, all but a tail that may
    begin the closing tag (invariant: the scanner has read the body but ``_unscanned``)."""

    def __init__(self, forced_prefix: str = "", stream: bool = False) -> None:
        self._stream = stream
        self._pending = ""  # content not yet released (TEXT state)
        self._body: list[str] | None = None  # text inside an open call (CALL state), else None
        self._body_tail = ""  # its last len(HERMES_CLOSE) - 1 characters, where a close may start
        self._scanner = CallBodyScanner()
        self._unscanned = ""  # the body's tail the scanner has not read: it may begin the close
        self._arguments: list[str] = []  # the canonical arguments read so far (whole answers)
        self._announced = False  # the open call was announced (streams)
        self._ended = False  # ... and has ended already (it broke)
        self._space_before_call = ""  # whitespace cut before the open call
        self._after_call = False  # a call just closed: drop leading whitespace
        if forced_prefix:
            released = self.feed(forced_prefix)
            assert not released.items, "a forced prefix opens a call and ends before its arguments"

    def feed(self, text: str) -> ToolOutput:
        out = ToolOutput()
        incoming = ""  # text for the open call's body
        if self._body is not None:
            incoming = text
        else:
            self._pending += text
        while True:
            if self._body is not None:
                closed = self._extend_body(incoming, out)
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

    def finish(self, cut: bool = False) -> ToolOutput:
        out = ToolOutput()
        if self._body is not None:
            rest, self._unscanned = self._unscanned, ""
            if not self._scanner.done:  # after the object, ``rest`` is the closing tag, cut short
                self._scan(rest, out)
            self._close_call("".join(self._body), out, closed=False, cut=cut)
        elif not (self._after_call and not self._pending.strip()):
            out.add_text(self._pending)
        self._pending = ""
        return out

    def _extend_body(self, text: str, out: ToolOutput) -> tuple[str, str] | None:
        """Add ``text`` to the open call's body; (body, text after the close) once the close
        tag has arrived, else None. Only the new text and the few characters before it are
        searched, and the body is joined once: linear in the body's length."""
        assert self._body is not None
        window = self._body_tail + text
        end = window.find(HERMES_CLOSE)
        if end < 0:
            self._body.append(text)
            self._body_tail = window[-(len(HERMES_CLOSE) - 1):]
            fresh = self._unscanned + text
            keep = _partial_suffix(fresh, HERMES_CLOSE)
            self._unscanned = fresh[len(fresh) - keep:]
            self._scan(fresh[: len(fresh) - keep], out)
            return None
        before = "".join(self._body)
        body = before[: len(before) - len(self._body_tail)] + window[:end]
        self._unscanned = ""
        self._scan(body[self._scanner.offset:], out)
        return body, window[end + len(HERMES_CLOSE):]

    def _scan(self, text: str, out: ToolOutput) -> None:
        """The scanner reads the body's next characters; a stream releases what it learnt."""
        piece = self._scanner.feed(text)
        if not self._stream:
            self._arguments.append(piece)
            return
        if self._ended:
            return
        if self._scanner.canonical and not self._announced:
            assert self._scanner.name is not None
            out.items.append(CallOpened(self._scanner.name))
            self._announced = True
        if piece:
            out.items.append(ArgumentsText(piece, self._scanner.arguments_end is not None))
        if self._scanner.broken_at is not None:
            out.items.append(CallClosed("malformed"))
            self._ended = True

    def _close_call(self, body: str, out: ToolOutput, closed: bool, cut: bool = False) -> None:
        scanner = self._scanner
        if self._announced:
            if not self._ended:
                out.items.append(CallClosed("complete" if scanner.complete else "malformed" if closed else "cut_short"))
            self._after_call = True
        elif scanner.complete:
            assert scanner.name is not None
            out.items.append(ParsedToolCall(scanner.name, "".join(self._arguments)))
            self._after_call = True
        elif cut and scanner.canonical and scanner.broken_at is None:  # what a stream announced
            assert scanner.name is not None and not closed
            out.items.append(CutCall(scanner.name, "".join(self._arguments)))
            self._after_call = True
        else:
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
        self._scanner, self._arguments = CallBodyScanner(), []
        self._announced = self._ended = False


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of ``text`` that could begin ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _held_tail(text: str, tag: str) -> int:
    """How many trailing characters to hold back: trailing whitespace (it may precede a
    call) plus the longest suffix that could begin ``tag``."""
    partial = _partial_suffix(text, tag)
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
    return ParsedToolCall(whole_characters(data["name"]), json.dumps(whole_characters(arguments), ensure_ascii=False))


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
