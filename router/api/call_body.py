"""A tool call's JSON body read as it arrives: ``{"name": "<name>", "arguments": {...}}``.

The scanner checks the body character by character as strict JSON (RFC 8259, as clients
parse it: no ``NaN``, no raw control characters in strings, nothing after the object but
whitespace) and finds the span of the arguments object in it, so the arguments can be sent
while the model writes them. It *commits* to a call once the body has begun in the canonical
form: an object whose first member is ``"name"`` with a non-empty string and whose second
is ``"arguments"`` (or ``"parameters"``) whose value opens an object. Before that point a
body in any other shape is no concern of the scanner (``canonical`` turns False: the caller
parses the whole body later); after it, a character that cannot continue the JSON, or a
later member that names the call or its arguments again, breaks the call (``broken_at``).

Invariant: every text :meth:`CallBodyScanner.feed` returns is the next piece of the
arguments object's raw text, only from characters checked valid, so the pieces of one body
joined are always a prefix of its arguments' text, and the whole of it once ``complete``.
"""

from __future__ import annotations

import json
import re

__all__ = ["CallBodyScanner"]

_WS = " \t\n\r"
_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]+')
_WS_RUN = re.compile(r"[ \t\n\r]+")
_HEX = frozenset("0123456789abcdefABCDEF")
_ESCAPES = frozenset('"\\/bfnrt')
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
_CALL_KEYS = frozenset(("name", "arguments", "parameters"))

# Modes: what the next character may be.
_START, _VALUE, _VALUE_OR_CLOSE, _KEY, _KEY_OR_CLOSE, _COLON, _AFTER, _END = range(8)
_STRING, _ESCAPE, _UNICODE, _NUMBER, _LITERAL = range(8, 13)
# Number states (JSON's grammar); the terminal ones may end the number.
_SIGN, _ZERO, _INT, _DOT, _FRAC, _EXP, _EXP_SIGN, _EXP_DIGITS = range(8)
_NUMBER_ENDS = frozenset((_ZERO, _INT, _FRAC, _EXP_DIGITS))


