"""Tool calling through /v1/chat/completions with the official openai client, over real
HTTP, on the tiny models' tokenizer and chat template. The instance is scripted: it answers
with the token ids of a chosen text, so the model "writes" the tool calls the parser must
find; what it receives shows how the router rendered the tools and tool turns."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from aiohttp.test_utils import TestServer
from router_fakes import ScriptedInstance

from router.app import RouterConfig, create_app
from router.tokenization import ModelTokenizer

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
TWO_CALLS = (
    "I'll check both.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
)
USER = [{"role": "user", "content": "Weather in Paris and Rome?"}]


async def _router(tok: ModelTokenizer, model_dir: Path, script: list[str]) -> tuple[TestServer, ScriptedInstance]:
    ids = [tok.encode_text(text, add_special_tokens=False) + [2] for text in script]  # 2: <|im_end|>
    instance = ScriptedInstance("i0", ids)
    config = RouterConfig(models={"tiny": str(model_dir)}, instances={"i0": "unused"}, poll_interval_s=None)
    server = TestServer(create_app(config, clients={"i0": instance}, tokenizers={"tiny": tok}))
    await server.start_server()
    return server, instance


async def test_tool_calls_plain_and_streamed(tiny_tokenizer: ModelTokenizer, tiny_model_dir: Path) -> None:
    server, instance = await _router(tiny_tokenizer, tiny_model_dir, [TWO_CALLS, TWO_CALLS, "It is 18C and 20C."])
    client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="x", max_retries=0)
    try:
        reply = await client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, max_tokens=200)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "I'll check both."
        calls = choice.message.tool_calls or []
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
        assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
        prompt = tiny_tokenizer.tokenizer.decode(instance.calls[0].prompt_token_ids)
        assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in prompt

        # Streamed: id, type and name once per call, then the arguments; the client's own
        # accumulator rebuilds the same message.
        raw = await client.chat.completions.create(
            model="tiny", messages=USER, tools=TOOLS, max_tokens=200, stream=True)
        text, deltas, finish = "", [], None
        async for chunk in raw:
            if chunk.choices:
                delta = chunk.choices[0].delta
                text += delta.content or ""
                deltas += delta.tool_calls or []
                finish = chunk.choices[0].finish_reason or finish
        assert text == "I'll check both." and finish == "tool_calls"
        heads = [d for d in deltas if d.id is not None]
        assert [(d.index, d.type, d.function.name, d.function.arguments) for d in heads] == [
            (0, "function", "get_weather", ""), (1, "function", "get_weather", "")]
        args = {i: "".join(d.function.arguments or "" for d in deltas if d.index == i) for i in (0, 1)}
        assert [json.loads(a) for a in args.values()] == [{"city": "Paris"}, {"city": "Rome"}]

        # The round trip: the calls and their results go back in; the next prompt extends
        # the previous one and carries the results as the template writes them.
        history = USER + [
            {"role": "assistant", "content": choice.message.content,
             "tool_calls": [c.model_dump() for c in calls]},
            {"role": "tool", "tool_call_id": calls[0].id, "content": "18C"},
            {"role": "tool", "tool_call_id": calls[1].id, "content": [{"type": "text", "text": "20C"}]},
        ]
        final = await client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=50)
        assert final.choices[0].message.content == "It is 18C and 20C."
        assert final.choices[0].finish_reason == "stop" and not final.choices[0].message.tool_calls
        before, after = instance.calls[0].prompt_token_ids, instance.calls[2].prompt_token_ids
        assert after[: len(before)] == before
        assert "<tool_response>\n18C\n</tool_response>\n<tool_response>\n20C\n</tool_response>" in \
            tiny_tokenizer.tokenizer.decode(after)
    finally:
        await client.close()
        await server.close()


async def test_tool_choice_forms_and_malformed_output(tiny_tokenizer: ModelTokenizer, tiny_model_dir: Path) -> None:
    script = [
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',  # auto, bad JSON
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',  # required
        ' {"city": "Lima"}}\n</tool_call>',  # named function
        '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>',  # none
        '{"name": "get_weather", "arguments": {"city": "Oslo"}',  # required, streamed, cut short
    ]
    server, instance = await _router(tiny_tokenizer, tiny_model_dir, script)
    client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="x", max_retries=0)
    decode = tiny_tokenizer.tokenizer.decode
    try:
        bad = await client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS)
        assert bad.choices[0].message.content == script[0] and not bad.choices[0].message.tool_calls
        assert bad.choices[0].finish_reason == "stop"

        required = await client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS,
                                                        tool_choice="required")
        assert decode(instance.calls[1].prompt_token_ids).endswith("<|im_start|>assistant\n<tool_call>\n")
        (call,) = required.choices[0].message.tool_calls or []
        assert json.loads(call.function.arguments) == {"city": "Oslo"}

        named = await client.chat.completions.create(
            model="tiny", messages=USER, tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        assert decode(instance.calls[2].prompt_token_ids).endswith('{"name": "get_weather", "arguments":')
        (call,) = named.choices[0].message.tool_calls or []
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Lima"}

        none = await client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="none")
        assert none.choices[0].message.content == script[3] and not none.choices[0].message.tool_calls
        assert "<tools>" in decode(instance.calls[3].prompt_token_ids)  # the prefix stays the same

        # Streamed, the call was announced before the answer ended inside it (not at its
        # length limit): the stream fails saying so, after the arguments written so far.
        arguments = ""
        with pytest.raises(openai.APIError, match=r"ended inside tool call 0 \('get_weather'\)"):
            async for chunk in await client.chat.completions.create(
                    model="tiny", messages=USER, tools=TOOLS, tool_choice="required", stream=True):
                if chunk.choices:
                    assert not chunk.choices[0].delta.content
                    arguments += "".join(d.function.arguments or "" for d in chunk.choices[0].delta.tool_calls or [])
        assert arguments == '{"city": "Oslo"}'

        with pytest.raises(openai.BadRequestError, match="not in tools"):
            await client.chat.completions.create(
                model="tiny", messages=USER, tools=TOOLS,
                tool_choice={"type": "function", "function": {"name": "nope"}})
        with pytest.raises(openai.BadRequestError, match="needs tools"):
            await client.chat.completions.create(model="tiny", messages=USER, tool_choice="required")
        with pytest.raises(openai.BadRequestError, match="tool_call_id"):
            await client.chat.completions.create(model="tiny", messages=USER + [{"role": "tool", "content": "x"}])
    finally:
        await client.close()
        await server.close()


@pytest.fixture(scope="module")
def special_tags_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny tokenizer with ``<tool_call>`` / ``</tool_call>`` added as special tokens (as
    some models' vocabularies have them)."""
    from router_fakes import write_tiny_tokenizer
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    path = write_tiny_tokenizer(tmp_path_factory.mktemp("special-tags"))
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.add_tokens([AddedToken(t, special=True, normalized=False)
                    for t in ("<tool_call>", "</tool_call>")], special_tokens=True)
    tok.save_pretrained(str(path))
    return path


