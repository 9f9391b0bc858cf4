"""OpenAI Responses API requests (``POST /v1/responses``), read into the router's one chat form.

A Responses body is translated into the chat body the chat template takes and then validated
by the same parser as ``/v1/chat/completions`` (``openai_schema.parse_chat``), so the APIs
accept and render alike:
- ``instructions`` -> a leading system message; ``input`` as a string (one user message) or a
  list of items: ``message`` items (``type`` may be left out) of role ``system``,
  ``developer`` (rendered as ``system``: chat templates know no developer role), ``user`` or
  ``assistant``, whose content is a string or ``input_text`` / ``output_text`` parts;
  ``function_call`` items (``call_id``, ``name``, ``arguments``) -> the assistant turn's
  ``tool_calls`` (joined to the assistant message just before them, as the model wrote them);
  ``function_call_output`` items (``call_id``, ``output``) -> ``tool`` messages; ``reasoning``
  items are dropped (an open model's template has no slot for another model's reasoning);
- ``tools`` of ``type: "function"`` (flat ``name``, ``description``, ``parameters``; ``strict``
  is accepted, the arguments are not constrained to the schema), ``tool_choice`` (``auto``,
  ``none``, ``required``, ``{"type": "function", "name": ...}``), ``parallel_tool_calls``;
- ``max_output_tokens``, ``temperature``, ``top_p``, ``stream``; Talaria's ``session_id`` and
  ``talaria`` hints as on the chat API; ``prompt_cache_key`` (Codex's conversation id) names
  the session when nothing stronger does (``router.session_identity``).

Accepted and ignored, since they do not change the answer: ``store`` (nothing is stored),
``metadata`` (echoed), ``user``, ``safety_identifier``, ``service_tier``, ``reasoning`` (no
reasoning items are produced), ``include`` (but ``message.output_text.logprobs``),
``text.verbosity``, ``stream_options``; ``truncation: "disabled"``, ``background: false`` and
``top_logprobs: 0`` at those values only.

Refused with a 400 naming the field or item: ``previous_response_id`` (the router stores no
responses: send the whole conversation, as Codex does), any other unknown field, input items
of other types (``item_reference``, built-in tool calls, ...), content other than text (images,
files, audio), tools other than functions, a ``text.format`` other than plain text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from router import openai_schema
from router.openai_tools import json_arguments
from talaria.protocol.errors import bad_request

__all__ = ["ResponsesRequest", "parse_responses"]

_PASSED = frozenset({"model", "temperature", "top_p", "stream", "parallel_tool_calls", "session_id", "talaria"})
_IGNORED = frozenset({"store", "metadata", "user", "safety_identifier", "service_tier", "reasoning",
                      "include", "text", "stream_options", "prompt_cache_key"})
_READ = frozenset({"input", "instructions", "tools", "tool_choice", "max_output_tokens", "previous_response_id"})
_AT_DEFAULT: dict[str, Any] = {"truncation": "disabled", "background": False, "top_logprobs": 0}
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_TEXT_PARTS = frozenset({"input_text", "output_text"})
_SKIPPED_ITEMS = frozenset({"reasoning"})
_REFUSED_INCLUDES = frozenset({"message.output_text.logprobs"})


@dataclass
class ResponsesRequest:
    body: openai_schema.CompletionBody
    echo: dict[str, Any] = field(default_factory=dict)  # request fields the response object repeats


def parse_responses(data: Any) -> ResponsesRequest:
    """A ``/v1/responses`` body as the chat body it renders to, and what its answer echoes."""
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    _check_fields(data)
    if data.get("previous_response_id") is not None:
        raise bad_request("previous_response_id is not supported: this server stores no responses; "
                          "send the whole conversation in input (with store: false)", "previous_response_id")
    instructions = data.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("instructions must be a string", "instructions")
    max_output = data.get("max_output_tokens")
    if max_output is not None and (not _is_int(max_output) or not 1 <= max_output <= openai_schema.MAX_TOKENS_LIMIT):
        raise bad_request(f"max_output_tokens must be an integer in [1, {openai_schema.MAX_TOKENS_LIMIT}]",
                          "max_output_tokens")
    _check_ignored(data)
    chat: dict[str, Any] = {key: data[key] for key in _PASSED if key in data}
    chat["messages"] = _messages(data.get("input"), instructions)
    chat["max_tokens"] = max_output
    tools = data.get("tools")
    if tools is not None:
        chat["tools"] = _tools(tools)
    if data.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(data["tool_choice"])
    body = openai_schema.parse_chat(chat)
    key = data.get("prompt_cache_key")
    if key is not None and (not isinstance(key, str) or not key):
        raise bad_request("prompt_cache_key must be a non-empty string", "prompt_cache_key")
    body.metadata_session_id, body.session_hint_source = key, "prompt_cache_key"
    echo = {
        "instructions": instructions, "max_output_tokens": max_output,
        "metadata": data.get("metadata") or {}, "parallel_tool_calls": body.tools.parallel,
        "temperature": body.temperature, "top_p": body.top_p, "tools": tools or [],
        "tool_choice": data.get("tool_choice") or "auto", "prompt_cache_key": key,
    }
    return ResponsesRequest(body, echo)


def _check_fields(data: dict[str, Any]) -> None:
    known = _PASSED | _IGNORED | _READ
    refused = sorted(
        str(key) for key, value in data.items()
        if value is not None and key not in known and not (key in _AT_DEFAULT and value == _AT_DEFAULT[key])
    )
    if refused:
        raise bad_request(f"unsupported field(s): {', '.join(refused)} (this server does not implement "
                          "them)", refused[0])


def _check_ignored(data: dict[str, Any]) -> None:
    """The ignored fields' types, and the values of them that would change the answer."""
    for name in ("metadata", "reasoning", "text", "stream_options"):
        if data.get(name) is not None and not isinstance(data[name], dict):
            raise bad_request(f"{name} must be an object", name)
    for name in ("user", "safety_identifier", "service_tier"):
        if data.get(name) is not None and not isinstance(data[name], str):
            raise bad_request(f"{name} must be a string", name)
    if data.get("store") is not None and not isinstance(data["store"], bool):
        raise bad_request("store must be a boolean", "store")
    include = data.get("include")
    if include is not None:
        if not isinstance(include, list) or not all(isinstance(i, str) for i in include):
            raise bad_request("include must be an array of strings", "include")
        refused = sorted(_REFUSED_INCLUDES.intersection(include))
        if refused:
            raise bad_request(f"include {refused[0]!r} is not supported", "include")
    fmt = (data.get("text") or {}).get("format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise bad_request("text.format: only {'type': 'text'} is supported (structured output is not)",
                          "text.format")


