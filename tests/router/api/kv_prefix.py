"""The prefix property of an agent's next prompt, through the router's three APIs.

An agent resends its history every call. For the session's KV to be reused, the next prompt
must start with the previous prompt plus the tokens the model generated (its answer, up to
and with its end-of-turn token): ``render(history + [answer as returned, in the next
request's form]) == render(history, add_generation_prompt=True) + answer + ...``.

:func:`round_trip` sends a first request to a router over a scripted instance that answers
with ``answer`` (its tokens, then end of turn), turns the API's answer into the next
request's history as a client does (chat: the message as returned, and a ``tool`` message
per call; Responses: the output items, and a ``function_call_output`` per call; Messages:
the content blocks, and a ``tool_result`` per ``tool_use``), sends that, and compares the
two prompts the instance received (:class:`Trip`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp.test_utils import TestClient
from api_helpers import EOS, named_events, serve, sse
from router_fakes import ScriptedInstance

from router.tokenization import ModelTokenizer

USER_TEXT = "What is the weather in Paris?"
TOOL_RESULT = "Sunny, 21 C."
NEXT_USER = "Thanks."
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@dataclass(frozen=True)
class Trip:
    """The first call's prompt, the answer's tokens and the next call's prompt."""

    prompt: list[int]
    answer: list[int]
    next_prompt: list[int]
    returned: Any  # what the API answered (the message, the output items, the content)

    @property
    def expected(self) -> list[int]:
        return self.prompt + self.answer

    @property
    def kept(self) -> int:
        """How many tokens of ``prompt + answer`` the next prompt starts with: the KV reused."""
        n = 0
        for a, b in zip(self.expected, self.next_prompt, strict=False):
            if a != b:
                break
            n += 1
        return n

    @property
    def holds(self) -> bool:
        return self.kept == len(self.expected)

    def explain(self, tok: ModelTokenizer) -> str:
        """Where the prompts part, as text."""
        k = self.kept
        return (f"kept {k} of {len(self.expected)} ({len(self.answer)} answer tokens); after "
                f"{tok.tokenizer.decode(self.expected[max(0, k - 12):k])!r}: generated "
                f"{tok.tokenizer.decode(self.expected[k:k + 16])!r}, resent "
                f"{tok.tokenizer.decode(self.next_prompt[k:k + 16])!r}")


async def round_trip(tok: ModelTokenizer, api: str, answer: str, *, stream: bool = False,
                     **config: Any) -> Trip:
    """``answer`` generated on ``api`` ("chat", "responses" or "messages") and sent back."""
    ids = tok.encode_text(answer, add_special_tokens=False) + [EOS]
    instance = ScriptedInstance("i0", [ids, tok.encode_text("Fine.", add_special_tokens=False) + [EOS]])
    async with serve(tok, {"i0": instance}, **config) as client:
        returned = await _TRIPS[api](client, stream)
    assert len(instance.calls) == 2
    return Trip(list(instance.calls[0].prompt_token_ids), ids, list(instance.calls[1].prompt_token_ids), returned)


async def _post(client: TestClient, path: str, body: dict[str, Any], stream: bool) -> Any:
    resp = await client.post(path, json={**body, "stream": stream})
    if stream:
        return await resp.text() if path != "/v1/chat/completions" else await sse(resp)
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def _chat(client: TestClient, stream: bool) -> Any:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}]
    history: list[dict[str, Any]] = [{"role": "user", "content": USER_TEXT}]
    body = {"model": "tiny", "messages": history, "tools": tools, "max_tokens": 200}
    got = await _post(client, "/v1/chat/completions", body, stream)
    message = _chat_message(got) if stream else got["choices"][0]["message"]
    calls = message.get("tool_calls") or []
    after = [{"role": "tool", "tool_call_id": c["id"], "content": TOOL_RESULT} for c in calls]
    history = [*history, message, *(after or [{"role": "user", "content": NEXT_USER}])]
    await _post(client, "/v1/chat/completions", {**body, "messages": history}, False)
    return message


def _chat_message(chunks: list[Any]) -> dict[str, Any]:
    """A streamed chat answer as a client assembles it (the openai SDK's accumulation)."""
    message: dict[str, Any] = {"role": "assistant", "content": None}
    calls: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        if chunk == "[DONE]" or not chunk["choices"]:
            continue
        delta = chunk["choices"][0]["delta"]
        if delta.get("content"):
            message["content"] = (message["content"] or "") + delta["content"]
        for key in ("reasoning_content",):
            if delta.get(key):
                message[key] = message.get(key, "") + delta[key]
        for piece in delta.get("tool_calls") or []:
            call = calls.setdefault(piece["index"], {"id": piece.get("id"), "type": "function",
                                                      "function": {"name": "", "arguments": ""}})
            call["function"]["name"] += piece.get("function", {}).get("name") or ""
            call["function"]["arguments"] += piece.get("function", {}).get("arguments") or ""
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


async def _responses(client: TestClient, stream: bool) -> Any:
    tools = [{"type": "function", "name": "get_weather", "parameters": PARAMETERS}]
    items: list[dict[str, Any]] = [{"role": "user", "content": USER_TEXT}]
    body = {"model": "tiny", "input": items, "tools": tools, "max_output_tokens": 200}
    got = await _post(client, "/v1/responses", body, stream)
    if stream:
        got = next(data["response"] for name, data in named_events(got) if name == "response.completed")
    output = got["output"]
    after = [{"type": "function_call_output", "call_id": i["call_id"], "output": TOOL_RESULT}
             for i in output if i["type"] == "function_call"]
    items = [*items, *output, *(after or [{"role": "user", "content": NEXT_USER}])]
    await _post(client, "/v1/responses", {**body, "input": items}, False)
    return output


async def _messages(client: TestClient, stream: bool) -> Any:
    tools = [{"name": "get_weather", "input_schema": PARAMETERS}]
    history: list[dict[str, Any]] = [{"role": "user", "content": USER_TEXT}]
    body = {"model": "tiny", "messages": history, "tools": tools, "max_tokens": 200,
            "thinking": {"type": "enabled", "budget_tokens": 1024}}
    got = await _post(client, "/v1/messages", body, stream)
    content = _message_blocks(got) if stream else got["content"]
    results = [{"type": "tool_result", "tool_use_id": b["id"], "content": TOOL_RESULT}
               for b in content if b["type"] == "tool_use"]
    history = [*history, {"role": "assistant", "content": content},
               {"role": "user", "content": results or NEXT_USER}]
    await _post(client, "/v1/messages", {**body, "messages": history}, False)
    return content


def _message_blocks(text: str) -> list[dict[str, Any]]:
    """A streamed Messages answer's content blocks, as the anthropic SDK accumulates them."""
    blocks: list[dict[str, Any]] = []
    partial: dict[int, str] = {}
    for name, data in named_events(text):
        if name == "content_block_start":
            blocks.append(dict(data["content_block"]))
        elif name == "content_block_delta":
            delta, block = data["delta"], blocks[data["index"]]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "input_json_delta":
                partial[data["index"]] = partial.get(data["index"], "") + delta["partial_json"]
            elif delta["type"] == "signature_delta":
                block["signature"] = delta["signature"]
    for index, raw in partial.items():
        blocks[index]["input"] = orjson.loads(raw)
    return blocks


_TRIPS = {"chat": _chat, "responses": _responses, "messages": _messages}
