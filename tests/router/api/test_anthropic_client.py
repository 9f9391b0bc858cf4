"""The Anthropic Messages API with the official anthropic client, over real HTTP, on the tiny
models' tokenizer and chat template; the scripted instance answers with the token ids of a
chosen text (so the model "writes" tool calls), and what it receives shows the rendering."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import anthropic
import pytest
from aiohttp.test_utils import TestServer
from router_fakes import ScriptedInstance

from router.app import RouterConfig, create_app
from router.tokenization import ModelTokenizer

TOOLS = [{"name": "get_weather", "description": "Current weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
CALL_TEXT = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
USER = [{"role": "user", "content": "Weather in Paris?"}]
EOS = 2  # <|im_end|>


async def _router(tok: ModelTokenizer, model_dir: Path, script: list[str]) -> tuple[TestServer, ScriptedInstance]:
    instance = ScriptedInstance("i0", [tok.encode_text(t, add_special_tokens=False) + [EOS] for t in script])
    config = RouterConfig(models={"tiny": str(model_dir)}, instances={"i0": "unused"},
                          poll_interval_s=None, api_key="sk-test")
    server = TestServer(create_app(config, clients={"i0": instance}, tokenizers={"tiny": tok}))
    await server.start_server()
    return server, instance


async def test_messages_text_stream_and_tool_round_trip(tiny_tokenizer: ModelTokenizer, tiny_model_dir: Path) -> None:
    script = ["Sunny and mild.", "Sunny and mild.", CALL_TEXT, CALL_TEXT, "It is 18C in Paris."]
    server, instance = await _router(tiny_tokenizer, tiny_model_dir, script)
    client = anthropic.AsyncAnthropic(base_url=str(server.make_url("/")), api_key="sk-test", max_retries=0)
    decode = tiny_tokenizer.tokenizer.decode
    try:
        reply = await client.messages.create(model="tiny", max_tokens=64, system="Be brief.", messages=USER,
                                             extra_body={"temperature": 0.0})
        assert [b.type for b in reply.content] == ["text"] and reply.content[0].text == "Sunny and mild."
        assert reply.stop_reason == "end_turn" and reply.role == "assistant" and reply.id.startswith("msg_")
        prompt_len = len(instance.calls[0].prompt_token_ids)
        assert reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0) == prompt_len
        assert reply.usage.output_tokens == len(tiny_tokenizer.encode_text("Sunny and mild.", False)) + 1
        assert decode(instance.calls[0].prompt_token_ids).startswith("<|im_start|>system\nBe brief.<|im_end|>")
        assert instance.calls[0].params.temperature == 0.0

        async with client.messages.stream(model="tiny", max_tokens=64, messages=USER) as stream:
            kinds = [event.type async for event in stream]
            final = await stream.get_final_message()
        assert final.content[0].text == "Sunny and mild." and final.stop_reason == "end_turn"
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
        assert "content_block_start" in kinds and "message_delta" in kinds

        # tool_use out, plain and streamed (the stream's input JSON is parsed by the client).
        used = await client.messages.create(model="tiny", max_tokens=200, messages=USER, tools=TOOLS)
        assert [b.type for b in used.content] == ["text", "tool_use"] and used.stop_reason == "tool_use"
        text, call = used.content
        assert text.text == "Let me look." and call.name == "get_weather" and call.input == {"city": "Paris"}
        assert call.id.startswith("toolu_")
        assert '{"type": "function", "function": {"name": "get_weather"' in decode(instance.calls[2].prompt_token_ids)
        async with client.messages.stream(model="tiny", max_tokens=200, messages=USER, tools=TOOLS) as stream:
            streamed = await stream.get_final_message()
        assert [b.type for b in streamed.content] == ["text", "tool_use"]
        assert streamed.content[1].input == {"city": "Paris"} and streamed.stop_reason == "tool_use"

        # tool_result in: the next prompt extends the tool call's prompt and holds the result.
        history = USER + [
            {"role": "assistant", "content": [b.model_dump() for b in used.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                          "content": [{"type": "text", "text": "18C"}]}]},
        ]
        done = await client.messages.create(model="tiny", max_tokens=64, messages=history, tools=TOOLS)
        assert done.content[0].text == "It is 18C in Paris." and done.stop_reason == "end_turn"
        # The call is written back as the model wrote it, so prompt + answer is a prefix.
        before, after = instance.calls[2].prompt_token_ids, instance.calls[4].prompt_token_ids
        assert after[: len(before) + len(instance.script[2]) - 1] == before + instance.script[2][:-1]
        assert decode(after).endswith(
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
            "<|im_start|>user\n<tool_response>\n18C\n</tool_response><|im_end|>\n<|im_start|>assistant\n")

        counted = await client.messages.count_tokens(model="tiny", messages=history, tools=TOOLS)
        assert counted.input_tokens == len(after)
        assert [m.id for m in (await client.models.list()).data] == ["tiny"]
    finally:
        await client.close()
        await server.close()


async def test_stop_reasons_prefill_and_errors(tiny_tokenizer: ModelTokenizer, tiny_model_dir: Path) -> None:
    script = ["Hello STOP and more", "one two three four five six", "the rest", "x"]
    server, instance = await _router(tiny_tokenizer, tiny_model_dir, script)
    root = str(server.make_url("/")).rstrip("/")
    client = anthropic.AsyncAnthropic(base_url=root, api_key="sk-test", max_retries=0)
    try:
        stopped = await client.messages.create(model="tiny", max_tokens=64, messages=USER, stop_sequences=["STOP"])
        assert stopped.content[0].text == "Hello " and stopped.stop_reason == "stop_sequence"
        assert stopped.stop_sequence == "STOP"
        cut = await client.messages.create(model="tiny", max_tokens=2, messages=USER)
        assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2

        # A final assistant turn is a prefill: the prompt ends with it, the answer continues it.
        prefilled = await client.messages.create(
            model="tiny", max_tokens=64,
            messages=USER + [{"role": "assistant", "content": "Here is"}])
        assert prefilled.content[0].text == "the rest"
        assert tiny_tokenizer.tokenizer.decode(instance.calls[2].prompt_token_ids).endswith(
            "<|im_start|>assistant\nHere is")

        with pytest.raises(anthropic.NotFoundError):
            await client.messages.create(model="nope", max_tokens=5, messages=USER)
        with pytest.raises(anthropic.BadRequestError, match="not supported"):
            await client.messages.create(model="tiny", max_tokens=5, messages=[{"role": "user", "content": [
                {"type": "search_result", "source": "https://example.com", "title": "x", "content": []}]}])
        wrong = anthropic.AsyncAnthropic(base_url=root, api_key="wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError):
            await wrong.messages.create(model="tiny", max_tokens=5, messages=USER)
        await wrong.close()

        # Claude Code's shape of the wire: x-api-key, ?beta=true, a HEAD / probe; errors in
        # Anthropic's shape.
        async with aiohttp.ClientSession() as http:
            async with http.head(root + "/") as probe:
                assert probe.status == 200
            headers = {"x-api-key": "sk-test", "anthropic-version": "2023-06-01"}
            body = {"model": "tiny", "max_tokens": 5, "messages": USER}
            async with http.post(root + "/v1/messages?beta=true", json=body, headers=headers) as resp:
                assert resp.status == 200 and (await resp.json())["type"] == "message"
            async with http.post(root + "/v1/messages", json={"model": "tiny", "messages": USER},
                                 headers=headers) as resp:
                error = await resp.json()
                assert resp.status == 400 and error["type"] == "error"
                assert error["error"] == {"type": "invalid_request_error", "message": "max_tokens: Field required"}
            async with http.post(root + "/v1/messages", json=body, headers={"x-api-key": "bad"}) as resp:
                assert resp.status == 401 and (await resp.json())["error"]["type"] == "authentication_error"
    finally:
        await client.close()
        await server.close()
