"""Parse and validate OpenAI request bodies; build OpenAI response objects.

Parsing never trusts the body: every wrong type, missing field or out-of-range value raises
an :class:`~talaria.protocol.errors.ApiError` (400) whose message names the field. A field
the server does not support is refused the same way (``router.api.request_fields``), so no
option is silently ignored. A chat request's ``chat_template_kwargs`` and ``reasoning_effort``
become variables of the chat template (``router.api.template_kwargs``); its
``thinking_token_budget`` (vLLM's) caps a reasoning model's thinking
(``router.api.reasoning.thinking_budget_fields``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from router.api.media_placeholders import Omissions, join_text
from router.api.openai_tools import ToolRequest, assistant_tool_calls, parse_tools
from router.api.request_fields import check_fields
from router.api.template_kwargs import chat_template_kwargs, effort_switch
from talaria.protocol.errors import bad_request

MAX_STOP_STRINGS = 16
MAX_TOKENS_LIMIT = 1 << 24  # above any context length; the tokenizer's limit is checked later
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default, and vLLM's
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


@dataclass
class CompletionBody:
    """One validated /v1/chat/completions or /v1/completions request."""

    kind: Literal["chat", "completion"]
    model: str
    messages: list[dict[str, Any]] | None = None
    prompt: str | list[int] | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False
    session_id: str | None = None
    expected_gap_s: float | None = None
    last_call: bool = False
    ignore_eos: bool = False
    tools: ToolRequest = field(default_factory=ToolRequest)
    metadata_session_id: str | None = None  # the session Anthropic metadata.user_id names
    max_tokens_param: str = "max_tokens"  # the field ``max_tokens`` came from, named in errors
    default_max_tokens: int | None = None  # the limit when none is asked (None: the room left)
    prompt_param: str = "messages"  # the field the prompt came from, named in errors
    media: Omissions = field(default_factory=Omissions)  # images and files left out (router.api.media_placeholders)
    show_reasoning: bool = True  # a reasoning model's reasoning goes back (Anthropic: when thinking is enabled)
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # more chat template variables (router.api.template_kwargs)
    thinking_budget: int | None = None  # the most tokens a reasoning model may think (None: no cap)


def parse_chat(body: Any) -> CompletionBody:
    data = _object(body)
    check_fields(data, "chat")
    parsed = _common(data, "chat")
    parsed.messages = one_system(_messages(data.get("messages"), parsed.media))
    parsed.tools = parse_tools(data)
    parsed.template_kwargs = {**effort_switch(data.get("reasoning_effort"), "reasoning_effort"),
                              **chat_template_kwargs(data.get("chat_template_kwargs"))}
    parsed.thinking_budget = _thinking_budget(data.get("thinking_token_budget"))
    max_tokens = data.get("max_completion_tokens")
    name = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, name = data.get("max_tokens"), "max_tokens"
    parsed.max_tokens = max_tokens_field(max_tokens, name)
    parsed.max_tokens_param = name
    parsed.logprobs = _bool(data, "logprobs")
    top = data.get("top_logprobs")
    if top is not None and (not _is_int(top) or top != 0):
        raise bad_request(
            "top_logprobs is not supported beyond 0 (logprobs gives the chosen tokens' only)",
            "top_logprobs",
        )
    return parsed


def parse_completion(body: Any) -> CompletionBody:
    """A /v1/completions body. With no ``max_tokens`` (or a null one) the answer writes at
    most ``COMPLETION_DEFAULT_MAX_TOKENS`` (16) tokens, OpenAI's default for this API, which
    vLLM keeps; the chat, Messages and Responses APIs default to the room the context leaves
    (``router.api.output_budget``)."""
    data = _object(body)
    check_fields(data, "completion")
    parsed = _common(data, "completion")
    parsed.prompt = _prompt(data.get("prompt"))
    parsed.prompt_param = "prompt"
    parsed.max_tokens = max_tokens_field(data.get("max_tokens"), "max_tokens")
    parsed.default_max_tokens = COMPLETION_DEFAULT_MAX_TOKENS
    logprobs = data.get("logprobs")
    if logprobs is not None and (not _is_int(logprobs) or logprobs != 0):
        raise bad_request(
            "logprobs must be 0 or null: the chosen tokens' logprobs are returned, the most "
            "likely alternatives are not supported", "logprobs",
        )
    parsed.logprobs = logprobs is not None
    echo = data.get("echo")
    if echo is not None and echo is not False:
        raise bad_request("echo is not supported (only false)", "echo")
    best_of = data.get("best_of")
    if best_of is not None and not (_is_int(best_of) and best_of == 1):
        raise bad_request("best_of must be the integer 1", "best_of")
    return parsed


def _thinking_budget(value: Any) -> int | None:
    """vLLM's rule: an integer >= 0, or -1 (as null) for no cap."""
    if value is not None and (not _is_int(value) or value < -1):
        raise bad_request("thinking_token_budget must be an integer >= 0 (or -1 or null: no cap)",
                          "thinking_token_budget")
    return None if value == -1 else value


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def _common(data: dict[str, Any], kind: Literal["chat", "completion"]) -> CompletionBody:
    model = data.get("model")
    if model is None:
        raise bad_request("missing required field 'model'", "model")
    if not isinstance(model, str) or not model:
        raise bad_request("model must be a non-empty string", "model")
    parsed = CompletionBody(kind=kind, model=model)
    parsed.temperature = _number(data, "temperature", 1.0, 0.0, 2.0)
    parsed.top_p = _number(data, "top_p", 1.0, 0.0, 1.0)
    if parsed.top_p == 0.0:  # a nucleus of the likeliest token alone, as OpenAI and Anthropic take 0
        parsed.temperature, parsed.top_p = 0.0, 1.0  # greedy: the engine's top_p is in (0, 1]
    top_k = data.get("top_k")
    if top_k is not None and (not _is_int(top_k) or top_k < -1):
        raise bad_request("top_k must be an integer >= -1 (-1 or 0 disable it)", "top_k")
    parsed.top_k = max(0, top_k or 0)
    seed = data.get("seed")
    if seed is not None and not _is_int(seed):
        raise bad_request("seed must be an integer", "seed")
    parsed.seed = seed
    n = data.get("n")
    if n is not None and not (_is_int(n) and n == 1):
        raise bad_request("only n=1 is supported (an integer)", "n")
    parsed.stop = _stop(data.get("stop"))
    parsed.stream = _bool(data, "stream")
    options = data.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise bad_request("stream_options must be an object", "stream_options")
        if not parsed.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        parsed.include_usage = _bool(options, "include_usage", "stream_options.include_usage")
    parsed.ignore_eos = _bool(data, "ignore_eos")
    session_id = data.get("session_id")
    if session_id is not None and (not isinstance(session_id, str) or not session_id):
        raise bad_request("session_id must be a non-empty string", "session_id")
    parsed.session_id = session_id
    _hints(data.get("talaria"), parsed)
    return parsed


