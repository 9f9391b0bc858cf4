"""OpenAI Responses API requests (``POST /v1/responses``), read into the router's one chat form.

A Responses body is translated into the chat body the chat template takes and then validated
by the same parser as ``/v1/chat/completions`` (``openai_schema.parse_chat``), so the APIs
accept and render alike:
- ``instructions`` and the leading run of ``system`` / ``developer`` messages -> one system
  message, a later one -> a ``user`` message (``openai_schema.one_system``, as on the chat
  API);
- ``input`` as a string (one user message) or a list of items: ``message`` items (``type``
  may be left out) of role ``system``, ``developer``, ``user`` or ``assistant``, whose
  content is a string or ``input_text`` / ``output_text`` parts (an earlier answer's
  ``refusal`` part is its text); ``function_call`` items
  (``call_id``, ``name``, ``arguments``) and ``custom_tool_call`` items (``call_id``,
  ``name``, ``input`` -> the arguments ``{"input": input}``) -> the assistant turn's
  ``tool_calls`` (joined to the assistant message just before them, as the model wrote them);
  ``function_call_output`` and ``custom_tool_call_output`` items (``call_id``, ``output``: a
  string or a content list) -> ``tool`` messages; ``reasoning`` items are dropped (an open
  model's template has no slot for another model's reasoning, ``encrypted_content`` included);
- images and files: an ``input_image`` or ``input_file`` part, in a message or a tool
  output, is replaced by a line naming it (``router.api.media_placeholders``: its type and size,
  e.g. ``[image omitted: image/png, 48.2 KB; this model reads text only]``), not refused:
  Codex resends the whole history every turn, so one image (a screenshot a tool returned)
  would fail the conversation for good;
- ``tools``, ``tool_choice`` (``auto``, ``none``, ``required``, a function or custom tool by
  name), ``parallel_tool_calls``: see ``router.api.responses_tools`` (custom tools become a
  function of one string ``input``, their grammar not enforced; namespace tools are flattened;
  hosted tools such as ``web_search`` are skipped and named in a response header);
- ``max_output_tokens`` (a 400 for too large a value names it), ``temperature``, ``top_p``,
  ``stream``; Talaria's ``session_id`` and ``talaria`` hints as on the chat API. The session
  comes from the headers as on every API (Codex sends ``session_id``);
- ``reasoning.effort`` switches a reasoning model's thinking as chat's ``reasoning_effort`` does
  (``router.api.template_kwargs``: ``none`` or ``minimal`` off, ``low`` and up on, another value a
  400) and is echoed; a reasoning model's ``reasoning`` item comes back when it thought,
  without summary or encrypted content, whatever ``reasoning.summary`` asks.

Accepted and ignored, since they do not change the answer: ``store`` (nothing is stored),
``metadata`` (echoed), ``user``, ``safety_identifier``, ``service_tier``, ``include`` (but
``message.output_text.logprobs``), ``text.verbosity``, ``stream_options``, ``client_metadata``
(an object of strings, Codex's),
``context_management`` (an array of ``{"type": ...}``), ``prompt_cache_key`` (a string,
echoed; NOT a session source: OpenAI lets one key be shared by unrelated requests, so it
would merge conversations); ``truncation: "disabled"``, ``background: false`` and
``top_logprobs: 0`` at those values only.

Refused with a 400 naming the field or item: ``previous_response_id`` (the router stores no
responses: send the whole conversation, as Codex does), any other unknown field, input items
of other types (``item_reference``, built-in tool calls, ...), content parts other than text,
images and files (audio, ...), a tool that is not an object with a string ``type``, a
``text.format`` other than plain text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import structlog

from router.api import openai_schema
from router.api.media_placeholders import Omissions, join_text
from router.api.openai_tools import call_arguments
from router.api.responses_tools import CUSTOM_INPUT, Tools, parse_tools, tool_choice
from router.api.template_kwargs import effort_switch
from talaria.protocol.errors import bad_request

log = structlog.get_logger(__name__)

__all__ = ["ResponsesRequest", "parse_responses"]

_PASSED = frozenset({"model", "temperature", "top_p", "stream", "parallel_tool_calls", "session_id", "talaria"})
_IGNORED = frozenset({"store", "metadata", "user", "safety_identifier", "service_tier", "include", "text",
                      "stream_options", "prompt_cache_key", "client_metadata", "context_management"})
_READ = frozenset({"input", "instructions", "tools", "tool_choice", "max_output_tokens", "previous_response_id",
                   "reasoning"})
_AT_DEFAULT: dict[str, Any] = {"truncation": "disabled", "background": False, "top_logprobs": 0}
_ROLES = frozenset({"system", "developer", "user", "assistant"})
_TEXT_PARTS = frozenset({"input_text", "output_text"})
_SKIPPED_ITEMS = frozenset({"reasoning"})
_REFUSED_INCLUDES = frozenset({"message.output_text.logprobs"})


@dataclass
class ResponsesRequest:
    body: openai_schema.CompletionBody
    echo: dict[str, Any] = field(default_factory=dict)  # request fields the response object repeats
    tools: Tools = field(default_factory=Tools)  # what the model's calls name, and the tools skipped


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
    max_output = openai_schema.max_tokens_field(data.get("max_output_tokens"), "max_output_tokens")
    effort = _reasoning_effort(data.get("reasoning"))
    _check_ignored(data)
    tools = parse_tools(data["tools"]) if data.get("tools") is not None else Tools()
    chat: dict[str, Any] = {key: data[key] for key in _PASSED if key in data}
    omitted = Omissions()
    chat["messages"] = _messages(data.get("input"), instructions, tools, omitted)
    chat["max_tokens"] = max_output
    chat["tools"] = tools.chat
    chat["chat_template_kwargs"] = effort_switch(effort, "reasoning.effort")
    if data.get("tool_choice") is not None:
        chat["tool_choice"] = tool_choice(data["tool_choice"], tools)
    body = openai_schema.parse_chat(chat)
    body.max_tokens_param = "max_output_tokens"
    body.prompt_param = "input"
    body.media.count += omitted.count
    if tools.skipped:
        log.info("router.responses.tools_skipped", types=tools.skipped)
    echo = {
        "instructions": instructions, "max_output_tokens": max_output,
        "metadata": data.get("metadata") or {}, "parallel_tool_calls": body.tools.parallel,
        "temperature": _sent(data, "temperature"), "top_p": _sent(data, "top_p"),
        "tools": data.get("tools") or [],
        "tool_choice": data.get("tool_choice") or "auto", "prompt_cache_key": data.get("prompt_cache_key"),
        "reasoning": {"effort": effort, "summary": None},
    }
    return ResponsesRequest(body, echo, tools)


def _sent(data: dict[str, Any], name: str) -> float:
    """A sampling field as the request sent it (checked by then), else its default, 1."""
    return 1.0 if data.get(name) is None else float(data[name])


def _check_fields(data: dict[str, Any]) -> None:
    known = _PASSED | _IGNORED | _READ
    refused = sorted(
        str(key) for key, value in data.items()
        if value is not None and key not in known and not (key in _AT_DEFAULT and value == _AT_DEFAULT[key])
    )
    if refused:
        raise bad_request(f"unsupported field(s): {', '.join(refused)} (this server does not implement "
                          "them)", refused[0])


def _reasoning_effort(reasoning: Any) -> Any:
    """``reasoning.effort`` as sent (checked by ``effort_switch``); the rest is ignored."""
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise bad_request("reasoning must be an object", "reasoning")
    return reasoning.get("effort")


def _check_ignored(data: dict[str, Any]) -> None:
    """The ignored fields' types, and the values of them that would change the answer."""
    for name in ("metadata", "text", "stream_options", "client_metadata"):
        if data.get(name) is not None and not isinstance(data[name], dict):
            raise bad_request(f"{name} must be an object", name)
    if not all(isinstance(v, str) for v in (data.get("client_metadata") or {}).values()):
        raise bad_request("client_metadata must be an object of strings", "client_metadata")
    for name in ("user", "safety_identifier", "service_tier", "prompt_cache_key"):
        if data.get(name) is not None and not isinstance(data[name], str):
            raise bad_request(f"{name} must be a string", name)
    if data.get("store") is not None and not isinstance(data["store"], bool):
        raise bad_request("store must be a boolean", "store")
    context = data.get("context_management")
    if context is not None and (not isinstance(context, list) or not all(
            isinstance(c, dict) and isinstance(c.get("type"), str) for c in context)):
        raise bad_request("context_management must be an array of objects with a string type",
                          "context_management")
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


