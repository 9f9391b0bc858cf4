"""What agents' clients read from the router's answers, across the three APIs: a prompt over
the context is the overflow error each API's clients recognise (and a token count still
counts it); usage keeps its cached tokens when a stop string ends the answer; a failure
before the first token gets its HTTP status, streamed or not; consecutive Anthropic turns of
one role keep a line between their texts; a run of text is one Anthropic text block."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from api_helpers import named_events, scripted, serve
from router_fakes import FakeInstance, ScriptedInstance

from router.tokenization import ModelTokenizer
from talaria.protocol import CallEvent, CallRequest

LONG = "hello " * 5000  # ~20k tokens; the tiny model's context is 4096
USER = [{"role": "user", "content": "hi"}]


# a prompt over the context ---------------------------------------------------------------


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, "messages"),
    ("/v1/completions", {"prompt": LONG}, "prompt"),
    ("/v1/completions", {"prompt": [7] * 5000}, "prompt"),
    ("/v1/responses", {"input": LONG}, "input"),
])
async def test_an_openai_prompt_over_the_context_is_context_length_exceeded(
    tiny_tokenizer: ModelTokenizer, path: str, body: dict[str, Any], param: str,
) -> None:
    """OpenAI's code, which client libraries and agents key compaction on, naming the
    API's own prompt field (``input`` on the Responses API, which has no ``messages``)."""
    instance = scripted(tiny_tokenizer, "x")
    async with serve(tiny_tokenizer, {"i0": instance}) as client:
        resp = await client.post(path, json={"model": "tiny", **body})
        error = (await resp.json())["error"]
    assert resp.status == 400 and not instance.calls
    assert error["code"] == "context_length_exceeded" and error["param"] == param, error
    assert f"allows at most {tiny_tokenizer.context_len - 1} prompt tokens" in error["message"]


async def test_an_anthropic_prompt_over_the_context_says_prompt_is_too_long(tiny_tokenizer: ModelTokenizer) -> None:
    """Anthropic's words (Claude Code and proxies match them, and read the two counts)."""
    messages = [{"role": "user", "content": LONG}]
    n = len(tiny_tokenizer.encode_chat(messages))
    async with serve(tiny_tokenizer, {"i0": scripted(tiny_tokenizer, "x")}) as client:
        resp = await client.post("/v1/messages", json={"model": "tiny", "max_tokens": 10, "messages": messages})
        body = await resp.json()
    assert resp.status == 400 and body["type"] == "error"
    assert body["error"] == {"type": "invalid_request_error",
                             "message": f"prompt is too long: {n} tokens > {tiny_tokenizer.context_len - 1} maximum"}


async def test_count_tokens_counts_a_conversation_over_the_context(tiny_tokenizer: ModelTokenizer) -> None:
    """An agent counts to learn how far over the window it is: counted, not refused; a body
    beyond the byte bound (no tokenization can bring it under the context) still is."""
    messages = [{"role": "user", "content": LONG}]
    huge = [{"role": "user", "content": "x" * (tiny_tokenizer.context_len * 33)}]
    async with serve(tiny_tokenizer, {"i0": scripted(tiny_tokenizer, "x")}) as client:
        resp = await client.post("/v1/messages/count_tokens", json={"model": "tiny", "messages": messages})
        counted = await resp.json()
        assert resp.status == 200, counted
        resp = await client.post("/v1/messages/count_tokens", json={"model": "tiny", "messages": huge})
        refused = await resp.json()
    assert counted == {"input_tokens": len(tiny_tokenizer.encode_chat(messages))}
    assert counted["input_tokens"] > tiny_tokenizer.context_len
    assert resp.status == 400 and "bytes long" in refused["error"]["message"]


# usage after a stop string -----------------------------------------------------------------


