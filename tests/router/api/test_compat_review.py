"""A review of the API compatibility layer against what real clients send and read: each test
here failed before its fix (the commit that added it says what was wrong)."""

from __future__ import annotations

from typing import Any

import anthropic
import pydantic
import pytest
from aiohttp.test_utils import TestServer
from api_helpers import named_events, scripted, serve

from router.app import RouterConfig, create_app
from router.tokenization import ModelTokenizer

USER = [{"role": "user", "content": "hi"}]


# Anthropic structured output -----------------------------------------------------------------


class Weather(pydantic.BaseModel):
    city: str


@pytest.mark.parametrize("field", [
    {"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
    {"output_config": {"effort": "high", "format": {"type": "json_schema", "schema": {"type": "object"}}}},
    {"output_format": {"type": "json_schema", "schema": {"type": "object"}}},  # the beta's spelling
    {"output_config": "json"},
])
async def test_anthropic_structured_output_is_refused_not_ignored(
    tiny_tokenizer: ModelTokenizer, field: dict[str, Any],
) -> None:
    """The client parses the answer as JSON of its schema: a free-text answer behind a 200
    fails there (or worse, parses), so the request is a 400 as chat's response_format and
    the Responses API's text.format are; output_config.effort alone changes nothing."""
    instance = scripted(tiny_tokenizer, "Sunny.", "Sunny.")
    body = {"model": "tiny", "max_tokens": 20, "messages": USER}
    async with serve(tiny_tokenizer, {"i0": instance}) as client:
        refused = await client.post("/v1/messages", json={**body, **field})
        counted = await client.post("/v1/messages/count_tokens", json={**body, **field})
        effort = await client.post("/v1/messages", json={**body, "output_config": {"effort": "low"}})
        assert refused.status == 400 and counted.status == 200, await refused.text()
        error = await refused.json()
        assert effort.status == 200, await effort.text()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert next(iter(field)) in error["error"]["message"]
    assert len(instance.calls) == 1  # only the effort call ran


async def test_anthropic_sdk_parse_gets_a_400(tiny_tokenizer: ModelTokenizer, tiny_model_dir: Any) -> None:
    """``messages.parse(output_format=...)`` (anthropic SDK) sends ``output_config.format``;
    it got "Sunny." back and failed in pydantic with invalid JSON."""
    instance = scripted(tiny_tokenizer, "Sunny.")
    config = RouterConfig(models={"tiny": str(tiny_model_dir)}, instances={"i0": "unused"}, poll_interval_s=None)
    server = TestServer(create_app(config, clients={"i0": instance}, tokenizers={"tiny": tiny_tokenizer}))
    await server.start_server()
    client = anthropic.AsyncAnthropic(base_url=str(server.make_url("/")), api_key="x", max_retries=0)
    try:
        with pytest.raises(anthropic.BadRequestError, match="output_config"):
            await client.messages.parse(model="tiny", max_tokens=20, messages=USER, output_format=Weather)
    finally:
        await client.close()
        await server.close()


# Anthropic message_start usage ---------------------------------------------------------------


async def test_message_start_usage_splits_cached_input_as_the_final_usage_does(tiny_tokenizer: ModelTokenizer) -> None:
    """message_start carries the input usage (Anthropic's streaming docs), and clients that
    take input usage from it (older anthropic SDKs' accumulators, proxies, cost meters) read
    it there only: it counted the cached tokens as uncached input, 0 cache reads."""
    instance = scripted(tiny_tokenizer, "Sunny and mild.", cached_tokens=5)
    body = {"model": "tiny", "max_tokens": 50, "messages": USER, "stream": True}
    async with serve(tiny_tokenizer, {"i0": instance}) as client:
        events = named_events(await (await client.post("/v1/messages", json=body)).text())
    start = next(d for n, d in events if n == "message_start")["message"]["usage"]
    final = next(d for n, d in events if n == "message_delta")["usage"]
    prompt = len(instance.calls[0].prompt_token_ids)
    assert final["input_tokens"] == prompt - 5 and final["cache_read_input_tokens"] == 5
    assert {k: start[k] for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")} == {
        "input_tokens": prompt - 5, "cache_read_input_tokens": 5, "cache_creation_input_tokens": 0}


# a malformed type or name is a 400, not a 500 ------------------------------------------------


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/messages", {"messages": [{"role": "user", "content": [{"type": ["text"], "text": "hi"}]}]}),
    ("/v1/messages", {"messages": USER, "system": [{"type": {"text": 1}, "text": "S"}]}),
    ("/v1/messages", {"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": [], "text": "r"}]}]}]}),
    ("/v1/messages", {"messages": USER, "tool_choice": {"type": ["auto"]}}),
    ("/v1/messages/count_tokens", {"messages": USER, "tool_choice": {"type": {}}}),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "function", "name": ["f"]}]}),
])
async def test_a_type_or_name_that_is_not_a_string_is_a_400(
    tiny_tokenizer: ModelTokenizer, path: str, body: dict[str, Any],
) -> None:
    """A list or object where a block's ``type`` or a tool's ``name`` belongs was looked up in
    a set, raised TypeError and came back as a 500 ``internal error``: the client was told
    the server failed, not what in its request was wrong."""
    async with serve(tiny_tokenizer, {"i0": scripted(tiny_tokenizer, "ok")}) as client:
        limit = {"max_tokens": 20} if path == "/v1/messages" else {}
        resp = await client.post(path, json={"model": "tiny", **limit, **body})
        assert resp.status == 400, await resp.text()
        error = await resp.json()
    if path.startswith("/v1/messages"):
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    else:
        assert error["error"]["type"] == "invalid_request_error" and error["error"]["param"]