class CallBodyScanner:
    def __init__(self) -> None:
        self.offset = 0  # characters fed so far
        self.name: str | None = None
        self.canonical: bool | None = None  # None: undecided; True: committed to a call
        self.arguments_start: int | None = None  # offset of the arguments object's "{"
        self.arguments_end: int | None = None  # offset just past its "}"
        self.broken_at: int | None = None  # offset of the first character breaking a committed call
        self.done = False  # the outer object closed
        self._mode = _START
        self._stack: list[str] = []  # "o" / "a" for each open object / array
        self._in_key = False
        self._members = 0  # keys the outer object has had
        self._capture: list[str] | None = None  # raw text of an outer key or of the name string
        self._literal = ""  # the rest of a literal being read
        self._hex_left = 0  # hex digits a \\u escape still needs
        self._number = _SIGN

    @property
    def complete(self) -> bool:
        """The body is a whole, valid call in the canonical form."""
        return bool(self.canonical) and self.done and self.broken_at is None

    def feed(self, text: str) -> str:
        """Read ``text`` (the body's next characters); return the arguments' text among them."""
        base = self.offset
        i = 0
        while i < len(text) and self.canonical is not False and self.broken_at is None:
            i = self._step(text, i, base)
        self.offset = base + len(text)
        if not self.canonical or self.arguments_start is None:
            return ""
        start = max(self.arguments_start, base)
        end = min(x for x in (self.arguments_end, self.broken_at, self.offset) if x is not None)
        return text[start - base:end - base] if end > start else ""

    def _step(self, text: str, i: int, base: int) -> int:
        """Read from ``text[i]``; return the index of the next character to read."""
        mode, c = self._mode, text[i]
        if mode == _STRING:
            run = _STRING_RUN.match(text, i)
            if run is not None:
                if self._capture is not None:
                    self._capture.append(run.group())
                return run.end()
            if self._capture is not None:
                self._capture.append(c)
            if c == '"':
                self._string_end(base + i)
            elif c == "\\":
                self._mode = _ESCAPE
            else:
                self._fail(base + i)  # a raw control character
            return i + 1
        if c in _WS and mode not in (_ESCAPE, _UNICODE, _NUMBER, _LITERAL):
            ws = _WS_RUN.match(text, i)
            assert ws is not None
            return ws.end()
        if mode == _ESCAPE or mode == _UNICODE:
            if self._capture is not None:
                self._capture.append(c)
            if mode == _ESCAPE and c in _ESCAPES:
                self._mode = _STRING
            elif mode == _ESCAPE and c == "u":
                self._mode, self._hex_left = _UNICODE, 4
            elif mode == _UNICODE and c in _HEX:
                self._hex_left -= 1
                self._mode = _UNICODE if self._hex_left else _STRING
            else:
                self._fail(base + i)
            return i + 1
        if mode == _NUMBER:
            nxt = _number_next(self._number, c)
            if nxt is not None:
                self._number = nxt
                return i + 1
            if self._number not in _NUMBER_ENDS:
                self._fail(base + i)
                return i + 1
            self._mode = _AFTER
            return i  # the character after the number, read in its own mode
        if mode == _LITERAL:
            if c != self._literal[0]:
                self._fail(base + i)
            self._literal = self._literal[1:]
            if not self._literal:
                self._mode = _AFTER
            return i + 1
        self._structure(c, base + i)
        return i + 1

    def _structure(self, c: str, at: int) -> None:
        """A character outside strings, numbers and literals (whitespace already skipped)."""
        mode = self._mode
        if mode == _START:
            if c != "{":
                self.canonical = False  # not an object: the whole body decides
                return
            self._stack.append("o")
            self._mode = _KEY_OR_CLOSE
        elif mode in (_VALUE, _VALUE_OR_CLOSE):
            if mode == _VALUE_OR_CLOSE and c == "]":
                self._close(c, at)
            else:
                self._value(c, at)
        elif mode in (_KEY, _KEY_OR_CLOSE):
            if c == '"':
                self._in_key, self._mode = True, _STRING
                if len(self._stack) == 1:
                    self._capture = ['"']
            elif mode == _KEY_OR_CLOSE and c == "}":
                self._close(c, at)
            else:
                self._fail(at)
        elif mode == _COLON:
            if c == ":":
                self._mode = _VALUE
            else:
                self._fail(at)
        elif mode == _AFTER:
            if c == ",":
                self._mode = _KEY if self._stack[-1] == "o" else _VALUE
            elif c in "}]":
                self._close(c, at)
            else:
                self._fail(at)
        else:
            self._fail(at)  # _END: only whitespace may follow the object

    def _value(self, c: str, at: int) -> None:
        if len(self._stack) == 1 and self.canonical is None:
            if c != ('"' if self._members == 1 else "{"):  # the name a string, the arguments an object
                self.canonical = False
                return
            if self._members == 2:
                self.canonical, self.arguments_start = True, at
        if c == '"':
            self._in_key, self._mode = False, _STRING
            if len(self._stack) == 1 and self._members == 1:
                self._capture = ['"']
        elif c in "{[":
            self._stack.append("o" if c == "{" else "a")
            self._mode = _KEY_OR_CLOSE if c == "{" else _VALUE_OR_CLOSE
        elif c == "-" or "0" <= c <= "9":
            self._mode = _NUMBER
            self._number = _SIGN if c == "-" else _ZERO if c == "0" else _INT
        elif c in _LITERALS:
            self._mode, self._literal = _LITERAL, _LITERALS[c]
        else:
            self._fail(at)

    def _string_end(self, at: int) -> None:
        raw = "".join(self._capture) if self._capture is not None else None
        self._capture = None
        if not self._in_key:
            self._mode = _AFTER
            if raw is not None:  # the name's value
                self.name = json.loads(raw)
                if not self.name:
                    self.canonical = False
            return
        self._mode = _COLON
        if raw is None:
            return
        self._members += 1
        if self.canonical is None:
            if raw not in (('"name"',) if self._members == 1 else ('"arguments"', '"parameters"')):
                self.canonical = False
        elif json.loads(raw) in _CALL_KEYS:
            self._fail(at)  # the call named again: which one the model meant is unclear

    def _close(self, c: str, at: int) -> None:
        if self._stack[-1] != ("o" if c == "}" else "a"):
            self._fail(at)
            return
        self._stack.pop()
        if not self._stack:
            self.done, self._mode = True, _END
            if self.canonical is None:
                self.canonical = False  # closed before its arguments began
            return
        self._mode = _AFTER
        if len(self._stack) == 1 and self._members == 2 and self.arguments_end is None and self.canonical:
            self.arguments_end = at + 1

    def _fail(self, at: int) -> None:
        if self.canonical:
            self.broken_at = at
        else:
            self.canonical = False


def _number_next(state: int, c: str) -> int | None:
    """The number state after ``c``, or None where ``c`` does not continue the number."""
    digit = "0" <= c <= "9"
    if state == _SIGN:
        return _ZERO if c == "0" else _INT if digit else None
    if state in (_ZERO, _INT, _FRAC) and c in "eE":
        return _EXP
    if state in (_ZERO, _INT) and c == ".":
        return _DOT
    if state in (_INT, _FRAC, _EXP_DIGITS):
        return state if digit else None
    if state == _DOT:
        return _FRAC if digit else None
    if state == _EXP:
        return _EXP_DIGITS if digit else _EXP_SIGN if c in "+-" else None
    if state == _EXP_SIGN:
        return _EXP_DIGITS if digit else None
    return None  # _ZERO: no digit may follow a leading zero
