"""Anthropic Messages API requests, read into the router's one chat request form.

A ``/v1/messages`` body is translated into the OpenAI chat body the chat template takes
(``system`` -> a system message, ``tool_use`` blocks -> assistant ``tool_calls``, each
``tool_result`` block -> a ``tool`` message, ``tools[].input_schema`` -> function
``parameters``; a built-in client tool such as ``bash_20250124`` -> a function of its
documented schema, a server tool such as ``web_search_20250305`` a 400:
``router.api.anthropic_builtin_tools``) and then validated by the same parser as
``/v1/chat/completions``, so both APIs accept and reject alike. What has no OpenAI counterpart stays here: consecutive turns of one
role merge (as Anthropic's API does; each message's text on lines of its own); a final assistant turn is a prefill the answer continues;
Claude Code's ``metadata.user_id`` may name the session. A ``system`` message in ``messages`` (Anthropic's
mid-conversation system message: Claude Code sends its agent list as one after the user's turn) is a
user turn of the prompt (``openai_schema.one_system``); as the first message it is a 400, as
Anthropic's (the system prompt goes in the top-level ``system`` field), unless it has no content
(Anthropic's directive form, taken anywhere), which adds nothing. A ``tool_use`` block outside an
assistant message, or a ``tool_result`` block outside a user one, is a 400 naming it. ``image`` and ``document`` blocks, in
a user turn or a tool result, become a line naming what was left out
(``router.api.media_placeholders``; a plain-text document is its text), never a 400: Claude Code
resends every image its Read tool ever returned. ``thinking`` switches a reasoning model's
thinking (``router.api.template_kwargs``): ``enabled`` or ``adaptive`` renders the template with
it on and the reasoning comes back as a thinking block; absent (Anthropic's default: no
extended thinking), ``disabled`` or unreadable renders it off, so a template that reads the
switch (Qwen3's) has the model answer without thinking. A template that does not read it
leaves the model thinking, and the reasoning is then left out of the answer. An ``enabled``
thinking's ``budget_tokens`` (an integer >= 0; any other value, or none, caps nothing) becomes
chat's ``thinking_token_budget``: the engine ends the thinking there
(``router.api.reasoning.thinking_budget_fields``). ``thinking`` blocks in the history are left
out of the prompt. Fields the router has no use for (``cache_control``, ``service_tier``,
``output_config.effort``, ...) are accepted and ignored. Structured output (``output_config.format``, the beta's ``output_format``) is
refused with a 400 naming it, as chat's ``response_format`` and the Responses API's
``text.format`` are: its client parses the answer as JSON of its schema. So are MCP servers
(``mcp_servers``, on a call and on a count; an empty array is accepted as none): the router
connects to none, and a client would wait for their tools' results.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import orjson

from router.api import openai_schema
from router.api.anthropic_builtin_tools import builtin_function
from router.api.media_placeholders import Omissions, OwnLines, join_text
from router.api.template_kwargs import thinking_switch
from talaria.protocol.errors import bad_request

__all__ = ["MessagesRequest", "parse_messages", "parse_count_tokens", "metadata_session_id"]

# Claude Code's older user_id: user_<hash>_account_<account uuid, perhaps empty>_session_<uuid>
_LEGACY_USER_ID = re.compile(r"user_[0-9a-fA-F]+_account_[^_]*_session_(.+)\Z", re.DOTALL)

_IGNORED_BLOCKS = frozenset({"thinking", "redacted_thinking"})  # no slot in an open model's template
_MEDIA_BLOCKS = frozenset({"image", "document"})
_BLOCK_ROLES = {"tool_use": "assistant", "tool_result": "user"}  # the one role whose message holds each


@dataclass
class MessagesRequest:
    body: openai_schema.CompletionBody
    prefill: str = ""  # a final assistant turn's text: the answer continues it


def parse_messages(data: Any) -> MessagesRequest:
    data = _object(data)
    max_tokens = data.get("max_tokens")
    if max_tokens is None:
        raise bad_request("max_tokens: Field required", "max_tokens")
    _refuse_structured_output(data)
    return _parse(data, {"max_tokens": max_tokens, "stream": data.get("stream")})


def parse_count_tokens(data: Any) -> MessagesRequest:
    return _parse(_object(data), {})


def _parse(data: dict[str, Any], extra: dict[str, Any]) -> MessagesRequest:
    _refuse_mcp_servers(data.get("mcp_servers"))
    temperature = data.get("temperature")
    if temperature is not None and (not isinstance(temperature, int | float) or not 0 <= temperature <= 1):
        raise bad_request("temperature must be a number in [0, 1]", "temperature")
    omitted = Omissions()
    messages, prefill = _messages(data.get("messages"), data.get("system"), omitted)
    chat: dict[str, Any] = {
        "model": data.get("model"),
        "messages": messages,
        "temperature": temperature,
        "top_p": data.get("top_p"),
        "top_k": data.get("top_k"),
        "stop": _stop_sequences(data.get("stop_sequences")),
        **extra,
    }
    thinking = _thinking_enabled(data.get("thinking"))
    chat["chat_template_kwargs"] = thinking_switch(thinking)
    chat["thinking_token_budget"] = _budget_tokens(data.get("thinking"))
    tools = data.get("tools")
    if tools is not None:
        chat["tools"] = _tools(tools)
    chat.update(_tool_choice(data.get("tool_choice"), bool(tools)))
    body = openai_schema.parse_chat(chat)
    body.media.count += omitted.count
    body.metadata_session_id = metadata_session_id(data.get("metadata"))
    body.show_reasoning = thinking
    if prefill and body.tools.choice in ("required", "function"):
        raise bad_request("a final assistant turn (prefill) cannot be combined with a tool_choice "
                          "that forces a tool call", "tool_choice")
    return MessagesRequest(body, prefill)


def _thinking_enabled(thinking: Any) -> bool:
    """The request asked for the model's thinking (``{"type": "enabled", ...}`` or
    ``"adaptive"``); absent, ``disabled`` or unreadable, it did not."""
    return isinstance(thinking, dict) and thinking.get("type") in ("enabled", "adaptive")


def _budget_tokens(thinking: Any) -> int | None:
    """An enabled thinking's ``budget_tokens``, when it is an integer >= 0; anything else
    (Anthropic refuses below 1024 and from ``max_tokens`` on) caps nothing, as before."""
    budget = thinking.get("budget_tokens") if isinstance(thinking, dict) and thinking.get("type") == "enabled" else None
    return budget if isinstance(budget, int) and not isinstance(budget, bool) and budget >= 0 else None


def _refuse_structured_output(data: dict[str, Any]) -> None:
    """A JSON schema the answer must follow cannot be enforced here: a 400, not free text."""
    config = data.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise bad_request("output_config must be an object", "output_config")
    for name, value in (("output_config.format", (config or {}).get("format")),
                        ("output_format", data.get("output_format"))):
        if value is not None:
            raise bad_request(f"{name} is not supported: this server cannot constrain the answer "
                              "to a JSON schema (structured output)", name)


def _refuse_mcp_servers(servers: Any) -> None:
    """The MCP connector (``mcp_servers``) is not implemented: a 400 naming it, unless it
    names no server (absent, null or ``[]``)."""
    if servers is None or servers == []:
        return
    if not isinstance(servers, list):
        raise bad_request("mcp_servers must be an array", "mcp_servers")
    raise bad_request("mcp_servers is not supported: this server connects to no MCP server (the MCP "
                      "connector); define the tools in tools and run them on the client", "mcp_servers")


def metadata_session_id(metadata: Any) -> str | None:
    """The session Claude Code names in ``metadata.user_id``: a JSON string with
    ``session_id``, or the older ``user_<hex hash>_account_<id>_session_<uuid>``. Any other
    user id is the end user's (Anthropic SDK users send one for all their conversations):
    no session."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise bad_request("metadata must be an object", "metadata")
    user = metadata.get("user_id")
    if not isinstance(user, str) or not user:
        return None
    if user.startswith("{"):
        try:
            parsed = orjson.loads(user)
        except orjson.JSONDecodeError:
            return None
        session = parsed.get("session_id") if isinstance(parsed, dict) else None
        return session if isinstance(session, str) and session else None
    legacy = _LEGACY_USER_ID.match(user)  # any other string is an end user's id, no session
    return legacy.group(1) if legacy else None