async def test_tool_tags_that_are_special_tokens_still_make_tool_calls(special_tags_dir: Path) -> None:
    """Answers are decoded with special tokens skipped, except a tool format's tags while its
    parser reads the answer: a vocabulary that marks them special still gives tool calls."""
    tok = ModelTokenizer.load("tiny", special_tags_dir)
    ids = tok.encode_text(TWO_CALLS, add_special_tokens=False)
    assert "<tool_call>" not in tok.decode(ids)  # the tags are special tokens here
    server, _ = await _router(tok, special_tags_dir, [TWO_CALLS, TWO_CALLS, TWO_CALLS])
    client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="x", max_retries=0)
    want = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    try:
        reply = await client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "I'll check both."
        calls = choice.message.tool_calls or []
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == want
        text, deltas = "", []
        async for chunk in await client.chat.completions.create(
                model="tiny", messages=USER, tools=TOOLS, stream=True):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                deltas += chunk.choices[0].delta.tool_calls or []
        assert text == "I'll check both."
        args = ["".join(d.function.arguments or "" for d in deltas if d.index == i) for i in (0, 1)]
        assert [json.loads(a) for a in args] == [w[1] for w in want]
        plain = await client.chat.completions.create(model="tiny", messages=USER)
        assert plain.choices[0].message.content == tok.decode(ids)  # no tools: tags skipped
    finally:
        await client.close()
        await server.close()
