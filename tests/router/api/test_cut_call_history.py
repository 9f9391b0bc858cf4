"""A tool call whose arguments are not a JSON object, sent back in an agent's history, is
rendered as written, not refused. The router itself returns such a call when the length limit
cuts it (``test_cut_tool_call_collected``), and an agent appends the answer to its history as
it is (with a tool result saying the call could not run): a 400 there refused every later call
of the conversation, since each resends it. The chat template gets the text the model wrote,
so the prompt repeats the answer and the session's KV still matches it."""

from __future__ import annotations

from typing import Any

import pytest
from api_helpers import EOS, serve
from router_fakes import ScriptedInstance
from test_tool_call_streams_http import ARGUMENTS, SCHEMA, USER

from router.tokenization import ModelTokenizer

CUT = ARGUMENTS[:30]  # '{"path":"a.py",  "text":"def f'
AUTO = f'Writing it.\n<tool_call>\n{{"name": "write", "arguments": {ARGUMENTS}}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "write", "parameters": SCHEMA}}]


def _limit(tok: ModelTokenizer) -> int:
    """A token limit that cuts the answer inside the call's arguments, after ``CUT``."""
    ids = tok.encode_text(AUTO, add_special_tokens=False)
    return next(n for n in range(1, len(ids)) if tok.decode(ids[:n]).endswith(CUT))


def _instance(tok: ModelTokenizer) -> ScriptedInstance:
    answer = tok.encode_text(AUTO, add_special_tokens=False) + [EOS]
    return ScriptedInstance("i0", [answer, tok.encode_text("Sorry.", add_special_tokens=False) + [EOS]])


async def test_a_chat_call_cut_by_the_limit_goes_back_as_history(tiny_tokenizer: ModelTokenizer) -> None:
    instance = _instance(tiny_tokenizer)
    async with serve(tiny_tokenizer, {"i0": instance}) as client:
        body = {"model": "tiny", "messages": USER, "tools": TOOLS, "max_tokens": _limit(tiny_tokenizer)}
        resp = await client.post("/v1/chat/completions", json=body)
        assert resp.status == 200, await resp.text()
        message = (await resp.json())["choices"][0]["message"]
        (call,) = message["tool_calls"]
        assert call["function"]["arguments"] == CUT
        history = [*USER, message, {"role": "tool", "tool_call_id": call["id"],
                                    "content": "error: the arguments are not valid JSON"}]
        resp = await client.post("/v1/chat/completions", json={**body, "messages": history, "max_tokens": 8})
        assert resp.status == 200, await resp.text()
    prompt = tiny_tokenizer.decode(instance.calls[1].prompt_token_ids)
    assert f'"arguments": {CUT}' in prompt  # as the model wrote it, not encoded again


async def test_a_responses_call_cut_by_the_limit_goes_back_as_input(tiny_tokenizer: ModelTokenizer) -> None:
    instance = _instance(tiny_tokenizer)
    tools = [{"type": "function", "name": "write", "parameters": SCHEMA}]
    async with serve(tiny_tokenizer, {"i0": instance}) as client:
        body: dict[str, Any] = {"model": "tiny", "input": "Write a.py", "tools": tools,
                                "max_output_tokens": _limit(tiny_tokenizer)}
        resp = await client.post("/v1/responses", json=body)
        assert resp.status == 200, await resp.text()
        output = (await resp.json())["output"]
        (item,) = [i for i in output if i["type"] == "function_call"]
        assert item["arguments"] == CUT and item["status"] == "incomplete"
        items = [{"role": "user", "content": "Write a.py"}, *output,
                 {"type": "function_call_output", "call_id": item["call_id"], "output": "error: bad JSON"}]
        resp = await client.post("/v1/responses", json={**body, "input": items, "max_output_tokens": 8})
        assert resp.status == 200, await resp.text()
    assert f'"arguments": {CUT}' in tiny_tokenizer.decode(instance.calls[1].prompt_token_ids)


@pytest.mark.parametrize("arguments", ["[1, 2]", '"text"', "{oops"])
async def test_arguments_that_are_no_json_object_render_as_written(
        tiny_tokenizer: ModelTokenizer, arguments: str) -> None:
    instance = _instance(tiny_tokenizer)
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "write", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "error"}]
    async with serve(tiny_tokenizer, {"i0": instance}) as client:
        resp = await client.post("/v1/chat/completions", json={
            "model": "tiny", "messages": history, "tools": TOOLS, "max_tokens": 4})
        assert resp.status == 200, await resp.text()
    assert f'"arguments": {arguments}' in tiny_tokenizer.decode(instance.calls[0].prompt_token_ids)