def _object(data: Any) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    return data


def _kind(block: Any) -> str | None:
    """A block's (or tool_choice's) ``type`` when it is a string; else None, which no check
    accepts (a list or object there is a 400 naming the block, never a set lookup's 500)."""
    kind = block.get("type") if isinstance(block, dict) else None
    return kind if isinstance(kind, str) else None


def _stop_sequences(stops: Any) -> list[str] | None:
    """The stop strings, checked here against every bound the OpenAI parser would check them
    against, so that the error names this API's field."""
    if stops is None:
        return None
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad_request("stop_sequences must be an array of non-empty strings", "stop_sequences")
    if len(stops) > openai_schema.MAX_STOP_STRINGS:
        raise bad_request(f"stop_sequences may hold at most {openai_schema.MAX_STOP_STRINGS} "
                          "strings", "stop_sequences")
    return stops or None


def _messages(messages: Any, system: Any, omitted: Omissions) -> tuple[list[dict[str, Any]], str]:
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty array", "messages")
    # Consecutive messages of one role merge into one turn: the blocks of each message of it.
    turns: list[tuple[str, list[list[dict[str, Any]]]]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"{where} must be an object with a role and content", where)
        _check_role(message, i)
        blocks = _blocks(message.get("content"), message["role"], f"{where}.content", omitted)
        if message["role"] == "system" and not blocks:
            continue  # the directive form (no content): no text for the prompt
        if turns and turns[-1][0] == message["role"]:
            turns[-1][1].append(blocks)
        else:
            turns.append((message["role"], [blocks]))
    if not turns:
        raise bad_request("messages must hold a user or assistant message", "messages")
    prefill = ""
    if turns[-1][0] == "assistant":
        role, merged = turns.pop()
        if any(b["type"] not in ("text", *_IGNORED_BLOCKS) for blocks in merged for b in blocks):
            raise bad_request("a final assistant turn (prefill) may hold only text", "messages")
        prefill = _turn_text("".join(b["text"] for b in blocks if b["type"] == "text") for blocks in merged)
        if not turns:
            raise bad_request("messages must hold a user turn before a final assistant turn", "messages")
    out: list[dict[str, Any]] = []
    if system is not None:
        out.append({"role": "system", "content": _text(system, "system", omitted)})
    for role, merged in turns:
        out.extend(_assistant(merged) if role == "assistant" else _user(role, merged))
    return out, prefill