def _messages(value: Any, instructions: str | None, tools: Tools, omitted: Omissions) -> list[dict[str, Any]]:
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
            if not isinstance(role, str) or role not in _ROLES:
                raise bad_request(f"{where}.role must be one of {sorted(_ROLES)}", f"{where}.role")
            out.append({"role": role, "content": _text(item.get("content"), f"{where}.content", omitted)})
        elif kind in ("function_call", "custom_tool_call"):
            _call(out, item, where, tools)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                        "content": _text(item.get("output"), f"{where}.output", omitted)})
        elif kind not in _SKIPPED_ITEMS:
            raise bad_request(f"{where}: input items of type {kind!r} are not supported (message, "
                              "function_call, function_call_output, custom_tool_call, "
                              "custom_tool_call_output and reasoning are)", where)
    if not any(m["role"] not in ("system", "developer") for m in out):
        raise bad_request("input holds no user, assistant or tool turn", "input")
    return out  # parse_chat merges the system and developer messages (openai_schema.one_system)


def _call(out: list[dict[str, Any]], item: dict[str, Any], where: str, tools: Tools) -> None:
    """A function or custom tool call joins the assistant turn it follows (text, then calls,
    as the model wrote them); otherwise it starts an assistant turn of its own. A custom
    call's ``input`` goes back as the arguments ``{"input": ...}`` its function took."""
    call_id, name = _string(item, "call_id", where), _string(item, "name", where)
    namespace = item.get("namespace")
    name = tools.model_name(name, namespace if isinstance(namespace, str) else None)
    if item["type"] == "custom_tool_call":
        if not isinstance(item.get("input"), str):
            raise bad_request(f"{where}.input must be a string", f"{where}.input")
        arguments: dict[str, Any] | str = {CUSTOM_INPUT: item["input"]}
    else:
        raw = item.get("arguments")
        if not isinstance(raw, str):
            raise bad_request(f"{where}.arguments must be a JSON string", f"{where}.arguments")
        arguments = call_arguments(raw, f"{where}.arguments")
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


def _text(content: Any, where: str, omitted: Omissions) -> str:
    """A string, or the text of an array of ``input_text`` / ``output_text`` / ``refusal``
    parts (an image or file part is a line saying what was left out)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or an array of text parts", where)
    parts: list[str] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image":
            parts.append(omitted.openai_image(part.get("image_url"), part.get("file_id")))
        elif kind == "input_file":
            parts.append(omitted.openai_file(part.get("file_data"), part.get("filename"),
                                             part.get("file_id"), part.get("file_url")))
        elif kind == "refusal":  # a refused answer's part, in a history from OpenAI's API
            if not isinstance(part.get("refusal"), str):
                raise bad_request(f"{where}[{j}].refusal must be a string", f"{where}[{j}].refusal")
            parts.append(part["refusal"])
        elif not isinstance(kind, str) or kind not in _TEXT_PARTS:
            raise bad_request(f"{where}[{j}]: content of type {kind!r} is not supported (only input_text, "
                              "output_text, refusal, input_image and input_file are)", f"{where}[{j}]")
        elif not isinstance(part.get("text"), str):
            raise bad_request(f"{where}[{j}].text must be a string", f"{where}[{j}].text")
        else:
            parts.append(part["text"])
    return join_text(parts)
