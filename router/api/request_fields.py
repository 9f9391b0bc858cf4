"""Which request fields each endpoint supports: the one whitelist.

A field outside it is refused with 400 naming it, so a client never believes an option took
effect when it did not. Fields in ``ACCEPTED_AT_DEFAULT`` are accepted only at the value
that changes nothing (clients often send them explicitly); any other value is refused the
same way. A ``null`` value counts as absent. Structured output (``response_format`` other than
plain text) is not supported. ``IGNORED_CHAT_FIELDS`` are accepted on chat and change nothing, as
the Responses API accepts them (``store``: nothing is stored; ``prompt_cache_key`` is not a
session source there either); only their types are checked. A top-level ``enable_thinking`` is refused, as neither vLLM nor SGLang reads one:
``chat_template_kwargs`` carries it (``router.api.template_kwargs``); a top-level
``thinking_token_budget`` is vLLM's cap on a reasoning model's thinking. The Anthropic Messages
API (``router.api.anthropic_schema``) and the Responses API (``router.api.responses_schema``)
read their own fields and hand the chat parser only those.
"""

from __future__ import annotations

from typing import Any, Literal

from talaria.protocol.errors import bad_request

__all__ = ["ACCEPTED_AT_DEFAULT", "IGNORED_CHAT_FIELDS", "SUPPORTED_FIELDS", "check_fields"]

_COMMON = frozenset({
    "model", "max_tokens", "temperature", "top_p", "top_k", "seed", "n", "stop", "logprobs",
    "stream", "stream_options", "ignore_eos", "session_id", "talaria", "user",
})

IGNORED_CHAT_FIELDS: dict[str, type] = {
    "store": bool, "metadata": dict, "prompt_cache_key": str, "safety_identifier": str,
    "service_tier": str,
}

SUPPORTED_FIELDS: dict[str, frozenset[str]] = {
    "chat": _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                       "parallel_tool_calls", "chat_template_kwargs", "reasoning_effort",
                       "thinking_token_budget", *IGNORED_CHAT_FIELDS},
    "completion": _COMMON | {"prompt", "best_of", "echo"},
}

ACCEPTED_AT_DEFAULT: dict[str, Any] = {
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "logit_bias": {},
    "response_format": {"type": "text"},
    "modalities": ["text"],
}


def check_fields(data: dict[str, Any], kind: Literal["chat", "completion"]) -> None:
    supported = SUPPORTED_FIELDS[kind]
    refused = sorted(
        str(key) for key, value in data.items()
        if value is not None and key not in supported
        and not (key in ACCEPTED_AT_DEFAULT and value == ACCEPTED_AT_DEFAULT[key])
    )
    if refused:
        raise bad_request(
            f"unsupported field(s): {', '.join(refused)} (this server does not implement them)",
            refused[0],
        )
    if data.get("user") is not None and not isinstance(data["user"], str):
        raise bad_request("user must be a string", "user")  # OpenAI's end-user id
    if kind == "chat":
        for name, expected in IGNORED_CHAT_FIELDS.items():
            value = data.get(name)
            if value is not None and not isinstance(value, expected):
                raise bad_request(f"{name} must be {_TYPE_NAMES[expected]}", name)


_TYPE_NAMES = {bool: "a boolean", dict: "an object", str: "a string"}
