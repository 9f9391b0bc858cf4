"""A request body's bounds (``router.api.body_limits``): nesting beyond the limit is a 400 naming
the field on every API, before anything runs (it was a RecursionError, a 500, or for echoed
Responses metadata a failure after the model ran); a large body is parsed off the event loop;
a token-id prompt is measured before any id is looked at; a body of too many values is
refused before it is parsed."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
from api_helpers import chat_body, serve
from router_fakes import FakeInstance, ScriptedInstance

from router.api import openai_schema
from router.api.body_limits import MAX_JSON_DEPTH, check_depth
from router.limits import RouterLimits
from router.tokenization import ModelTokenizer
from talaria.protocol.errors import ApiError

DEEP = 600


def nest(levels: int) -> Any:
    """``levels`` arrays, one inside the other (built without recursion)."""
    value: Any = 0
    for _ in range(levels):
        value = [value]
    return value


def tool(parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", "description": "d", "parameters": parameters}}


def deep_bodies() -> list[tuple[str, str, dict[str, Any], str]]:
    """(name, path, body, the field the 400 names) for each way to nest on each API."""
    user = {"role": "user", "content": "hi"}
    call = {"id": "c1", "type": "function",
            "function": {"name": "f", "arguments": json.dumps({"a": nest(DEEP)})}}
    return [
        ("chat message", "/v1/chat/completions",
         chat_body(messages=[{**user, "extra": nest(DEEP)}]), "messages[0].extra"),
        ("chat tool schema", "/v1/chat/completions",
         chat_body(tools=[tool({"type": "object", "properties": {"a": nest(DEEP)}})]),
         "tools[0].function"),
        ("chat tool-call arguments", "/v1/chat/completions",
         chat_body(messages=[user, {"role": "assistant", "content": None, "tool_calls": [call]},
                             {"role": "tool", "tool_call_id": "c1", "content": "ok"}]),
         "messages[1].tool_calls[0].function.arguments"),
        ("messages tool_use.input", "/v1/messages",
         {"model": "tiny", "max_tokens": 4, "messages": [
             user, {"role": "assistant", "content": [
                 {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": nest(DEEP)}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}]},
         "messages[1].content"),
        ("responses metadata", "/v1/responses",
         {"model": "tiny", "input": "hi", "metadata": {"a": nest(300)}}, "metadata.a"),
    ]


@pytest.mark.parametrize(("path", "body", "field"), [b[1:] for b in deep_bodies()],
                         ids=[b[0] for b in deep_bodies()])
async def test_nesting_beyond_the_limit_is_a_400_naming_the_field(
    tiny_tokenizer: ModelTokenizer, path: str, body: dict[str, Any], field: str
) -> None:
    a = FakeInstance("a", [1, 2])
    async with serve(tiny_tokenizer, {"a": a}) as client:
        resp = await client.post(path, data=json.dumps(body),
                                 headers={"Content-Type": "application/json"})
        assert resp.status == 400, await resp.text()
        error = (await resp.json())["error"]
    assert f"nested more than {MAX_JSON_DEPTH} levels deep" in error["message"]
    assert error["message"].startswith(field)
    assert not a.calls  # refused before the model ran


async def test_nesting_within_the_limit_is_served(tiny_tokenizer: ModelTokenizer) -> None:
    schema: Any = {"type": "string"}
    for _ in range(25):  # 25 object levels in the schema: 55 in the body
        schema = {"type": "object", "properties": {"a": schema}}
    a = ScriptedInstance("a", [tiny_tokenizer.encode_text("ok", add_special_tokens=False)])
    async with serve(tiny_tokenizer, {"a": a}) as client:
        resp = await client.post("/v1/chat/completions", json=chat_body(tools=[tool(schema)]))
        assert resp.status == 200, await resp.text()


def test_depth_is_counted_from_the_value_and_walked_without_recursion() -> None:
    check_depth(nest(MAX_JSON_DEPTH))
    with pytest.raises(ApiError) as err:
        check_depth({"x": nest(MAX_JSON_DEPTH)}, "args")
    assert err.value.param == "args.x[0][0]"  # three levels of the path named
    with pytest.raises(ApiError):
        check_depth(nest(50_000))  # far beyond any recursion limit
    check_depth("a string")


async def test_a_large_token_id_prompt_is_parsed_off_the_loop_and_measured_first(
    tokenizer: ModelTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[int] = []
    parse = openai_schema.parse_completion

    def spy(data: Any) -> Any:
        threads.append(threading.get_ident())
        return parse(data)

    looked_at: list[int] = []
    monkeypatch.setattr(openai_schema, "parse_completion", spy)
    monkeypatch.setattr(tokenizer, "check_token_ids", lambda ids: looked_at.append(len(ids)))
    a = FakeInstance("a", [1, 2])
    limits = RouterLimits(large_body_bytes=4096)
    too_long = [7] * (tokenizer.context_len * 20)
    async with serve(tokenizer, {"a": a}, limits=limits) as client:
        resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": too_long})
        assert resp.status == 400, await resp.text()
        error = (await resp.json())["error"]
        resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": [7, 8]})
        assert resp.status == 200, await resp.text()
    assert f"allows at most {tokenizer.context_len - 1} prompt tokens" in error["message"]
    assert looked_at == [2]  # the long prompt's ids were never looked at
    assert len(threads) == 2
    assert threads[0] != threading.get_ident()  # the large body: parsed on another thread
    assert threads[1] == threading.get_ident()  # a small one: inline


async def test_a_body_of_too_many_values_is_refused_before_it_is_parsed(
    tokenizer: ModelTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    parsed: list[Any] = []
    monkeypatch.setattr(openai_schema, "parse_completion", parsed.append)
    async with serve(tokenizer, {"a": FakeInstance("a", [1])},
                     limits=RouterLimits(max_body_items=1000)) as client:
        resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": [7] * 2000})
        assert resp.status == 413, await resp.text()
        assert (await resp.json())["error"]["code"] == "request_too_large"
    assert parsed == []
