"""The Responses API's ``tools`` and ``tool_choice``, as the chat path's function tools.

What Codex offers (``router.api.responses_schema`` reads the rest of the body):
- ``function`` tools (flat ``name``, ``description``, ``parameters``; ``strict`` is accepted,
  the arguments are not constrained to the schema) -> chat function tools;
- ``custom`` (freeform) tools, such as Codex's ``apply_patch`` -> a function tool of the same
  name and description with one required string parameter ``input``. Their ``format`` (a
  grammar or plain text) is accepted and NOT enforced: the model is asked for a string and
  whatever string it writes is the call's input. A call to one is answered as a
  ``custom_tool_call`` whose ``input`` is that string (the arguments' JSON text when the
  model did not write an object with a string ``input``);
- ``namespace`` tools (MCP servers): their inner function and custom tools are offered flat,
  under their own names (a name another tool has gets ``<namespace>__<name>``); a call to one
  names its ``namespace`` again in the answer;
- any other tool type (``web_search``, ``image_generation``, ``file_search``,
  ``code_interpreter``, ``local_shell``, ``mcp``, ...) runs on OpenAI's servers, not here: it
  is skipped (the model is not offered it), logged, and named in the answer's
  ``X-Talaria-Tools-Skipped`` header. A tool that is not an object with a string ``type`` is a 400.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from talaria.protocol.errors import bad_request

__all__ = ["OfferedTool", "Tools", "custom_input", "parse_tools", "tool_choice"]

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
    """A custom tool call's input: the ``input`` string the model wrote, else its arguments' text."""
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get(CUSTOM_INPUT), str):
        return str(value[CUSTOM_INPUT])
    return arguments


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