def _messages(value: Any, instructions: str | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if instructions:
        out.append({"role": "system", "content": instructions})
    if isinstance(value, str):
        return [*out, {"role": "user", "content": value}]
    if value is None:
        raise bad_request("missing required field 'input'", "input")
    if not isinstance(value, list) or not value:
        raise bad_request("input must be a string or a non-empty array of items", "input")
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", where)
        kind = item.get("type", "message" if "role" in item else None)
        if not isinstance(kind, str):
            raise bad_request(f"{where}.type must be a string (message, function_call, "
                              "function_call_output or reasoning)", f"{where}.type")
        if kind == "message":
            role = item.get("role")
            role = _ROLES.get(role) if isinstance(role, str) else None
            if role is None:
                raise bad_request(f"{where}.role must be one of {sorted(_ROLES)}", f"{where}.role")
            out.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            _call(out, item, where)
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                        "content": _text(item.get("output"), f"{where}.output")})
        elif kind not in _SKIPPED_ITEMS:
            raise bad_request(f"{where}: input items of type {kind!r} are not supported (message, "
                              "function_call, function_call_output and reasoning are)", where)
    if not any(m["role"] != "system" for m in out):
        raise bad_request("input holds no user, assistant or tool turn", "input")
    return out


def _call(out: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    """A function call joins the assistant turn it follows (text, then calls, as the model
    wrote them); otherwise it starts an assistant turn of its own."""
    call_id, name = _string(item, "call_id", where), _string(item, "name", where)
    raw = item.get("arguments")
    if not isinstance(raw, str):
        raise bad_request(f"{where}.arguments must be a JSON string", f"{where}.arguments")
    arguments = json_arguments(raw, f"{where}.arguments")
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    if out and out[-1]["role"] == "assistant":
        out[-1].setdefault("tool_calls", []).append(call)
    else:
        out.append({"role": "assistant", "content": "", "tool_calls": [call]})


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{where}.{key} must be a non-empty string", f"{where}.{key}")
    return value


def _text(content: Any, where: str) -> str:
    """A string, or the text of an array of ``input_text`` / ``output_text`` parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or an array of text parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str) or kind not in _TEXT_PARTS:
            raise bad_request(f"{where}[{j}]: content of type {kind!r} is not supported (only input_text "
                              "and output_text are)", f"{where}[{j}]")
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{where}[{j}].text must be a string", f"{where}[{j}].text")
        texts.append(part["text"])
    return "".join(texts)


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise bad_request("tools must be an array", "tools")
    out = []
    for j, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise bad_request(f"tools[{j}]: tools of type {kind!r} are not supported (only function tools "
                              "are)", f"tools[{j}]")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"tools[{j}].name must be a non-empty string", f"tools[{j}].name")
        function: dict[str, Any] = {"name": name}
        if tool.get("description") is not None:
            if not isinstance(tool["description"], str):
                raise bad_request(f"tools[{j}].description must be a string", f"tools[{j}].description")
            function["description"] = tool["description"]
        params = tool.get("parameters")
        if params is not None:
            if not isinstance(params, dict):
                raise bad_request(f"tools[{j}].parameters must be an object", f"tools[{j}].parameters")
            function["parameters"] = params
        if tool.get("strict") is not None and not isinstance(tool["strict"], bool):
            raise bad_request(f"tools[{j}].strict must be a boolean", f"tools[{j}].strict")
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}",
                      "tool_choice")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