def _check_role(message: dict[str, Any], i: int) -> None:
    """``user`` or ``assistant``; or ``system``, Anthropic's mid-conversation system message
    (Claude Code sends one after the user's turn), which may not come first (a 400 there, as
    Anthropic's: the system prompt goes in the top-level field) unless it has no content,
    the directive form Anthropic takes at any position."""
    role, where = message.get("role"), f"messages[{i}]"
    if role not in ("user", "assistant", "system"):
        raise bad_request(f"{where}.role must be 'user' or 'assistant', got {role!r} (the system prompt "
                          "goes in the top-level system field)", f"{where}.role")
    if role == "system" and i == 0 and message.get("content") != []:
        raise bad_request(f"{where}.role: a message of role 'system' cannot be the first in messages; "
                          "put the system prompt in the top-level system field", f"{where}.role")


def _blocks(content: Any, role: str, where: str, omitted: Omissions) -> list[dict[str, Any]]:
    """A message's content blocks, each checked; a tool_use block only in an assistant
    message and a tool_result block only in a user one (elsewhere the prompt had no place
    for them and they were dropped without a word)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or an array of content blocks", where)
    out = []
    for j, block in enumerate(content):
        kind = _kind(block)
        at = f"{where}[{j}]"
        if kind in _BLOCK_ROLES and role != _BLOCK_ROLES[kind]:
            raise bad_request(f"{at}: a {kind} block belongs in a message of role {_BLOCK_ROLES[kind]!r}, "
                              f"not {role!r}", at)
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise bad_request(f"{at}.text must be a string", at)
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise bad_request(f"{at}: a tool_use block needs a string id and name", at)
            if not isinstance(block.get("input", {}), dict):
                raise bad_request(f"{at}.input must be an object", at)
        elif kind == "tool_result":
            if not isinstance(block.get("tool_use_id"), str) or not block["tool_use_id"]:
                raise bad_request(f"{at}.tool_use_id must be a non-empty string", at)
            block = {**block, "content": _text(block.get("content", ""), f"{at}.content", omitted)}
        elif kind in _MEDIA_BLOCKS:
            block = {"type": "text", "text": _media(block, kind, at, omitted)}
        elif kind not in _IGNORED_BLOCKS:
            raise bad_request(f"{at}: content blocks of type {kind!r} are not supported "
                              "(text, image, document, tool_use, tool_result and thinking are)", at)
        out.append(block)
    return out


def _text(content: Any, where: str, omitted: Omissions) -> str:
    """A string, or the text of an array of text blocks (the form system and tool results
    take; an image or document block in it is a line naming it)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or an array of text blocks", where)
    texts: list[str] = []
    for j, block in enumerate(content):
        kind = _kind(block)
        if kind in _MEDIA_BLOCKS:
            texts.append(_media(block, str(kind), f"{where}[{j}]", omitted))
        elif kind != "text" or not isinstance(block.get("text"), str):
            raise bad_request(f"{where}[{j}] must be a text, image or document block", where)
        else:
            texts.append(block["text"])
    return join_text(texts)


