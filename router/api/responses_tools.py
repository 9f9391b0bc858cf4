"""The Responses API's ``tools`` and ``tool_choice``, as the chat path's function tools.

What Codex offers (``router.api.responses_schema`` reads the rest of the body):
- ``function`` tools (flat ``name``, ``description``, ``parameters``; ``strict`` is accepted,
  the arguments are not constrained to the schema) -> chat function tools;
- ``custom`` (freeform) tools, such as Codex's ``apply_patch`` -> a function tool of the same
  name and description with one required string parameter ``input``. Their ``format`` (a
  grammar or plain text) is accepted and NOT enforced: the model is asked for a string and
  whatever string it writes is the call's input. A call to one is answered as a
  ``custom_tool_call`` whose ``input`` is that string (the arguments' JSON text when the
  model did not write an object with a string ``input``); streamed, the string is decoded
  as it arrives where ``input`` is the arguments' first member (:class:`CustomInputStream`);
- ``namespace`` tools (MCP servers): their inner function and custom tools are offered flat,
  under their own names (a name another tool has gets ``<namespace>__<name>``); a call to one
  names its ``namespace`` again in the answer;
- any other tool type (``web_search``, ``image_generation``, ``file_search``,
  ``code_interpreter``, ``local_shell``, ``mcp``, ...) runs on OpenAI's servers, not here: it
  is skipped (the model is not offered it), logged, and named in the answer's
  ``X-Talaria-Tools-Skipped`` header. A tool that is not an object with a string ``type`` is a 400.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from router.api.tool_calls import whole_characters
from talaria.protocol.errors import bad_request

__all__ = ["CustomInputStream", "OfferedTool", "Tools", "custom_input", "parse_tools", "tool_choice"]

CUSTOM_INPUT = "input"  # the one parameter a custom tool's function takes


@dataclass(frozen=True)
class OfferedTool:
    """One tool as the client named it, behind the name the model sees."""

    name: str
    custom: bool = False
    namespace: str | None = None


@dataclass
class Tools:
    chat: list[dict[str, Any]] = field(default_factory=list)  # chat function tools, as the template takes them
    offered: dict[str, OfferedTool] = field(default_factory=dict)  # by the name the model sees
    skipped: list[str] = field(default_factory=list)  # the types not offered, in request order, once each

    def model_name(self, name: str, namespace: str | None) -> str:
        """The name the model saw for a call the client names (history items)."""
        if namespace is None:
            return name
        for seen, tool in self.offered.items():
            if tool.name == name and tool.namespace == namespace:
                return seen
        return name


def parse_tools(tools: Any) -> Tools:
    if not isinstance(tools, list):
        raise bad_request("tools must be an array", "tools")
    out = Tools()
    flat = {t["name"] for t in tools if isinstance(t, dict) and t.get("type") in ("function", "custom")
            and isinstance(t.get("name"), str)}  # another type of name is refused below
    for j, tool in enumerate(tools):
        where = f"tools[{j}]"
        kind = _kind(tool, where)
        if kind == "namespace":
            namespace = _name(tool, where)
            inner = tool.get("tools")
            if not isinstance(inner, list):
                raise bad_request(f"{where}.tools must be an array", f"{where}.tools")
            for k, sub in enumerate(inner):
                at = f"{where}.tools[{k}]"
                sub_kind = _kind(sub, at)
                if sub_kind not in ("function", "custom"):
                    raise bad_request(f"{at}: a namespace holds function and custom tools, not {sub_kind!r}", at)
                _add(out, sub, at, sub_kind == "custom", namespace, flat)
        elif kind in ("function", "custom"):
            _add(out, tool, where, kind == "custom", None, flat)
        elif kind not in out.skipped:
            out.skipped.append(kind)
    return out


def custom_input(arguments: str) -> str:
    """A custom tool call's input: the ``input`` string the model wrote (half a surrogate pair
    in it, which JSON allows and UTF-8 cannot carry, as U+FFFD), else its arguments' text."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get(CUSTOM_INPUT), str):
        return str(whole_characters(value[CUSTOM_INPUT]))
    return arguments


