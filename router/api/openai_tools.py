"""OpenAI function tools: the request's ``tools``, ``tool_choice``, ``parallel_tool_calls`` and
assistant ``tool_calls``, validated; and a tool call as a response holds it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import orjson

from router.api.body_limits import check_depth
from talaria.protocol.errors import bad_request


@dataclass
class ToolRequest:
    """The tools a chat call offers the model and how it may use them (both APIs map here)."""

    tools: list[dict[str, Any]] | None = None  # OpenAI function tools, as the template takes them
    choice: Literal["auto", "none", "required", "function"] = "auto"
    function: str | None = None  # the one function ``choice == "function"`` names
    parallel: bool = True  # several calls in one answer

    @property
    def parse_calls(self) -> bool:
        """Whether the answer is searched for tool calls (tools offered, and not "none")."""
        return bool(self.tools) and self.choice != "none"

    def check(self, param: str = "tool_choice") -> None:
        names = {t["function"]["name"] for t in self.tools or []}
        if self.choice in ("required", "function") and not names:
            raise bad_request(f"tool_choice {self.choice!r} needs tools", param)
        if self.function is not None and self.function not in names:
            raise bad_request(f"tool_choice names function {self.function!r}, which is not in tools", param)


def assistant_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant turn's ``tool_calls``, each call's ``arguments`` as the object the chat
    template renders (templates write it with ``tojson``; the JSON string the API carries
    would be encoded twice), as the Responses and Anthropic paths pass theirs."""
    if not isinstance(calls, list):
        raise bad_request(f"{where}.tool_calls must be an array", f"{where}.tool_calls")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(f"{at}.function must be an object with a string name", f"{at}.function")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            arguments = call_arguments(arguments, f"{at}.function.arguments")
        elif not isinstance(arguments, dict):
            raise bad_request(f"{at}.function.arguments must be a JSON string or an object", f"{at}.function.arguments")
        out.append({**call, "function": {"name": function["name"], "arguments": arguments}})
    return out


def parse_tools(data: dict[str, Any]) -> ToolRequest:
    """``tools``, ``tool_choice``, ``parallel_tool_calls``: function tools only."""
    parsed = ToolRequest()
    tools = data.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad_request("tools must be an array of function tools", "tools")
        for j, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
                raise bad_request(f"tools[{j}] must be {{'type': 'function', 'function': {{...}}}}", "tools")
            name = function.get("name")
            if not isinstance(name, str) or not name:
                raise bad_request(f"tools[{j}].function.name must be a non-empty string", "tools")
            params = function.get("parameters")
            if params is not None and not isinstance(params, dict):
                raise bad_request(f"tools[{j}].function.parameters must be an object", "tools")
        parsed.tools = list(tools) or None
    choice = data.get("tool_choice")
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise bad_request("tool_choice must be 'none', 'auto', 'required' or "
                              "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
        parsed.choice, parsed.function = "function", name
    elif choice is not None:
        if choice not in ("none", "auto", "required"):
            raise bad_request("tool_choice must be 'none', 'auto', 'required' or a named function", "tool_choice")
        parsed.choice = choice
    parsed.check()
    if data.get("parallel_tool_calls") is not None:
        parsed.parallel = _flag(data, "parallel_tool_calls")
    return parsed


def tool_call_dict(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _flag(data: dict[str, Any], key: str) -> bool:
    value = data[key]
    if not isinstance(value, bool):
        raise bad_request(f"{key} must be a boolean", key)
    return value


def call_arguments(raw: str, where: str) -> dict[str, Any] | str:
    """A tool call's ``arguments`` string as the chat template renders it: the JSON object it
    holds (an empty string is ``{}``), or else the string itself, which the templates write
    as is. A call cut by the token limit comes back with its JSON cut (as OpenAI's do), and
    an agent sends that turn back in its history: refusing it would end the session, and its
    own text renders the prompt the model wrote, so its KV stays a prefix."""
    try:
        parsed = orjson.loads(raw or "{}")
    except orjson.JSONDecodeError:
        return raw
    if not isinstance(parsed, dict):
        return raw
    check_depth(parsed, where)  # the chat template walks it
    return parsed