async def test_chat_usage_keeps_cached_tokens_after_a_stop_string(tiny_tokenizer: ModelTokenizer) -> None:
    """The router stops reading at the stop string, before the call's final event: the usage
    the instance sent with the first tokens still counts the cached prompt tokens."""
    instance = scripted(tiny_tokenizer, "Hello world. The end.", cached_tokens=5)
    async with serve(tiny_tokenizer, {"i0": instance}) as client:
        plain = await (await client.post("/v1/chat/completions", json={"model": "tiny", "messages": USER})).json()
        cut = await (await client.post("/v1/chat/completions",
                                       json={"model": "tiny", "messages": USER, "stop": ["The"]})).json()
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] == 5
    assert cut["choices"][0]["message"]["content"] == "Hello world. "
    assert cut["usage"]["prompt_tokens_details"]["cached_tokens"] == 5, cut["usage"]
    assert cut["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]


@pytest.mark.parametrize("stream", [False, True])
async def test_messages_usage_keeps_cache_reads_after_a_stop_sequence(
    tiny_tokenizer: ModelTokenizer, stream: bool,
) -> None:
    body = {"model": "tiny", "max_tokens": 50, "messages": USER, "stream": stream}
    instance = scripted(tiny_tokenizer, "Hello world. The end.", cached_tokens=5)
    async with serve(tiny_tokenizer, {"i0": instance}) as client:
        plain = await client.post("/v1/messages", json={**body, "stream": False})
        cut = await client.post("/v1/messages", json={**body, "stop_sequences": ["The"]})
        plain_usage = (await plain.json())["usage"]
        if stream:
            delta = [d for n, d in named_events(await cut.text()) if n == "message_delta"][0]
            stop, usage = delta["delta"]["stop_reason"], delta["usage"]
        else:
            answer = await cut.json()
            stop, usage = answer["stop_reason"], answer["usage"]
    assert plain_usage["cache_read_input_tokens"] == 5
    assert stop == "stop_sequence"
    assert usage["cache_read_input_tokens"] == 5, usage
    assert usage["input_tokens"] == plain_usage["input_tokens"]


# a failure before the first token ----------------------------------------------------------


class FailsAtOnce(FakeInstance):
    """Its every call's first event ends it in failure, with no token."""

    async def submit(self, call: CallRequest) -> AsyncIterator[CallEvent]:
        self.calls.append(call)
        yield CallEvent(call_id=call.call_id, token_ids=[], finished=True, finish_reason="error",
                        error="engine failed before its first token")


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 10}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10}),
    ("/v1/messages", {"messages": USER, "max_tokens": 10}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 10}),
])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_failure_before_the_first_token_gets_its_http_status(
    tiny_tokenizer: ModelTokenizer, path: str, body: dict[str, Any], stream: bool,
) -> None:
    """502 as for a non-streamed call, never 200 and an in-stream error: clients retry a
    5xx, not a status-200 error. The client sees the request id, not the detail."""
    async with serve(tiny_tokenizer, {"i0": FailsAtOnce("i0", [])}) as client:
        resp = await client.post(path, json={"model": "tiny", "stream": stream, **body})
        text = await resp.text()
    assert resp.status == 502, text
    assert resp.headers["Content-Type"].startswith("application/json")
    assert "the call failed on its instance" in text and "engine failed" not in text
    if path == "/v1/messages":
        assert orjson.loads(text)["error"]["type"] == "api_error"
    else:
        assert orjson.loads(text)["error"]["code"] == "instance_failed"


# Anthropic turns and blocks ----------------------------------------------------------------


def _prompt_of(tok: ModelTokenizer, instance: ScriptedInstance) -> str:
    return str(tok.tokenizer.decode(instance.calls[0].prompt_token_ids))


async def test_consecutive_anthropic_turns_of_one_role_keep_a_line_between_them(
    tiny_tokenizer: ModelTokenizer,
) -> None:
    """Anthropic's API combines them into one turn; their texts must not run together. The
    text blocks of one message are joined as they are."""
    messages = [
        {"role": "user", "content": "fix the bug"},
        {"role": "user", "content": [{"type": "text", "text": "and run "}, {"type": "text", "text": "tests"}]},
        {"role": "assistant", "content": "Done"},
        {"role": "assistant", "content": "All green."},
        {"role": "user", "content": "thanks"},
        {"role": "assistant", "content": "You are"},
        {"role": "assistant", "content": "welcome"},
    ]
    instance = scripted(tiny_tokenizer, "!")
    async with serve(tiny_tokenizer, {"i0": instance}) as client:
        resp = await client.post("/v1/messages", json={"model": "tiny", "max_tokens": 10, "messages": messages})
        assert resp.status == 200, await resp.text()
    assert _prompt_of(tiny_tokenizer, instance) == tiny_tokenizer.tokenizer.decode(tiny_tokenizer.encode_chat(
        [{"role": "user", "content": "fix the bug\nand run tests"},
         {"role": "assistant", "content": "Done\nAll green."},
         {"role": "user", "content": "thanks"}], prefill="You are\nwelcome"))