class CustomInputStream:
    """A custom tool's input decoded from its call's arguments as they arrive, where they
    begin ``{"input": "`` (JSON whitespace allowed between the tokens); in any other shape
    nothing is decoded and the input goes out whole at the call's end. Invariant: the text
    :meth:`feed` returned so far is a prefix of the input of the call, if it completes (the
    model writing ``input`` twice aside, where :func:`custom_input` takes the last)."""

    _OPENING = ("{", f'"{CUSTOM_INPUT}"', ":", '"')

    def __init__(self) -> None:
        self._head = ""  # the arguments read before the input string opened
        self._state = "opening"  # then "string", "done" (its closing quote read) or "whole"
        self._escape: str | None = None  # an escape under way, after its backslash
        self._high: str | None = None  # a high surrogate waiting for its low half
        self.sent: list[str] = []

    def feed(self, raw: str) -> str:
        """The input's next decoded text, from the arguments' next piece ``raw``."""
        if self._state == "opening":
            self._head += raw
            start = _opened_at(self._head, self._OPENING)
            if start is None:
                self._state = "whole"
            elif start > 0:
                self._state, raw = "string", self._head[start:]
        if self._state != "string":
            return ""
        text = self._decode(raw)
        self.sent.append(text)
        return text

    def rest(self, value: str) -> str:
        """What to send at the call's end for its input ``value``: what the pieces sent lack."""
        sent = "".join(self.sent)
        return value[len(sent):] if value.startswith(sent) else ""

    def _decode(self, raw: str) -> str:
        out: list[str] = []
        for c in raw:
            if self._state == "done":
                break
            if self._escape is None:
                if c == "\\":
                    self._escape = ""
                    continue
                out.append(self._flush_high())
                if c == '"':
                    self._state = "done"
                else:
                    out.append(c)
                continue
            self._escape += c
            if self._escape[0] != "u":
                out += [self._flush_high(), _SIMPLE_ESCAPES.get(c, c)]
                self._escape = None
            elif len(self._escape) == 5:
                unit, self._escape = chr(int(self._escape[1:], 16)), None
                if "\udc00" <= unit <= "\udfff" and self._high is not None:
                    out.append((self._high + unit).encode("utf-16", "surrogatepass").decode("utf-16"))
                    self._high = None
                    continue
                out.append(self._flush_high())
                if "\ud800" <= unit <= "\udbff":
                    self._high = unit
                else:
                    out.append(_LONE if "\udc00" <= unit <= "\udfff" else unit)
        return "".join(out)

    def _flush_high(self) -> str:
        """A high surrogate that no low one followed: alone, it is U+FFFD."""
        high, self._high = self._high, None
        return _LONE if high is not None else ""


_SIMPLE_ESCAPES = {"b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_LONE = "\ufffd"  # half a surrogate pair: no client can be sent one (orjson refuses it)


def _opened_at(head: str, tokens: tuple[str, ...]) -> int | None:
    """Where the string after ``tokens`` (JSON whitespace between them) starts in ``head``:
    0 while ``head`` may still become them, None once it cannot."""
    token, matched = 0, 0
    for at, c in enumerate(head):
        if matched == 0 and token > 0 and c in " \t\n\r":
            continue
        if c != tokens[token][matched]:
            return None
        matched += 1
        if matched == len(tokens[token]):
            token, matched = token + 1, 0
            if token == len(tokens):
                return at + 1
    return 0


def tool_choice(choice: Any, tools: Tools) -> Any:
    """The chat ``tool_choice`` of a Responses one (``function`` or ``custom`` by name)."""
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom") and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": tools.model_name(choice["name"], None)}}
    raise bad_request("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}",
                      "tool_choice")


def _kind(tool: Any, where: str) -> str:
    kind = tool.get("type") if isinstance(tool, dict) else None
    if not isinstance(kind, str) or not kind:
        raise bad_request(f"{where} must be an object with a string type", where)
    return kind


def _name(tool: dict[str, Any], where: str) -> str:
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"{where}.name must be a non-empty string", f"{where}.name")
    return name


def _add(out: Tools, tool: dict[str, Any], where: str, custom: bool, namespace: str | None,
         flat: set[Any]) -> None:
    """One tool offered; a namespace's tool whose name another tool has (``flat``: the names
    of those outside namespaces) is qualified by its namespace."""
    name = _name(tool, where)
    function: dict[str, Any] = {"name": name}
    if tool.get("description") is not None:
        if not isinstance(tool["description"], str):
            raise bad_request(f"{where}.description must be a string", f"{where}.description")
        function["description"] = tool["description"]
    if custom:
        if tool.get("format") is not None and not isinstance(tool["format"], dict):
            raise bad_request(f"{where}.format must be an object", f"{where}.format")
        function["parameters"] = {"type": "object", "properties": {CUSTOM_INPUT: {"type": "string"}},
                                  "required": [CUSTOM_INPUT]}
    else:
        params = tool.get("parameters")
        if params is not None:
            if not isinstance(params, dict):
                raise bad_request(f"{where}.parameters must be an object", f"{where}.parameters")
            function["parameters"] = params
        if tool.get("strict") is not None and not isinstance(tool["strict"], bool):
            raise bad_request(f"{where}.strict must be a boolean", f"{where}.strict")
    seen = name
    if namespace is not None and (seen in out.offered or seen in flat):
        seen = function["name"] = f"{namespace.rstrip('_')}__{name}"
    out.offered[seen] = OfferedTool(name, custom, namespace)
    out.chat.append({"type": "function", "function": function})
