"""An answer that is whole before its call ends ends there, on its instance as a finished call.

With parallel tool calls off, nothing a model writes after its first whole call reaches the
answer (text after a call is dropped, so is a second call): the router ends the call there
rather than let the model write unseen to its end of turn or ``max_tokens``, a stream silent
all that while. It tells the instance the call was answered (``abort(..., answered=True)``),
as it does for a stop string, so the instance keeps the session's KV and books as for a
finished call. With parallel calls on, a later call could still come: the call runs to its end.
"""

from __future__ import annotations

from typing import Any

import pytest
from api_helpers import EOS, serve
from router_fakes import ScriptedInstance
from test_tool_call_streams_http import ARGUMENTS, SCHEMA, USER, read_events

from router.tokenization import ModelTokenizer

CALL = f'<tool_call>\n{{"name": "write", "arguments": {ARGUMENTS}}}\n</tool_call>'
RAMBLE = "\nNow I wait for the result of the call, and then I will go on." * 12
APIS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {  # path, body, parallel calls off
    "chat": ("/v1/chat/completions",
             {"messages": USER, "tools": [{"type": "function", "function": {"name": "write", "parameters": SCHEMA}}]},
             {"parallel_tool_calls": False}),
    "responses": ("/v1/responses",
                  {"input": "Write a.py", "tools": [{"type": "function", "name": "write", "parameters": SCHEMA}]},
                  {"parallel_tool_calls": False}),
    "messages": ("/v1/messages",
                 {"messages": USER, "max_tokens": 1000, "tools": [{"name": "write", "input_schema": SCHEMA}]},
                 {"tool_choice": {"type": "auto", "disable_parallel_tool_use": True}}),
}


def _collected(api: str, data: dict[str, Any]) -> tuple[list[str], int, str]:
    """(the calls' arguments, the output tokens counted, the finish) of a collected answer."""
    if api == "chat":
        choice = data["choices"][0]
        calls = [c["function"]["arguments"] for c in choice["message"]["tool_calls"] or []]
        return calls, data["usage"]["completion_tokens"], choice["finish_reason"]
    if api == "responses":
        calls = [item["arguments"] for item in data["output"] if item["type"] == "function_call"]
        return calls, data["usage"]["output_tokens"], data["status"]
    calls = [block["input"] for block in data["content"] if block["type"] == "tool_use"]
    return [str(c) for c in calls], data["usage"]["output_tokens"], data["stop_reason"]


def _streamed_finish(api: str, events: list[tuple[str | None, Any]]) -> tuple[str, int]:
    """(the finish, the output tokens counted) a stream ends with."""
    if api == "chat":
        chunks = [d for _, d in events if isinstance(d, dict)]
        finish = next(c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")
                      and c["choices"][0].get("finish_reason"))
        return finish, next(c["usage"]["completion_tokens"] for c in chunks if c.get("usage"))
    if api == "responses":
        done = next(d for name, d in events if name == "response.completed")
        return done["response"]["status"], done["response"]["usage"]["output_tokens"]
    delta = next(d for name, d in events if name == "message_delta")
    return delta["delta"]["stop_reason"], delta["usage"]["output_tokens"]


async def _run(tok: ModelTokenizer, api: str, parallel_off: bool) -> tuple[Any, list[Any], ScriptedInstance, int]:
    path, body, off = APIS[api]
    body = {"model": "tiny", **body, **(off if parallel_off else {})}
    answer = tok.encode_text(CALL + RAMBLE, add_special_tokens=False) + [EOS]
    instance = ScriptedInstance("i0", [answer, answer])
    async with serve(tok, {"i0": instance}) as client:
        resp = await client.post(path, json=body)
        assert resp.status == 200, await resp.text()
        collected = await resp.json()
        stream_body = {**body, "stream": True}
        if api == "chat":
            stream_body["stream_options"] = {"include_usage": True}
        resp = await client.post(path, json=stream_body)
        assert resp.status == 200
        events = [event async for event in read_events(resp)]
    return collected, events, instance, len(answer)


@pytest.mark.parametrize("api", sorted(APIS))
async def test_a_settled_call_ends_the_answer_and_its_call_answered(tiny_tokenizer: ModelTokenizer, api: str) -> None:
    collected, events, instance, whole = await _run(tiny_tokenizer, api, parallel_off=True)
    calls, used, finish = _collected(api, collected)
    assert len(calls) == 1 and finish in ("tool_calls", "completed", "tool_use")
    call_tokens = len(tiny_tokenizer.encode_text(CALL, add_special_tokens=False))
    assert call_tokens <= used < whole / 2  # the ramble after the call was never generated
    finish, streamed_used = _streamed_finish(api, events)
    assert finish in ("tool_calls", "completed", "tool_use")
    assert call_tokens <= streamed_used < whole / 2
    # both calls ended on the instance as answered: its session's KV and books kept
    assert instance.answered == [c.call_id for c in instance.calls] and len(instance.calls) == 2


@pytest.mark.parametrize("api", sorted(APIS))
async def test_with_parallel_calls_on_the_call_runs_to_its_end(tiny_tokenizer: ModelTokenizer, api: str) -> None:
    collected, events, instance, whole = await _run(tiny_tokenizer, api, parallel_off=False)
    calls, used, finish = _collected(api, collected)
    assert len(calls) == 1 and used == whole
    assert _streamed_finish(api, events)[1] == whole
    assert instance.answered == [] and instance.aborted == []


async def test_a_stop_string_ends_the_call_answered(tiny_tokenizer: ModelTokenizer) -> None:
    answer = tiny_tokenizer.encode_text("Hello world, this is a test.", add_special_tokens=False) + [EOS]
    instance = ScriptedInstance("i0", [answer])
    async with serve(tiny_tokenizer, {"i0": instance}) as client:
        resp = await client.post("/v1/chat/completions", json={
            "model": "tiny", "messages": USER, "stop": ["world"]})
        data = await resp.json()
    assert resp.status == 200 and data["choices"][0]["message"]["content"] == "Hello "
    assert instance.answered == [instance.calls[0].call_id]