def _hints(hints: Any, parsed: CompletionBody) -> None:
    if hints is None:
        return
    if not isinstance(hints, dict):
        raise bad_request("talaria must be an object of session hints", "talaria")
    gap = hints.get("expected_gap_s")
    if gap is not None:
        if not _is_number(gap) or gap < 0:
            raise bad_request("talaria.expected_gap_s must be a number >= 0", "talaria.expected_gap_s")
        parsed.expected_gap_s = float(gap)
    parsed.last_call = _bool(hints, "last_call", "talaria.last_call")


def _messages(messages: Any, omitted: Omissions) -> list[dict[str, Any]]:
    if messages is None:
        raise bad_request("missing required field 'messages'", "messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty array", "messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"{where} must be an object", where)
        role = message.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise bad_request(f"{where}.role must be one of {sorted(_ROLES)}", f"{where}.role")
        clean = dict(message)
        clean["content"] = _content(message.get("content"), role, where, message, omitted)
        if role == "assistant" and message.get("tool_calls") is not None:
            clean["tool_calls"] = assistant_tool_calls(message["tool_calls"], where)
        if role == "assistant" and isinstance(message.get("reasoning"), str):
            # vLLM's name for what chat templates (Qwen3's) read as reasoning_content
            clean.setdefault("reasoning_content", clean.pop("reasoning"))
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise bad_request(f"{where}.tool_call_id must be a non-empty string", f"{where}.tool_call_id")
        out.append(clean)
    return out


def one_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The leading run of ``system`` and ``developer`` messages as one system message (joined
    by a blank line: several templates, e.g. Mistral's, Gemma's and newer Qwen's, refuse a
    second system message, and none renders ``developer``); a later one as a ``user``
    message, its content as it is. The chat and Responses APIs both merge here."""
    lead = 0
    while lead < len(messages) and messages[lead]["role"] in ("system", "developer"):
        lead += 1
    rest = [{**m, "role": "user"} if m["role"] in ("system", "developer") else m for m in messages[lead:]]
    if not lead:
        return rest
    return [{"role": "system", "content": "\n\n".join(m["content"] for m in messages[:lead])}, *rest]


def _content(content: Any, role: str, where: str, message: dict[str, Any], omitted: Omissions) -> str:
    """A string, or the text of an array of parts: ``text`` (an assistant's ``refusal`` too,
    as its ``refusal`` beside no content); an ``image_url`` or ``file`` part becomes a line
    naming what was left out (``router.api.media_placeholders``)."""
    if isinstance(content, str):
        return content
    if content is None and role == "assistant" and message.get("tool_calls"):
        return ""
    if content is None and role == "assistant" and isinstance(message.get("refusal"), str):
        return str(message["refusal"])  # an answer the model refused: its text
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or an array of content parts", f"{where}.content")
    parts: list[str] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image_url" and isinstance(part.get("image_url"), dict):
            parts.append(omitted.openai_image(part["image_url"].get("url")))
        elif kind == "refusal" and role == "assistant" and isinstance(part.get("refusal"), str):
            parts.append(part["refusal"])
        elif kind == "file" and isinstance(part.get("file"), dict):
            file = part["file"]
            parts.append(omitted.openai_file(file.get("file_data"), file.get("filename"), file.get("file_id")))
        elif kind != "text":
            raise bad_request(f"{where}.content[{j}] must be a text, image_url or file part "
                              f"(got {kind!r})", f"{where}.content")
        elif not isinstance(part.get("text"), str):
            raise bad_request(f"{where}.content[{j}].text must be a string", f"{where}.content")
        else:
            parts.append(part["text"])
    return join_text(parts)


def _prompt(prompt: Any) -> str | list[int]:
    if prompt is None:
        raise bad_request("missing required field 'prompt'", "prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > 1:  # OpenAI's batch: n answers in one response, which n=1 rules out too
            raise bad_request(f"a batch of {len(prompt)} prompts is not supported: send one prompt a request", "prompt")
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        return prompt
    if isinstance(prompt, list):
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        if not all(_is_int(t) and t >= 0 for t in prompt):
            raise bad_request("prompt must be a string or an array of token ids (integers >= 0)", "prompt")
        return list(prompt)
    raise bad_request("prompt must be a string or an array of token ids", "prompt")


def max_tokens_field(value: Any, name: str) -> int | None:
    """An output-token limit read from the field ``name`` (None: absent; 400 naming it)."""
    if value is None:
        return None
    if not _is_int(value):
        raise bad_request(f"{name} must be an integer", name)
    if value < 1:
        raise bad_request(f"{name} must be at least 1, got {value}", name)
    if value > MAX_TOKENS_LIMIT:
        raise bad_request(f"{name} is too large: {value}", name)
    return int(value)


def _stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad_request("stop must be a non-empty string or an array of non-empty strings", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"stop may hold at most {MAX_STOP_STRINGS} strings", "stop")
    return list(stop)


def _number(data: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = data.get(name)
    if value is None:
        return default
    if not _is_number(value) or not lo <= value <= hi:
        raise bad_request(f"{name} must be a number in [{lo:g}, {hi:g}]", name)
    return float(value)


def _bool(data: dict[str, Any], key: str, name: str | None = None) -> bool:
    value = data.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(f"{name or key} must be a boolean", name or key)
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


# ---- responses -----------------------------------------------------------------------------


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int,
               restored_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage; ``prompt_tokens_details.restored_tokens`` (an extension) says how many
    of the cached prompt tokens were restored from the host KV store."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens, "restored_tokens": restored_tokens},
    }


def token_text(token: bytes) -> str:
    """A token as logprobs name it: its text, or, for part of a character (an emoji split
    over tokens), ``bytes:`` and its bytes escaped (``bytes:\\xf0\\x9f``), as OpenAI's
    completions do; ``bytes`` carries the raw bytes either way."""
    try:
        return token.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in token)


def chat_logprobs(tokens: list[bytes], logprobs: list[float]) -> dict[str, Any]:
    return {
        "content": [
            {"token": token_text(t), "logprob": lp, "bytes": list(t), "top_logprobs": []}
            for t, lp in zip(tokens, logprobs, strict=False)
        ]
    }


def completion_logprobs(tokens: list[bytes], logprobs: list[float], offsets: list[int]) -> dict[str, Any]:
    """``text_offset``: where each token starts in the answer's text, in characters (a token
    inside a character starts at that character)."""
    return {
        "tokens": [token_text(t) for t in tokens],
        "token_logprobs": logprobs[: len(tokens)],
        "top_logprobs": None,
        "text_offset": offsets[: len(tokens)],
    }


def chat_completion(
    call_id: str,
    model: str,
    created: int,
    text: str,
    finish_reason: str | None,
    usage: dict[str, Any],
    logprobs: dict[str, Any] | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message = {"role": "assistant", "content": text or None, "tool_calls": tool_calls}
    return {
        "id": f"chatcmpl-{call_id}",
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        ],
        "usage": usage,
    }


def chat_chunk(
    call_id: str,
    model: str,
    created: int,
    delta: dict[str, Any] | None,
    finish_reason: str | None = None,
    usage: dict[str, Any] | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    choices = []
    if delta is not None:
        choices = [
            {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        ]
    return {
        "id": f"chatcmpl-{call_id}",
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage,
    }


def text_completion(
    call_id: str,
    model: str,
    created: int,
    text: str | None,
    finish_reason: str | None,
    usage: dict[str, Any] | None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A text_completion object; streamed chunks are the same object (``text=None``: a
    usage-only chunk with no choices)."""
    choices = []
    if text is not None:
        choices = [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]
    return {
        "id": f"cmpl-{call_id}",
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage,
    }