def _media(block: dict[str, Any], kind: str, where: str, omitted: Omissions) -> str:
    """An image's or document's placeholder line; a plain-text document's text, as it is."""
    source = block.get("source")
    stype = source.get("type") if isinstance(source, dict) else None
    if kind == "document" and stype == "text" and isinstance(source.get("data"), str):
        return OwnLines(source["data"])
    if kind == "document" and stype == "content":
        return OwnLines(_text(source.get("content"), f"{where}.source.content", omitted))
    return omitted.anthropic_source(kind, block, where)


def _turn_text(texts: Iterable[str]) -> str:
    """The text of a turn merged from consecutive messages: each message's text on lines of
    its own (a line break between two; an empty one adds none), so no words are glued. The
    text blocks of one message are joined as they are."""
    return "\n".join(text for text in texts if text)


def _user(role: str, merged: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Tool results first (as ``tool`` messages, in order), then the turn's text."""
    out: list[dict[str, Any]] = []
    for block in (b for blocks in merged for b in blocks):
        if block["type"] == "tool_result":
            text = block["content"]
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                        "content": f"Error: {text}" if block.get("is_error") else text})
    texts = [[b["text"] for b in blocks if b["type"] == "text"] for blocks in merged]
    if any(texts) or not out:
        out.append({"role": role, "content": _turn_text(join_text(t) for t in texts)})
    return out


def _assistant(merged: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    message: dict[str, Any] = {"role": "assistant", "content": _turn_text(
        "".join(b["text"] for b in blocks if b["type"] == "text") for blocks in merged)}
    calls = [
        {"id": b["id"], "type": "function",
         "function": {"name": b["name"], "arguments": b.get("input", {})}}  # the template's tojson
        for blocks in merged for b in blocks if b["type"] == "tool_use"
    ]
    if calls:
        message["tool_calls"] = calls
    return [message]


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise bad_request("tools must be an array", "tools")
    out = []
    for j, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise bad_request(f"tools[{j}] must be an object with a name", "tools")
        schema = tool.get("input_schema")
        if schema is None:  # a built-in client tool, by its type (router.api.anthropic_builtin_tools)
            out.append(builtin_function(tool, f"tools[{j}]"))
            continue
        if not isinstance(schema, dict):
            raise bad_request(f"tools[{j}] ({tool['name']!r}): input_schema must be an object", "tools")
        function: dict[str, Any] = {"name": tool["name"], "parameters": schema}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any, has_tools: bool) -> dict[str, Any]:
    """Anthropic's tool_choice as chat's; one that forces a call needs tools, said in
    Anthropic's words (chat's check would name its own ``required``)."""
    if choice is None:
        return {}
    kind = _kind(choice)
    if kind in ("any", "tool") and not has_tools:
        raise bad_request(f"tool_choice of type {kind!r} needs tools", "tool_choice")
    mapped = {"auto": "auto", "any": "required", "none": "none"}
    if kind in mapped:
        out: dict[str, Any] = {"tool_choice": mapped[kind]}
    elif kind == "tool" and isinstance(choice.get("name"), str):
        out = {"tool_choice": {"type": "function", "function": {"name": choice["name"]}}}
    else:
        raise bad_request("tool_choice must be {'type': 'auto' | 'any' | 'none'} or "
                          "{'type': 'tool', 'name': ...}", "tool_choice")
    if choice.get("disable_parallel_tool_use") is True:
        out["parallel_tool_calls"] = False
    return out
