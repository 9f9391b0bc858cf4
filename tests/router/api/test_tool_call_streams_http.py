"""Streamed tool calls through the three APIs, over HTTP, on the tiny models' tokenizer: the
arguments leave the router while the model is still writing them (the instance holds the
closing tag back until the client has read them), joined they are the collected answer's
arguments, and a call announced and then broken ends the stream as documented."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from api_helpers import EOS, serve
from router_fakes import ScriptedInstance

from router.api.answer_parser import ARGUMENT_DELTA_CHARS
from router.tokenization import ModelTokenizer
from talaria.protocol import CallEvent, CallRequest

SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}, "text": {"type": "string"}}}
ARGUMENTS = '{"path":"a.py",  "text":"def f():\\n    return [1, 2.5e3, null]\\n"}'  # as the model writes them
BEFORE = f'Writing it.\n<tool_call>\n{{"name": "write", "arguments": {ARGUMENTS}}}\n'
AFTER = "</tool_call>"
USER = [{"role": "user", "content": "Write a.py"}]
APIS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {"messages": USER, "tools": [
        {"type": "function", "function": {"name": "write", "parameters": SCHEMA}}]}),
    "messages": ("/v1/messages", {"messages": USER, "max_tokens": 300, "tools": [
        {"name": "write", "input_schema": SCHEMA}]}),
    "responses": ("/v1/responses", {"input": "Write a.py", "tools": [
        {"type": "function", "name": "write", "parameters": SCHEMA}]}),
}


def fragments(api: str, name: str | None, data: Any) -> list[str]:
    """The argument fragments one stream event carries."""
    if api == "chat":
        choices = data.get("choices") if isinstance(data, dict) else None
        calls = (choices[0]["delta"].get("tool_calls") or []) if choices else []
        return [c["function"]["arguments"] for c in calls if c["function"].get("arguments")]
    if api == "messages":
        delta = data.get("delta", {}) if name == "content_block_delta" else {}
        return [delta["partial_json"]] if delta.get("type") == "input_json_delta" else []
    return [data["delta"]] if name == "response.function_call_arguments.delta" else []


class GatedInstance(ScriptedInstance):
    """Answers ``before`` + ``after`` a token per event, waiting for ``gate`` before ``after``."""

    def __init__(self, tok: ModelTokenizer, before: str, after: str) -> None:
        head = tok.encode_text(before, add_special_tokens=False)
        super().__init__("i0", [head + tok.encode_text(after, add_special_tokens=False) + [EOS]])
        self.split = len(head)
        self.gate = asyncio.Event()

    async def submit(self, call: CallRequest) -> AsyncIterator[CallEvent]:
        sent = 0
        async for event in super().submit(call):
            if sent == self.split:
                await self.gate.wait()
            sent += 1
            yield event


async def read_events(resp: aiohttp.ClientResponse) -> AsyncIterator[tuple[str | None, Any]]:
    """The SSE events of ``resp`` as they arrive: (event name or None, data)."""
    name: str | None = None
    async for raw in resp.content:
        line = raw.decode().rstrip("\n")
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            data = line[len("data: "):]
            yield name, data if data == "[DONE]" else json.loads(data)
            name = None


@pytest.mark.parametrize("api", list(APIS))
async def test_arguments_stream_before_the_closing_tag_and_join_to_the_whole_answer(
        api: str, tiny_tokenizer: ModelTokenizer) -> None:
    path, body = APIS[api]
    instance = GatedInstance(tiny_tokenizer, BEFORE, AFTER)
    async with serve(tiny_tokenizer, {"i0": instance}) as client:
        resp = await client.post(path, json={"model": "tiny", **body, "stream": True})
        assert resp.status == 200
        stream = read_events(resp)
        pieces: list[str] = []
        while "".join(pieces) != ARGUMENTS:  # the closing tag is not written yet
            name, data = await asyncio.wait_for(anext(stream), 5)
            pieces += fragments(api, name, data)
        # in pieces of ARGUMENT_DELTA_CHARS or more, the last when the arguments object closed
        assert len(pieces) >= 2 and all(len(p) >= ARGUMENT_DELTA_CHARS for p in pieces[:-1])
        instance.gate.set()
        rest = [event async for event in stream]
        assert not [f for name, data in rest for f in fragments(api, name, data)]
        collected = await (await client.post(path, json={"model": "tiny", **body})).json()
    if api == "chat":
        assert rest[-2][1]["choices"][0]["finish_reason"] == "tool_calls" and rest[-1][1] == "[DONE]"
        assert collected["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == ARGUMENTS
    elif api == "messages":
        assert [n for n, _ in rest][-3:] == ["content_block_stop", "message_delta", "message_stop"]
        assert rest[-2][1]["delta"]["stop_reason"] == "tool_use"
        assert collected["content"][1]["input"] == json.loads("".join(pieces))
    else:
        done = [d for n, d in rest if n == "response.function_call_arguments.done"]
        assert done[0]["arguments"] == ARGUMENTS == collected["output"][1]["arguments"]
        assert rest[-1][0] == "response.completed"


async def stream_events(tok: ModelTokenizer, api: str, text: str, **extra: Any) -> list[tuple[str | None, Any]]:
    path, body = APIS[api]
    instance = ScriptedInstance("i0", [tok.encode_text(text, add_special_tokens=False) + [EOS]])
    async with serve(tok, {"i0": instance}) as client:
        resp = await client.post(path, json={"model": "tiny", **body, **extra, "stream": True})
        assert resp.status == 200
        return [event async for event in read_events(resp)]


BROKEN = 'Sure.\n<tool_call>\n{"name": "write", "arguments": {"path": "a.py", "text": "x" + "y"}}\n</tool_call>'
FAILURES: dict[str, Callable[[list[tuple[str | None, Any]]], Any]] = {
    "chat": lambda events: events[-2][1]["error"],
    "messages": lambda events: events[-1][1]["error"],
    "responses": lambda events: events[-1][1]["response"]["error"],
}


@pytest.mark.parametrize("api", list(APIS))
async def test_a_call_that_breaks_after_it_was_announced_fails_the_stream(
        api: str, tiny_tokenizer: ModelTokenizer) -> None:
    """Collected, this answer is text (malformed calls are text); streamed, the call was
    announced and its arguments begun before the JSON broke, so the stream ends in an error."""
    events = await stream_events(tiny_tokenizer, api, BROKEN)
    assert "".join(f for name, data in events for f in fragments(api, name, data)) == '{"path": "a.py", "text": "x" '
    error = FAILURES[api](events)
    assert "tool call 0 ('write') broke off after it was streamed" in error["message"]
    if api == "chat":
        assert error["code"] == "malformed_tool_call" and events[-1][1] == "[DONE]"
    elif api == "responses":
        assert events[-1][0] == "response.failed" and events[-2][0] == "error"
        (item,) = [i for i in events[-1][1]["response"]["output"] if i["type"] == "function_call"]
        assert item["status"] == "incomplete" and item["arguments"] == '{"path": "a.py", "text": "x" '


@pytest.mark.parametrize("api", list(APIS))
async def test_a_call_cut_short_by_the_length_limit_ends_as_truncated_answers_do(
        api: str, tiny_tokenizer: ModelTokenizer) -> None:
    text = f"{BEFORE}{AFTER}"
    ids = tiny_tokenizer.encode_text(text, add_special_tokens=False)
    limit = next(n for n in range(len(ids), 0, -1) if tiny_tokenizer.decode(ids[:n]).endswith("return"))
    cap = {"chat": "max_tokens", "messages": "max_tokens", "responses": "max_output_tokens"}[api]
    events = await stream_events(tiny_tokenizer, api, text, **{cap: limit})
    joined = "".join(f for name, data in events for f in fragments(api, name, data))
    assert ARGUMENTS.startswith(joined) and joined.endswith("return")
    if api == "chat":
        assert events[-2][1]["choices"][0]["finish_reason"] == "length" and events[-1][1] == "[DONE]"
    elif api == "messages":
        assert events[-2][1]["delta"]["stop_reason"] == "max_tokens" and events[-1][0] == "message_stop"
    else:
        final = events[-1][1]["response"]
        assert events[-1][0] == "response.incomplete" and final["output"][1]["status"] == "incomplete"
        assert final["output"][1]["arguments"] == joined


async def test_a_broken_call_s_failed_response_counts_the_tokens_the_router_read(
        tiny_tokenizer: ModelTokenizer) -> None:
    """The router ends the answer where the call broke (its call is aborted there), so its
    usage counts the tokens read up to that point, as for a stop string; not the usage so
    far that the instance's first event carried (one token)."""
    events = await stream_events(tiny_tokenizer, "responses", BROKEN)
    ids = tiny_tokenizer.encode_text(BROKEN, add_special_tokens=False)
    read = next(n for n in range(1, len(ids) + 1) if "+" in tiny_tokenizer.decode(ids[:n]))
    usage = events[-1][1]["response"]["usage"]
    assert events[-1][0] == "response.failed" and usage["output_tokens"] == read > 1
    assert usage["total_tokens"] == usage["input_tokens"] + read
