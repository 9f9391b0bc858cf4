"""A tool call the answer's length limit cuts, collected as its stream gives it. On the OpenAI
APIs it is a call holding the arguments' JSON text so far, ``finish_reason`` ``length`` (a
Responses ``function_call`` item ``incomplete``), as OpenAI returns it and as the stream
already sent it; it was content holding the raw ``<tool_call>`` text, with the prefix a
forced call's prompt ends with. On the Anthropic API it stays text, ``stop_reason``
``max_tokens``: ``tool_use.input`` is an object and cannot hold cut JSON."""

from __future__ import annotations

from typing import Any

import pytest
from api_helpers import EOS, serve
from router_fakes import ScriptedInstance
from test_tool_call_stream import HERMES, TEXTS, stream, summary
from test_tool_call_streams_http import ARGUMENTS, SCHEMA, USER, fragments, read_events

from router.api.answer_parser import AnswerParser, ToolCall
from router.tokenization import ModelTokenizer

FORCED = f" {ARGUMENTS}}}\n</tool_call>"  # the answer after the forced call's prefix
AUTO = f'Writing it.\n<tool_call>\n{{"name": "write", "arguments": {ARGUMENTS}}}\n</tool_call>'
APIS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {  # path, body, its forcing tool_choice
    "chat": ("/v1/chat/completions",
             {"messages": USER, "tools": [{"type": "function", "function": {"name": "write", "parameters": SCHEMA}}]},
             {"type": "function", "function": {"name": "write"}}),
    "responses": ("/v1/responses",
                  {"input": "Write a.py", "tools": [{"type": "function", "name": "write", "parameters": SCHEMA}]},
                  {"type": "function", "name": "write"}),
    "messages": ("/v1/messages", {"messages": USER, "tools": [{"name": "write", "input_schema": SCHEMA}]},
                 {"type": "tool", "name": "write"}),
}
CAP = {"chat": "max_tokens", "messages": "max_tokens", "responses": "max_output_tokens"}


def _limit(tok: ModelTokenizer, text: str) -> int:
    """A token limit that cuts ``text`` inside the call's arguments, just after ``return``."""
    ids = tok.encode_text(text, add_special_tokens=False)
    return next(n for n in range(len(ids), 0, -1) if tok.decode(ids[:n]).endswith("return"))


async def _answers(tok: ModelTokenizer, api: str, text: str, forced: bool) -> tuple[Any, list[Any]]:
    """The collected answer and the streamed events of ``text`` cut by its limit."""
    path, body, choice = APIS[api]
    body = {"model": "tiny", **body, CAP[api]: _limit(tok, text), **({"tool_choice": choice} if forced else {})}
    answer = tok.encode_text(text, add_special_tokens=False) + [EOS]
    async with serve(tok, {"i0": ScriptedInstance("i0", [answer, answer])}) as client:
        resp = await client.post(path, json=body)
        assert resp.status == 200, await resp.text()
        collected = await resp.json()
        resp = await client.post(path, json={**body, "stream": True})
        assert resp.status == 200
        events = [event async for event in read_events(resp)]
    return collected, events


def _cut(joined: str) -> bool:
    return ARGUMENTS.startswith(joined) and joined.endswith("return")


@pytest.mark.parametrize(("text", "forced", "content"), [(FORCED, True, None), (AUTO, False, "Writing it.")],
                         ids=["forced", "auto"])
async def test_a_chat_call_cut_by_the_limit_is_a_call_with_its_arguments_so_far(
        tiny_tokenizer: ModelTokenizer, text: str, forced: bool, content: str | None) -> None:
    collected, events = await _answers(tiny_tokenizer, "chat", text, forced)
    choice = collected["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    streamed = "".join(f for name, data in events for f in fragments("chat", name, data))
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == content
    assert call["function"]["name"] == "write" and _cut(call["function"]["arguments"])
    assert call["function"]["arguments"] == streamed  # as the stream gave it
    chunks = [data for _, data in events[:-1] if data.get("choices")]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == (content or "")
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(("text", "forced"), [(FORCED, True), (AUTO, False)], ids=["forced", "auto"])
async def test_a_responses_call_cut_by_the_limit_is_an_incomplete_function_call(
        tiny_tokenizer: ModelTokenizer, text: str, forced: bool) -> None:
    collected, events = await _answers(tiny_tokenizer, "responses", text, forced)
    (item,) = [i for i in collected["output"] if i["type"] == "function_call"]
    final = events[-1][1]["response"]
    (streamed,) = [i for i in final["output"] if i["type"] == "function_call"]
    assert collected["status"] == final["status"] == "incomplete"
    assert item["status"] == "incomplete" and item["name"] == "write" and _cut(item["arguments"])
    assert item["arguments"] == streamed["arguments"]
    assert [i["type"] for i in collected["output"]] == [i["type"] for i in final["output"]]


async def test_an_anthropic_call_cut_by_the_limit_is_text_that_stopped_at_max_tokens(
        tiny_tokenizer: ModelTokenizer) -> None:
    collected, _events = await _answers(tiny_tokenizer, "messages", FORCED, forced=True)
    assert collected["stop_reason"] == "max_tokens"
    (block,) = collected["content"]
    assert block["type"] == "text" and block["text"].startswith('<tool_call>\n{"name": "write"')
    assert block["text"].endswith("return")


def test_every_answer_cut_anywhere_collects_as_its_stream_gives_it() -> None:
    """Cut at any character, an answer collected with ``cut`` is the stream's: the same text,
    and each call with the same arguments and state (a cut one ``cut_short``), unless a call
    the stream announced broke (``malformed``: the stream fails, the collected answer is text)."""
    for text in [*TEXTS, AUTO, FORCED]:
        prefill = {"function": "write"} if text is FORCED else {}
        for n in range(len(text) + 1):
            streamed = summary(stream(text[:n], [], AnswerParser(HERMES, **prefill)))
            if any(state == "malformed" for _, _, state in streamed[1]):
                continue
            items = AnswerParser(HERMES, **prefill).parse(text[:n], cut=True)
            collected = ("".join(i for i in items if isinstance(i, str)),
                         [(c.name, c.arguments, c.state) for c in items if isinstance(c, ToolCall)])
            assert collected == streamed, (text, n)