# a max_tokens refused under the rule "refuse", in Anthropic's words ------------------------------


async def test_a_refused_max_tokens_is_anthropics_context_limit_error(tmp_path: Any) -> None:
    """Under ``max_tokens_overflow = "refuse"`` a max_tokens beyond the room is a 400. Claude
    Code recovers from it only in Anthropic's words, ``input length and `max_tokens` exceed
    context limit: <input> + <max_tokens> > <limit>``, which it parses to retry with a
    max_tokens that fits; the router's own sentence left the session stuck on the error."""
    from router_fakes import write_tiny_tokenizer

    small = ModelTokenizer.load("tiny", write_tiny_tokenizer(tmp_path / "small", context_len=96))
    instance = scripted(small, "ok")
    body = {"model": "tiny", "max_tokens": 32000, "messages": USER}
    async with serve(small, {"i0": instance}, max_tokens_overflow="refuse") as client:
        refused = await client.post("/v1/messages", json=body)
        chat = await client.post("/v1/chat/completions", json={**body, "max_tokens": 32000})
        counted = await client.post("/v1/messages/count_tokens", json=body)
        error, chat_error = await refused.json(), await chat.json()
        prompt = (await counted.json())["input_tokens"]
    assert refused.status == 400 and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"] == (
        f"input length and `max_tokens` exceed context limit: {prompt} + 32000 > 96, "
        "decrease input length or `max_tokens` and try again")
    # The OpenAI APIs keep their message, naming the field and the room.
    assert chat.status == 400 and chat_error["error"]["param"] == "max_tokens"
    assert f"at most {96 - prompt} tokens fit" in chat_error["error"]["message"]
    assert not instance.calls


# too many stop sequences, named by Anthropic's field ---------------------------------------------


async def test_too_many_stop_sequences_names_anthropics_field(tiny_tokenizer: ModelTokenizer) -> None:
    """The limit on stop strings is OpenAI's parser's, whose error named its ``stop`` field, a
    field a Messages API client never sent; Anthropic's error has no ``param``, so the message
    alone must name ``stop_sequences``."""
    from router.api.openai_schema import MAX_STOP_STRINGS

    instance = scripted(tiny_tokenizer, "ok")
    stops = [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]
    body = {"model": "tiny", "max_tokens": 8, "messages": USER, "stop_sequences": stops}
    async with serve(tiny_tokenizer, {"i0": instance}) as client:
        resp = await client.post("/v1/messages", json=body)
        error = await resp.json()
        fits = await client.post("/v1/messages", json={**body, "stop_sequences": stops[:-1]})
        assert fits.status == 200, await fits.text()
    assert resp.status == 400 and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"] == (
        f"stop_sequences may hold at most {MAX_STOP_STRINGS} strings"), error
