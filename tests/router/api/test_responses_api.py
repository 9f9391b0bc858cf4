"""The OpenAI Responses API (``POST /v1/responses``, what Codex speaks) through aiohttp's test
client, on the tiny models' tokenizer and chat template. The scripted instance answers with
the token ids of a chosen text (so the model "writes" tool calls); what it receives shows how
the router rendered the input items. Every response object and stream event is validated by
the openai SDK's own models (``Response``, ``ResponseStreamEvent``)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from router_fakes import FakeInstance, ScriptedInstance, write_tiny_tokenizer

from router.app import CORE_KEY, RouterConfig, create_app
from router.tokenization import ModelTokenizer

EOS = 2  # <|im_end|>
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city", "strict": True,
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
CHAT_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL_TEXT = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
QUESTION = "Weather in Paris?"
TEXT_EVENTS = ["response.output_item.added", "response.content_part.added", "response.output_text.delta"]
TEXT_CLOSE = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
CALL_EVENTS = ["response.output_item.added", "response.function_call_arguments.delta",
               "response.function_call_arguments.done", "response.output_item.done"]
CUSTOM_EVENTS = ["response.output_item.added", "response.custom_tool_call_input.delta",
                 "response.custom_tool_call_input.done", "response.output_item.done"]
STREAM_EVENT = TypeAdapter(ResponseStreamEvent)
APPLY_PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch.",
               "format": {"type": "grammar", "syntax": "lark", "definition": "start: /(.|\\n)+/"}}
# What the model sees for APPLY_PATCH: a function of one string.
APPLY_PATCH_CHAT = {"type": "function", "function": {
    "name": "apply_patch", "description": "Edit files with a patch.",
    "parameters": {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}}}
PATCH = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch"
OMITTED_IMAGE = "[image omitted: image/png, 3 B; this model reads text only]"  # data:...;base64,AAAA


def validated(response: dict[str, Any]) -> dict[str, Any]:
    """``response`` once the SDK's ``Response`` model accepts it. The one code the SDK's
    ``ResponseError.code`` literal lacks, ``context_length_exceeded`` (OpenAI's API sends it,
    Codex matches on it), is checked with the rest of the object under a listed code."""
    error = response.get("error")
    if error is not None and error.get("code") == "context_length_exceeded":
        response = {**response, "error": {**error, "code": "server_error"}}
    Response.model_validate(response)
    return response


def tool_call(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@asynccontextmanager
async def serve(tok: ModelTokenizer, instance: FakeInstance) -> AsyncIterator[TestClient]:
    config = RouterConfig(models={"tiny": "/unused"}, instances={instance.instance_id: ""}, poll_interval_s=None)
    app = create_app(config, clients={instance.instance_id: instance}, tokenizers={"tiny": tok})
    async with TestClient(TestServer(app)) as client:
        yield client


def scripted(tok: ModelTokenizer, *texts: str) -> ScriptedInstance:
    return ScriptedInstance("i0", [tok.encode_text(t, add_special_tokens=False) + [EOS] for t in texts])


def body(**kw: Any) -> dict[str, Any]:
    return {"model": "tiny", "input": QUESTION, **kw}


async def post(client: TestClient, data: dict[str, Any], **headers: str) -> dict[str, Any]:
    resp = await client.post("/v1/responses", json=data, headers=headers)
    assert resp.status == 200, await resp.text()
    assert resp.headers["X-Session-ID"]
    result: dict[str, Any] = await resp.json()
    validated(result)
    return result


async def events(client: TestClient, data: dict[str, Any], **headers: str) -> list[dict[str, Any]]:
    """The stream's events; each block's ``event:`` line must name its data's type, and each
    event must be one the SDK's ``ResponseStreamEvent`` union accepts."""
    resp = await client.post("/v1/responses", json={**data, "stream": True}, headers=headers)
    assert resp.status == 200, await resp.text()
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    out = []
    for block in (await resp.text()).strip().split("\n\n"):
        name, data_line = block.split("\n")
        event = json.loads(data_line.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        STREAM_EVENT.validate_python({**event, "response": validated(event["response"])} if "response" in event
                                     else event)
        out.append(event)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def message(item: dict[str, Any], text: str, status: str = "completed") -> None:
    assert item["id"].startswith("msg_")
    assert {k: v for k, v in item.items() if k != "id"} == {
        "type": "message", "status": status, "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}]}


async def test_text_answer_shape_usage_and_ignored_fields(tiny_tokenizer: ModelTokenizer) -> None:
    instance = scripted(tiny_tokenizer, "Sunny and mild.")
    instance.cached_tokens = 5
    async with serve(tiny_tokenizer, instance) as client:
        data = await post(client, body(store=False, metadata={"run": "7"}, reasoning={"effort": "low"},
                                       include=["reasoning.encrypted_content"], text={"verbosity": "low"},
                                       user="u", temperature=0.0, top_p=0.5))
    prompt = instance.calls[0].prompt_token_ids
    assert prompt == tiny_tokenizer.encode_chat([{"role": "user", "content": QUESTION}])
    assert instance.calls[0].params.temperature == 0.0 and instance.calls[0].params.top_p == 0.5
    assert data["id"] == f"resp_{instance.calls[0].call_id}" and data["object"] == "response"
    assert isinstance(data["created_at"], int) and data["model"] == "tiny"
    assert data["status"] == "completed" and data["incomplete_details"] is None and data["error"] is None
    assert len(data["output"]) == 1
    message(data["output"][0], "Sunny and mild.")
    out_tokens = len(tiny_tokenizer.encode_text("Sunny and mild.", add_special_tokens=False)) + 1  # + EOS
    assert data["usage"] == {
        "input_tokens": len(prompt), "input_tokens_details": {"cached_tokens": 5, "cache_write_tokens": 0},
        "output_tokens": out_tokens, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": len(prompt) + out_tokens}
    assert data["metadata"] == {"run": "7"} and data["temperature"] == 0.0 and data["top_p"] == 0.5
    assert data["tools"] == [] and data["tool_choice"] == "auto" and data["store"] is False


async def test_streamed_text(tiny_tokenizer: ModelTokenizer) -> None:
    text = "Session completion time matters more than one call."
    instance = scripted(tiny_tokenizer, text)
    async with serve(tiny_tokenizer, instance) as client:
        got = await events(client, body(input=[{"type": "message", "role": "user",
                                                "content": [{"type": "input_text", "text": QUESTION}]}]))
    assert instance.calls[0].prompt_token_ids == tiny_tokenizer.encode_chat([{"role": "user", "content": QUESTION}])
    names = [e["type"] for e in got]
    deltas = [e for e in got if e["type"] == "response.output_text.delta"]
    assert len(deltas) > 1  # the text streams token by token
    assert names == ["response.created", "response.in_progress", *TEXT_EVENTS[:2],
                     *["response.output_text.delta"] * len(deltas), *TEXT_CLOSE, "response.completed"]
    assert "".join(d["delta"] for d in deltas) == text
    created, added, done, final = got[0]["response"], got[2]["item"], got[-2]["item"], got[-1]["response"]
    assert created["status"] == "in_progress" and created["output"] == [] and created["usage"] is None
    assert added["status"] == "in_progress" and added["content"] == []
    item_id = added["id"]
    assert all(d["item_id"] == item_id and d["output_index"] == 0 and d["content_index"] == 0 for d in deltas)
    assert got[-4]["text"] == text and got[-3]["part"]["text"] == text
    message(done, text)
    assert final["status"] == "completed" and final["output"] == [done] and final["id"] == created["id"]
    assert final["usage"]["output_tokens"] == len(instance.script[0])


async def test_function_call_plain_and_streamed(tiny_tokenizer: ModelTokenizer) -> None:
    instance = scripted(tiny_tokenizer, CALL_TEXT, CALL_TEXT)
    async with serve(tiny_tokenizer, instance) as client:
        data = await post(client, body(tools=TOOLS, parallel_tool_calls=False))
        got = await events(client, body(tools=TOOLS))
    rendered = tiny_tokenizer.encode_chat([{"role": "user", "content": QUESTION}], tools=CHAT_TOOLS)
    assert instance.calls[0].prompt_token_ids == rendered  # flat tools are the chat tools the template takes
    assert data["status"] == "completed" and [i["type"] for i in data["output"]] == ["message", "function_call"]
    message(data["output"][0], "Let me look.")
    call = data["output"][1]
    assert call["id"].startswith("fc_") and call["call_id"].startswith("call_")
    assert (call["name"], json.loads(call["arguments"]), call["status"]) == ("get_weather", {"city": "Paris"},
                                                                            "completed")
    assert data["tools"] == TOOLS and data["parallel_tool_calls"] is False

    # Streamed, the arguments come in pieces of ARGUMENT_DELTA_CHARS as the model writes them
    # (these, shorter, in one); joined, they are the arguments of the call's .done event and
    # of the collected answer, to the character.
    names = [e["type"] for e in got]
    n, m = names.count("response.output_text.delta"), names.count("response.function_call_arguments.delta")
    assert m == 1 and names == [
        "response.created", "response.in_progress", *TEXT_EVENTS[:2], *["response.output_text.delta"] * n,
        *TEXT_CLOSE, CALL_EVENTS[0], *[CALL_EVENTS[1]] * m, *CALL_EVENTS[2:], "response.completed"]
    added, deltas, (args_done, item_done) = got[-m - 4], got[-m - 3:-3], got[-3:-1]
    assert added["output_index"] == 1 and added["item"]["arguments"] == ""
    assert added["item"]["type"] == "function_call" and added["item"]["name"] == "get_weather"
    joined = "".join(d["delta"] for d in deltas)
    assert joined == args_done["arguments"] == call["arguments"] == '{"city": "Paris"}'
    assert {d["item_id"] for d in deltas} == {args_done["item_id"]} == {added["item"]["id"], item_done["item"]["id"]}
    assert item_done["item"]["call_id"] == added["item"]["call_id"] and item_done["item"]["status"] == "completed"
    assert got[-1]["response"]["output"][1] == item_done["item"]
    message(got[-1]["response"]["output"][0], "Let me look.")


async def test_tool_choice_forms(tiny_tokenizer: ModelTokenizer) -> None:
    instance = scripted(tiny_tokenizer, ' {"city": "Rome"}}\n</tool_call>', CALL_TEXT)
    async with serve(tiny_tokenizer, instance) as client:
        named = await post(client, body(tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"}))
        none = await post(client, body(tools=TOOLS, tool_choice="none"))
    # A named function writes the call's opening after the generation prompt; the model continues it.
    assert tiny_tokenizer.tokenizer.decode(instance.calls[0].prompt_token_ids).endswith(
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments":')
    assert [(i["type"], i.get("name"), i.get("arguments")) for i in named["output"]] == [
        ("function_call", "get_weather", '{"city": "Rome"}')]
    assert named["tool_choice"] == {"type": "function", "name": "get_weather"}
    # "none": the answer is not searched for calls, it is text.
    assert [i["type"] for i in none["output"]] == ["message"]
    assert none["output"][0]["content"][0]["text"] == CALL_TEXT


async def test_multi_turn_items_render_the_conversation(tiny_tokenizer: ModelTokenizer) -> None:
    instance = scripted(tiny_tokenizer, CALL_TEXT, "It is 18C in Paris.")
    user = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}
    async with serve(tiny_tokenizer, instance) as client:
        first = await post(client, body(instructions="Be brief.", input=[user], tools=TOOLS))
        call = first["output"][1]
        # Codex's next turn: the whole conversation again, the answer's items, then the result.
        history = [user, *first["output"],
                   {"type": "function_call_output", "call_id": call["call_id"], "output": "18C"}]
        second = await post(client, body(instructions="Be brief.", input=history, tools=TOOLS))
    message(second["output"][0], "It is 18C in Paris.")
    expected = tiny_tokenizer.encode_chat([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": call["call_id"], "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": call["call_id"], "content": "18C"},
    ], tools=CHAT_TOOLS)
    after = instance.calls[1].prompt_token_ids
    assert after == expected
    # The call goes back as the model wrote it: the first prompt + its answer start the second.
    before = instance.calls[0].prompt_token_ids
    assert after[: len(before) + len(instance.script[0]) - 1] == before + instance.script[0][:-1]
    assert tiny_tokenizer.tokenizer.decode(after).endswith(
        "<|im_start|>user\n<tool_response>\n18C\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


async def test_instructions_and_leading_developer_messages_are_one_system_message(
    tiny_tokenizer: ModelTokenizer,
) -> None:
    instance = scripted(tiny_tokenizer, "ok", "ok")
    async with serve(tiny_tokenizer, instance) as client:
        await post(client, body(instructions="Be brief.", input=[
            {"role": "developer", "content": "Use metric units."},
            {"type": "reasoning", "id": "rs_0", "summary": []},  # dropped: does not end the leading run
            {"role": "system", "content": [{"type": "input_text", "text": "No emoji."}]},
            {"role": "user", "content": [{"type": "input_text", "text": "Hi"}, {"type": "input_text", "text": "!"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
            {"role": "developer", "content": "Answer in French."},  # later: a user turn, as written
            {"role": "user", "content": QUESTION},
            {"type": "reasoning", "id": "rs_1", "summary": []},  # dropped: no slot in the template
        ]))
        await post(client, body(input=[{"role": "developer", "content": "Terse."},
                                       {"role": "user", "content": QUESTION}]))
    assert tiny_tokenizer.tokenizer.decode(instance.calls[0].prompt_token_ids) == (
        "<|im_start|>system\nBe brief.\n\nUse metric units.\n\nNo emoji.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\nAnswer in French.<|im_end|>\n"
        f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n")
    assert instance.calls[1].prompt_token_ids == tiny_tokenizer.encode_chat(
        [{"role": "system", "content": "Terse."}, {"role": "user", "content": QUESTION}])


async def test_max_output_tokens_gives_incomplete(tiny_tokenizer: ModelTokenizer) -> None:
    text = "one two three four five six"
    instance = scripted(tiny_tokenizer, text, text)
    async with serve(tiny_tokenizer, instance) as client:
        data = await post(client, body(max_output_tokens=2))
        got = await events(client, body(max_output_tokens=2))
    assert instance.calls[0].params.max_tokens == 2 and data["max_output_tokens"] == 2
    assert data["status"] == "incomplete" and data["incomplete_details"] == {"reason": "max_output_tokens"}
    assert data["usage"]["output_tokens"] == 2
    message(data["output"][0], tiny_tokenizer.decode(instance.script[0][:2]), "incomplete")
    assert got[-1]["type"] == "response.incomplete" and "response.completed" not in [e["type"] for e in got]
    assert got[-1]["response"]["status"] == "incomplete"
    assert got[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert got[-1]["response"]["output"] == [got[-2]["item"]]
    assert got[-2]["item"]["status"] == "incomplete"


async def test_failure_after_the_stream_began(tokenizer: ModelTokenizer) -> None:
    instance = FakeInstance("a", tokenizer.encode_text("Hello world, this is a test.", False), fail_after=3)
    async with serve(tokenizer, instance) as client:
        got = await events(client, body())
        resp = await client.post("/v1/responses", json=body())
        failed = await resp.json()
    names = [e["type"] for e in got]
    assert names[-2:] == ["error", "response.failed"] and "response.completed" not in names
    message_text = f"the call failed on its instance; request id {instance.calls[0].call_id}"
    assert got[-2]["message"] == message_text and got[-2]["code"] == "server_error"
    final = got[-1]["response"]
    assert final["status"] == "failed" and final["error"] == {"code": "server_error", "message": message_text}
    partial = "".join(e["delta"] for e in got if e["type"] == "response.output_text.delta")
    assert partial and final["output"][0]["content"][0]["text"] == partial
    assert final["output"][0]["status"] == "incomplete"
    assert resp.status == 502 and failed["error"]["code"] == "instance_failed"


@pytest.mark.parametrize(("change", "param", "words"), [
    ({"input": [{"type": "computer_call", "call_id": "c"}]}, "input[0]", "'computer_call'"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "hear"},
                                             {"type": "input_audio", "input_audio": {}}]}]},
     "input[0].content[1]", "'input_audio'"),
    ({"input": [{"type": "custom_tool_call", "call_id": "c", "name": "apply_patch", "input": {"x": 1}}]},
     "input[0].input", "must be a string"),
    ({"input": [{"type": "custom_tool_call_output", "output": "x"}]}, "input[0].call_id", "non-empty string"),
    ({"previous_response_id": "resp_1"}, "previous_response_id", "stores no responses"),
    ({"model": None}, "model", "missing required field 'model'"),
    ({"model": 3}, "model", "model must be a non-empty string"),
    ({"input": None}, "input", "missing required field 'input'"),
    ({"input": 5}, "input", "input must be a string or a non-empty array"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "role must be one of"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {"x": 1}}]},
     "input[0].arguments", "must be a JSON string"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id", "non-empty string"),
    ({"instructions": ["x"]}, "instructions", "instructions must be a string"),
    ({"max_output_tokens": "10"}, "max_output_tokens", "max_output_tokens must be an integer"),
    ({"temperature": "hot"}, "temperature", "temperature must be a number"),
    ({"stream": "yes"}, "stream", "stream must be a boolean"),
    ({"tools": ["web_search"]}, "tools[0]", "must be an object with a string type"),
    ({"tools": [*TOOLS, {"name": "x"}]}, "tools[1]", "must be an object with a string type"),
    ({"tools": [{"type": 3}]}, "tools[0]", "must be an object with a string type"),
    ({"tools": [{"type": "custom", "name": ""}]}, "tools[0].name", "non-empty string"),
    ({"tools": [{"type": "namespace", "name": "crm", "tools": [{"type": "web_search"}]}]},
     "tools[0].tools[0]", "function and custom tools"),
    ({"tools": [{"type": "function", "name": "f", "parameters": "x"}]}, "tools[0].parameters", "an object"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools"}}, "tool_choice", "tool_choice must be"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "'nope', which is not in tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "custom", "name": "nope"}}, "tool_choice", "'nope', which is not in tools"),
    ({"text": {"format": {"type": "json_schema"}}}, "text.format", "structured output"),
    ({"include": ["message.output_text.logprobs"]}, "include", "not supported"),
    ({"conversation": "conv_1"}, "conversation", "unsupported field(s): conversation"),
    ({"truncation": "auto"}, "truncation", "unsupported field(s): truncation"),
    ({"prompt_cache_key": 5}, "prompt_cache_key", "prompt_cache_key must be a string"),
    ({"client_metadata": "x"}, "client_metadata", "client_metadata must be an object"),
    ({"client_metadata": {"a": 1}}, "client_metadata", "object of strings"),
    ({"context_management": {"type": "compaction"}}, "context_management", "an array of objects"),
    ({"context_management": [{"compact_threshold": 5}]}, "context_management", "string type"),
])
async def test_bad_requests_are_400_naming_the_problem(
    tiny_tokenizer: ModelTokenizer, change: dict[str, Any], param: str, words: str,
) -> None:
    instance = scripted(tiny_tokenizer, "never")
    async with serve(tiny_tokenizer, instance) as client:
        resp = await client.post("/v1/responses", json={**body(), **change})
        error = (await resp.json())["error"]
    assert resp.status == 400 and instance.calls == []
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert words in error["message"] and (param in error["message"] or param == "model")


async def test_prompt_cache_key_is_not_a_session_source(tiny_tokenizer: ModelTokenizer) -> None:
    """One ``prompt_cache_key`` may be shared by unrelated requests: it must not join them into
    one session. The ``session_id`` header (Codex sends it) names the session."""
    prompts = ["alpha", "beta"]  # unrelated: inference does not join them

    async def sessions(**key: str) -> list[str]:
        instance = scripted(tiny_tokenizer, "ok")
        async with serve(tiny_tokenizer, instance) as client:
            headers = [(await client.post("/v1/responses", json=body(input=p, **key))).headers["X-Session-ID"]
                       for p in prompts]
        assert headers == [c.session_id for c in instance.calls]
        return headers

    keyed, plain = await sessions(prompt_cache_key="conv-1"), await sessions()
    # each router process names inferred sessions inferred-<its own hex>-<n>: the same n
    assert [i.rsplit("-", 1)[1] for i in keyed] == [i.rsplit("-", 1)[1] for i in plain] == ["0", "1"]
    assert all(i.startswith("inferred-") for i in keyed + plain) and "conv-1" not in keyed

    instance = scripted(tiny_tokenizer, "ok")
    async with serve(tiny_tokenizer, instance) as client:
        data = await post(client, body(input="gamma", prompt_cache_key="conv-1"), session_id="codex-s")
        await post(client, body(input="delta", prompt_cache_key=""), session_id="codex-s")
        assert "conv-1" not in client.server.app[CORE_KEY].sessions
    # Both calls are codex-s's; their unrelated prompts are two KV chains (router.sessions.table).
    assert [c.session_id for c in instance.calls] == ["codex-s", "codex-s#1"]
    assert data["prompt_cache_key"] == "conv-1"  # echoed, as OpenAI does


async def test_openai_client_responses(tiny_tokenizer: ModelTokenizer, tiny_model_dir: Path) -> None:
    """The official client's ``responses.create`` (whole and streamed) and ``responses.stream``,
    over real HTTP, with the router's key; its own models parse what the router writes."""
    instance = scripted(tiny_tokenizer, "Sunny and mild.", "Sunny and mild.", CALL_TEXT, CALL_TEXT, "It is 18C.")
    instance.cached_tokens = 4
    config = RouterConfig(models={"tiny": str(tiny_model_dir)}, instances={"i0": "unused"},
                          poll_interval_s=None, api_key="sk-test")
    server = TestServer(create_app(config, clients={"i0": instance}, tokenizers={"tiny": tiny_tokenizer}))
    await server.start_server()
    client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="sk-test", max_retries=0)
    try:
        reply = await client.responses.create(model="tiny", input=QUESTION, instructions="Be brief.",
                                              store=False, extra_headers={"session_id": "codex-1"})
        assert reply.output_text == "Sunny and mild." and reply.status == "completed"
        assert instance.calls[0].session_id == "codex-1"
        assert reply.usage is not None and reply.usage.input_tokens == len(instance.calls[0].prompt_token_ids)
        assert reply.usage.input_tokens_details.cached_tokens == 4
        assert reply.usage.output_tokens == len(instance.script[0])

        stream = await client.responses.create(model="tiny", input=QUESTION, stream=True)
        kinds, text = [], ""
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
        assert text == "Sunny and mild." and kinds[0] == "response.created" and kinds[-1] == "response.completed"

        called = await client.responses.create(model="tiny", input=QUESTION, tools=TOOLS)
        assert [item.type for item in called.output] == ["message", "function_call"]
        call = called.output[1]
        assert call.type == "function_call" and call.name == "get_weather"
        assert json.loads(call.arguments) == {"city": "Paris"}
        async with client.responses.stream(model="tiny", input=QUESTION, tools=TOOLS) as events_:
            final = await events_.get_final_response()
        streamed = final.output[1]
        assert streamed.type == "function_call" and json.loads(streamed.arguments) == {"city": "Paris"}

        # The next turn resends the conversation with the output items as the client holds them.
        history: list[Any] = [{"role": "user", "content": QUESTION},
                              *[item.model_dump(exclude_none=True) for item in called.output],
                              {"type": "function_call_output", "call_id": call.call_id, "output": "18C"}]
        done = await client.responses.create(model="tiny", input=history, tools=TOOLS)
        assert done.output_text == "It is 18C."
        assert tiny_tokenizer.tokenizer.decode(instance.calls[4].prompt_token_ids).endswith(
            "<tool_response>\n18C\n</tool_response><|im_end|>\n<|im_start|>assistant\n")

        with pytest.raises(openai.BadRequestError, match="previous_response_id"):
            await client.responses.create(model="tiny", input=QUESTION, previous_response_id=reply.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.create(model="nope", input=QUESTION)
        wrong = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await wrong.responses.create(model="tiny", input=QUESTION)
        await wrong.close()
    finally:
        await client.close()
        await server.close()


async def test_hosted_tools_are_skipped_logged_and_named(tiny_tokenizer: ModelTokenizer) -> None:
    from structlog.testing import capture_logs

    hosted = [{"type": "web_search", "external_web_access": False}, {"type": "image_generation"},
              {"type": "web_search"}, {"type": "local_shell"}]
    instance = scripted(tiny_tokenizer, "ok", "ok", "ok")
    async with serve(tiny_tokenizer, instance) as client:
        with capture_logs() as logs:
            resp = await client.post("/v1/responses", json=body(tools=[hosted[0], *TOOLS, *hosted[1:]]))
            assert resp.status == 200, await resp.text()
            data = validated(await resp.json())
        streamed = await client.post("/v1/responses", json=body(tools=hosted, stream=True))
        assert streamed.status == 200 and (await streamed.text()).rstrip().endswith("}")
        plain = await client.post("/v1/responses", json=body(tools=TOOLS))
    assert resp.headers["X-Talaria-Tools-Skipped"] == "web_search,image_generation,local_shell"
    assert streamed.headers["X-Talaria-Tools-Skipped"] == "web_search,image_generation,local_shell"
    assert "X-Talaria-Tools-Skipped" not in plain.headers
    skipped = [e for e in logs if e["event"] == "router.responses.tools_skipped"]
    assert [e["types"] for e in skipped] == [["web_search", "image_generation", "local_shell"]]
    # The model is offered the function alone; with only hosted tools, no tools at all.
    assert instance.calls[0].prompt_token_ids == tiny_tokenizer.encode_chat(
        [{"role": "user", "content": QUESTION}], tools=CHAT_TOOLS)
    assert instance.calls[1].prompt_token_ids == tiny_tokenizer.encode_chat([{"role": "user", "content": QUESTION}])
    message(data["output"][0], "ok")
    assert data["tools"] == [hosted[0], *TOOLS, *hosted[1:]]  # echoed as sent


async def test_custom_tool_call_plain_and_streamed(tiny_tokenizer: ModelTokenizer) -> None:
    patch_call = tool_call("apply_patch", {"input": PATCH})
    odd_call = tool_call("apply_patch", {"patch": "x"})  # not a string input: the arguments' text
    named_rest = ' {"input": "x"}}\n</tool_call>'  # the model continues the forced call's opening
    instance = scripted(tiny_tokenizer, patch_call, patch_call, odd_call, named_rest, odd_call)
    tools = [*TOOLS, APPLY_PATCH]
    async with serve(tiny_tokenizer, instance) as client:
        data = await post(client, body(tools=tools))
        got = await events(client, body(tools=tools))
        odd = await post(client, body(tools=tools))
        named = await post(client, body(tools=tools, tool_choice={"type": "custom", "name": "apply_patch"}))
        odd_events = await events(client, body(tools=tools))
    assert instance.calls[0].prompt_token_ids == tiny_tokenizer.encode_chat(
        [{"role": "user", "content": QUESTION}], tools=[*CHAT_TOOLS, APPLY_PATCH_CHAT])
    [item] = data["output"]
    assert item["id"].startswith("ctc_") and item["call_id"].startswith("call_")
    assert {k: v for k, v in item.items() if k not in ("id", "call_id")} == {
        "type": "custom_tool_call", "name": "apply_patch", "input": PATCH, "status": "completed"}

    # Streamed, the input string is decoded from the arguments as they come, in pieces.
    names = [e["type"] for e in got]
    m = names.count(CUSTOM_EVENTS[1])
    assert m > 1 and names == ["response.created", "response.in_progress", CUSTOM_EVENTS[0],
                               *[CUSTOM_EVENTS[1]] * m, *CUSTOM_EVENTS[2:], "response.completed"]
    added, deltas, (done, item_done) = got[2], got[3:3 + m], got[3 + m:5 + m]
    assert added["item"]["type"] == "custom_tool_call" and added["item"]["input"] == ""
    assert "".join(d["delta"] for d in deltas) == PATCH and done["input"] == PATCH and "arguments" not in done
    assert {d["item_id"] for d in deltas} == {done["item_id"]} == {added["item"]["id"], item_done["item"]["id"]}
    assert {d["output_index"] for d in deltas} == {done["output_index"]} == {0}
    assert item_done["item"]["input"] == PATCH and got[-1]["response"]["output"] == [item_done["item"]]

    assert odd["output"][0]["type"] == "custom_tool_call"
    assert json.loads(odd["output"][0]["input"]) == {"patch": "x"}
    # Arguments that do not begin with the input string: the input goes out whole, at the end.
    assert [e["type"] for e in odd_events][2:-1] == CUSTOM_EVENTS
    assert odd_events[3]["delta"] == odd["output"][0]["input"] == odd_events[4]["input"]
    assert tiny_tokenizer.tokenizer.decode(instance.calls[3].prompt_token_ids).endswith(
        '<tool_call>\n{"name": "apply_patch", "arguments":')  # a custom tool can be named
    assert [(i["type"], i["input"]) for i in named["output"]] == [("custom_tool_call", "x")]


async def test_custom_tool_history_and_omitted_images(tiny_tokenizer: ModelTokenizer) -> None:
    instance = scripted(tiny_tokenizer, "Done.")
    shot = {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "auto"}
    history = [
        {"role": "user", "content": [{"type": "input_text", "text": "Look:"}, shot]},
        {"type": "custom_tool_call", "call_id": "call_p", "name": "apply_patch", "input": PATCH, "status": "completed"},
        {"type": "custom_tool_call_output", "call_id": "call_p",
         "output": [{"type": "input_text", "text": "Success."}, shot, {"type": "input_text", "text": "end"}]},
        {"type": "function_call", "call_id": "call_w", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_w", "output": [shot]},
        {"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]},
    ]
    async with serve(tiny_tokenizer, instance) as client:
        resp = await client.post("/v1/responses", json=body(input=history, tools=[*TOOLS, APPLY_PATCH]))
        assert resp.status == 200 and resp.headers["X-Talaria-Media-Omitted"] == "4"
    assert instance.calls[0].prompt_token_ids == tiny_tokenizer.encode_chat([
        {"role": "user", "content": f"Look:\n{OMITTED_IMAGE}"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_p", "type": "function", "function": {"name": "apply_patch", "arguments": {"input": PATCH}}}]},
        {"role": "tool", "tool_call_id": "call_p", "content": f"Success.\n{OMITTED_IMAGE}\nend"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_w", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_w", "content": OMITTED_IMAGE},
        {"role": "user", "content": "[file omitted: a stored file; this model reads text only]"},
    ], tools=[*CHAT_TOOLS, APPLY_PATCH_CHAT])


async def test_namespace_tools_are_flattened(tiny_tokenizer: ModelTokenizer) -> None:
    search = {"type": "function", "name": "search", "description": "Search the docs",
              "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}
    namespace = {"type": "namespace", "name": "mcp__docs__", "description": "Docs server",
                 "tools": [search, TOOLS[0]]}  # get_weather is also a top-level tool: qualified
    calls = tool_call("search", {"q": "x"}) + "\n" + tool_call("mcp__docs__get_weather", {"city": "Oslo"})
    instance = scripted(tiny_tokenizer, calls, "ok")
    tools = [namespace, *TOOLS]
    async with serve(tiny_tokenizer, instance) as client:
        data = await post(client, body(tools=tools))
        history = [{"role": "user", "content": QUESTION}, *data["output"],
                   *[{"type": "function_call_output", "call_id": i["call_id"], "output": "r"} for i in data["output"]]]
        await post(client, body(input=history, tools=tools))
    flat = [{"type": "function", "function": {k: v for k, v in search.items() if k != "type"}},
            {"type": "function", "function": {**CHAT_TOOLS[0]["function"], "name": "mcp__docs__get_weather"}},
            *CHAT_TOOLS]
    assert instance.calls[0].prompt_token_ids == tiny_tokenizer.encode_chat(
        [{"role": "user", "content": QUESTION}], tools=flat)
    assert [(i["type"], i["name"], i.get("namespace"), json.loads(i["arguments"])) for i in data["output"]] == [
        ("function_call", "search", "mcp__docs__", {"q": "x"}),
        ("function_call", "get_weather", "mcp__docs__", {"city": "Oslo"})]
    # The calls go back under the names the model saw.
    ids = [i["call_id"] for i in data["output"]]
    assert instance.calls[1].prompt_token_ids == tiny_tokenizer.encode_chat([
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": ids[0], "type": "function", "function": {"name": "search", "arguments": {"q": "x"}}},
            {"id": ids[1], "type": "function", "function": {"name": "mcp__docs__get_weather",
                                                            "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "tool_call_id": ids[0], "content": "r"},
        {"role": "tool", "tool_call_id": ids[1], "content": "r"}], tools=flat)


async def test_parallel_tool_calls(tiny_tokenizer: ModelTokenizer) -> None:
    two = tool_call("get_weather", {"city": "Paris"}) + "\n" + tool_call("get_weather", {"city": "Rome"})
    instance = scripted(tiny_tokenizer, two, two)
    async with serve(tiny_tokenizer, instance) as client:
        got = await events(client, body(tools=TOOLS, parallel_tool_calls=True))
        single = await post(client, body(tools=TOOLS, parallel_tool_calls=False))
    done = [e for e in got if e["type"] == "response.output_item.done"]
    assert [e["output_index"] for e in done] == [0, 1]
    assert [json.loads(e["item"]["arguments"]) for e in done] == [{"city": "Paris"}, {"city": "Rome"}]
    ids = [e["item"]["call_id"] for e in done]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)
    assert [e["output_index"] for e in got if e["type"] == "response.function_call_arguments.done"] == [0, 1]
    assert got[-1]["response"]["output"] == [e["item"] for e in done]
    assert [json.loads(i["arguments"]) for i in single["output"]] == [{"city": "Paris"}]  # the first call only


async def test_context_full_without_a_limit_fails(tmp_path: Path) -> None:
    """No max_output_tokens and the answer ran out of context: a failure Codex will not retry
    (``context_length_exceeded``); with max_output_tokens it stays ``incomplete``."""
    small = ModelTokenizer.load("tiny", write_tiny_tokenizer(tmp_path / "small", context_len=48))
    long_text = " ".join(["one two three four five six seven eight"] * 10)
    instance = scripted(small, long_text)
    async with serve(small, instance) as client:
        got = await events(client, body())
        resp = await client.post("/v1/responses", json=body())
        error = (await resp.json())["error"]
        limited = await post(client, body(max_output_tokens=3))
    room = 48 - len(instance.calls[0].prompt_token_ids)
    assert instance.calls[0].params.max_tokens == room
    names = [e["type"] for e in got]
    assert names[-1] == "response.failed" and "response.incomplete" not in names and "error" not in names
    final = got[-1]["response"]
    assert final["status"] == "failed" and final["error"]["code"] == "context_length_exceeded"
    assert "filled the context" in final["error"]["message"] and final["usage"]["output_tokens"] == room
    assert final["output"][0]["status"] == "incomplete"
    assert resp.status == 400 and error["code"] == "context_length_exceeded" and error["param"] == "input"
    assert resp.headers["X-Session-ID"]
    assert limited["status"] == "incomplete" and limited["incomplete_details"] == {"reason": "max_output_tokens"}


async def test_codex_shaped_request(tiny_tokenizer: ModelTokenizer) -> None:
    """A body as Codex (``wire_api = "responses"``) sends it, streamed: it must succeed, every
    event must validate, the session is the header's."""
    shell = {"type": "function", "name": "shell", "description": "Runs a shell command", "strict": False,
             "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}},
                            "required": ["command"], "additionalProperties": False}}
    instructions = "You are Codex, a coding agent.\n" + "Follow the repository's conventions. " * 60
    request = {
        "model": "tiny", "instructions": instructions,
        "input": [
            {"type": "message", "role": "developer",
             "content": [{"type": "input_text", "text": "<permissions>sandboxed</permissions>"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Add a.txt"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAAB..."},
            {"type": "function_call", "call_id": "call_1", "name": "shell", "arguments": '{"command": ["ls"]}'},
            {"type": "function_call_output", "call_id": "call_1",
             "output": [{"type": "input_text", "text": "README.md"}]},
            {"type": "custom_tool_call", "call_id": "call_2", "name": "apply_patch", "input": PATCH},
            {"type": "custom_tool_call_output", "call_id": "call_2", "output": "Success. Updated a.txt"},
        ],
        "tools": [shell, APPLY_PATCH, {"type": "web_search", "external_web_access": False}],
        "tool_choice": "auto", "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"}, "store": False, "stream": True,
        "include": ["reasoning.encrypted_content"], "prompt_cache_key": "conv-7",
        "text": {"verbosity": "medium"}, "client_metadata": {"x-codex-turn": "3"},
    }
    answer = "Added.\n" + tool_call("apply_patch", {"input": PATCH})
    instance = scripted(tiny_tokenizer, answer)
    async with serve(tiny_tokenizer, instance) as client:
        got = await events(client, request, session_id="codex-session-1", originator="codex_cli_rs",
                           **{"OpenAI-Beta": "responses=experimental"})
    assert instance.calls[0].session_id == "codex-session-1"
    shell_chat = {"type": "function", "function": {k: v for k, v in shell.items() if k not in ("type", "strict")}}
    assert instance.calls[0].prompt_token_ids == tiny_tokenizer.encode_chat([
        {"role": "system", "content": f"{instructions}\n\n<permissions>sandboxed</permissions>"},
        {"role": "user", "content": "Add a.txt"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "shell", "arguments": {"command": ["ls"]}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "README.md"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_2", "type": "function", "function": {"name": "apply_patch", "arguments": {"input": PATCH}}}]},
        {"role": "tool", "tool_call_id": "call_2", "content": "Success. Updated a.txt"},
    ], tools=[shell_chat, APPLY_PATCH_CHAT])
    final = got[-1]["response"]
    assert final["status"] == "completed" and final["prompt_cache_key"] == "conv-7"
    assert [i["type"] for i in final["output"]] == ["message", "custom_tool_call"]
    assert final["output"][1]["input"] == PATCH


async def test_a_refusal_part_in_the_history_is_the_assistant_text(tiny_tokenizer: ModelTokenizer) -> None:
    """An assistant message of a history from OpenAI's own API can hold a ``refusal`` part
    (the output content type a refused answer has); it was a 400, so a conversation resumed
    against Talaria ended at once. It is that turn's text."""
    instance = scripted(tiny_tokenizer, "Fine.")
    history = [
        {"role": "user", "content": [{"type": "input_text", "text": "Do it."}]},
        {"type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "refusal", "refusal": "I can't help with that."}]},
        {"role": "user", "content": "Then say fine."},
    ]
    async with serve(tiny_tokenizer, instance) as client:
        resp = await client.post("/v1/responses", json=body(input=history))
        assert resp.status == 200, await resp.text()
        history[1]["content"] = [{"type": "refusal", "refusal": 3}]
        resp = await client.post("/v1/responses", json=body(input=history))
        assert resp.status == 400 and "refusal" in (await resp.json())["error"]["message"]
    assert instance.calls[0].prompt_token_ids == tiny_tokenizer.encode_chat([
        {"role": "user", "content": "Do it."},
        {"role": "assistant", "content": "I can't help with that."},
        {"role": "user", "content": "Then say fine."},
    ])
