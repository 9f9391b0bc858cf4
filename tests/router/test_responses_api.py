"""The OpenAI Responses API (``POST /v1/responses``, what Codex speaks) through aiohttp's test
client, on the tiny models' tokenizer and chat template. The scripted instance answers with
the token ids of a chosen text (so the model "writes" tool calls); what it receives shows how
the router rendered the input items."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer
from router_fakes import FakeInstance, ScriptedInstance

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
    return result


async def events(client: TestClient, data: dict[str, Any]) -> list[dict[str, Any]]:
    """The stream's events; each block's ``event:`` line must name its data's type."""
    resp = await client.post("/v1/responses", json={**data, "stream": True})
    assert resp.status == 200, await resp.text()
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    out = []
    for block in (await resp.text()).strip().split("\n\n"):
        name, data_line = block.split("\n")
        event = json.loads(data_line.removeprefix("data: "))
        assert name == f"event: {event['type']}"
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
        "input_tokens": len(prompt), "input_tokens_details": {"cached_tokens": 5},
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

    names = [e["type"] for e in got]
    n = names.count("response.output_text.delta")
    assert names == ["response.created", "response.in_progress", *TEXT_EVENTS[:2],
                     *["response.output_text.delta"] * n, *TEXT_CLOSE, *CALL_EVENTS, "response.completed"]
    added, delta, args_done, item_done = got[-5:-1]
    assert added["output_index"] == 1 and added["item"]["arguments"] == ""
    assert added["item"]["type"] == "function_call" and added["item"]["name"] == "get_weather"
    assert json.loads(delta["delta"]) == {"city": "Paris"} and args_done["arguments"] == delta["delta"]
    assert delta["item_id"] == args_done["item_id"] == added["item"]["id"] == item_done["item"]["id"]
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


async def test_instructions_and_developer_messages_are_system(tiny_tokenizer: ModelTokenizer) -> None:
    instance = scripted(tiny_tokenizer, "ok")
    async with serve(tiny_tokenizer, instance) as client:
        await post(client, body(instructions="Be brief.", input=[
            {"role": "developer", "content": "Use metric units."},
            {"role": "user", "content": [{"type": "input_text", "text": "Hi"}, {"type": "input_text", "text": "!"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
            {"role": "user", "content": QUESTION},
            {"type": "reasoning", "id": "rs_1", "summary": []},  # dropped: no slot in the template
        ]))
    assert tiny_tokenizer.tokenizer.decode(instance.calls[0].prompt_token_ids) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>system\nUse metric units.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n"
        f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n")


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
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "see"},
                                             {"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input[0].content[1]", "'input_image'"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[0]", "'input_file'"),
    ({"previous_response_id": "resp_1"}, "previous_response_id", "stores no responses"),
    ({"model": None}, "model", "missing required field 'model'"),
    ({"model": 3}, "model", "model must be a non-empty string"),
    ({"input": None}, "input", "missing required field 'input'"),
    ({"input": 5}, "input", "input must be a string or a non-empty array"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "role must be one of"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"}]},
     "input[0].arguments", "not valid JSON"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id", "non-empty string"),
    ({"instructions": ["x"]}, "instructions", "instructions must be a string"),
    ({"max_output_tokens": "10"}, "max_output_tokens", "max_output_tokens must be an integer"),
    ({"temperature": "hot"}, "temperature", "temperature must be a number"),
    ({"stream": "yes"}, "stream", "stream must be a boolean"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]", "'web_search'"),
    ({"tools": [{"type": "function", "name": "f", "parameters": "x"}]}, "tools[0].parameters", "an object"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools"}}, "tool_choice", "tool_choice must be"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"text": {"format": {"type": "json_schema"}}}, "text.format", "structured output"),
    ({"include": ["message.output_text.logprobs"]}, "include", "not supported"),
    ({"conversation": "conv_1"}, "conversation", "unsupported field(s): conversation"),
    ({"truncation": "auto"}, "truncation", "unsupported field(s): truncation"),
    ({"prompt_cache_key": ""}, "prompt_cache_key", "non-empty string"),
    ({"prompt_cache_key": "k" * 300}, "prompt_cache_key", "prompt_cache_key"),  # session ids are bounded
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


async def test_prompt_cache_key_names_one_session(tiny_tokenizer: ModelTokenizer) -> None:
    instance = scripted(tiny_tokenizer, "ok")
    async with serve(tiny_tokenizer, instance) as client:
        core = client.server.app[CORE_KEY]
        # Two unrelated prompts (inference would not join them) under one conversation id.
        await post(client, body(input="alpha", prompt_cache_key="conv-1"))
        resp = await client.post("/v1/responses", json=body(input="beta", prompt_cache_key="conv-1"))
        assert resp.headers["X-Session-ID"] == "conv-1"
        await post(client, body(input="gamma"))
        await post(client, body(input="delta", prompt_cache_key="conv-1"), session_id="codex-s")
    sessions = [c.session_id for c in instance.calls]
    assert sessions[:2] == ["conv-1", "conv-1"] and "conv-1" in core.sessions
    assert sessions[2] not in ("conv-1", "")  # no key: a session of its own (inferred)
    assert sessions[3] == "codex-s"  # Codex's session_id header comes before the body's hint


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