async def test_merged_tool_results_come_first_and_texts_keep_their_lines(tiny_tokenizer: ModelTokenizer) -> None:
    tools = [{"name": "get_weather", "input_schema": {"type": "object"}}]
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"}]},
        {"role": "user", "content": "in Celsius"},
        {"role": "user", "content": "please"},
    ]
    instance = scripted(tiny_tokenizer, "ok")
    async with serve(tiny_tokenizer, {"i0": instance}) as client:
        resp = await client.post("/v1/messages", json={"model": "tiny", "max_tokens": 10, "messages": messages,
                                                       "tools": tools})
        assert resp.status == 200, await resp.text()
    prompt = _prompt_of(tiny_tokenizer, instance)
    assert prompt.index("18C") < prompt.index("in Celsius\nplease")


@pytest.mark.parametrize("answer", ["Done.\n\n", "Is a < b? Yes: a <"])
async def test_a_run_of_text_is_one_anthropic_text_block(tiny_tokenizer: ModelTokenizer, answer: str) -> None:
    """With tools offered, the tool-call parser releases the tail it held (whitespace, or what
    could begin ``<tool_call>``) as an item of its own: still one block, as streamed."""
    body = {"model": "tiny", "max_tokens": 100, "messages": USER,
            "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}]}
    async with serve(tiny_tokenizer, {"i0": scripted(tiny_tokenizer, answer, answer)}) as client:
        whole = (await (await client.post("/v1/messages", json=body)).json())["content"]
        streamed = named_events(await (await client.post("/v1/messages", json={**body, "stream": True})).text())
    starts = [d for n, d in streamed if n == "content_block_start"]
    assert len(starts) == 1
    assert whole == [{"type": "text", "text": answer}]


def test_a_tool_calls_string_arguments_reach_the_template_as_an_object(
    tiny_tokenizer: ModelTokenizer,
) -> None:
    """OpenAI's chat API carries ``arguments`` as a JSON string; templates render the
    object (``tojson``), so the string went in encoded twice, and ``""`` as nothing at all
    (``"arguments": }``). Rendered now as the Responses and Anthropic paths render theirs."""
    from router.api.openai_tools import assistant_tool_calls

    def call(arguments: object) -> list[dict[str, object]]:
        return [{"id": "t1", "type": "function",
                 "function": {"name": "get_weather", "arguments": arguments}}]

    assert assistant_tool_calls(call('{"city":"Paris"}'), "m")[0]["function"]["arguments"] == {
        "city": "Paris"}
    assert assistant_tool_calls(call(""), "m")[0]["function"]["arguments"] == {}

    def prompt(arguments: object) -> str:
        history = [{"role": "user", "content": "weather?"},
                   {"role": "assistant", "content": "",
                    "tool_calls": assistant_tool_calls(call(arguments), "messages[1]")},
                   {"role": "tool", "tool_call_id": "t1", "content": "sunny"}]
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}}}}]
        return tiny_tokenizer.decode(tiny_tokenizer.encode_chat(history, tools))

    as_object = prompt({"city": "Paris"})
    assert prompt('{"city": "Paris"}') == prompt('{"city":"Paris"}') == as_object
    assert '"arguments": {"city": "Paris"}' in as_object
    assert '"arguments": {}' in prompt("")


def test_a_cut_calls_arguments_sent_back_render_as_the_model_wrote_them(
    tiny_tokenizer: ModelTokenizer,
) -> None:
    """A collected answer cut inside a tool call returns the call with its JSON cut, as OpenAI
    does; an agent sends that turn back. It was a 400 ("not valid JSON") on chat and the
    Responses API, ending the session; now the text reaches the template as it is, so the
    prompt holds what the model wrote (its KV a prefix of the new prompt)."""
    from router.api.openai_tools import assistant_tool_calls
    from router.api.responses_schema import parse_responses

    cut = '{"city": "Par'
    chat = assistant_tool_calls([{"id": "t1", "type": "function",
                                  "function": {"name": "get_weather", "arguments": cut}}], "m")
    assert chat[0]["function"]["arguments"] == cut
    assert assistant_tool_calls([{"id": "t1", "type": "function", "function": {
        "name": "f", "arguments": "[1, 2]"}}], "m")[0]["function"]["arguments"] == "[1, 2]"
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": "", "tool_calls": chat}]
    rendered = tiny_tokenizer.decode(tiny_tokenizer.encode_chat(history, None))
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par}' in rendered

    items = [{"role": "user", "content": "weather?"},
             {"type": "function_call", "call_id": "c", "name": "get_weather", "arguments": cut}]
    messages = parse_responses({"model": "m", "input": items}).body.messages
    assert messages is not None and messages[-1]["tool_calls"][0]["function"]["arguments"] == cut
