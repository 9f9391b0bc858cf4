"""A thinking model's ``<think>`` text through the three APIs, over HTTP, on the tiny models'
tokenizer: the reasoning comes back apart from the answer (chat ``reasoning_content``,
Anthropic ``thinking`` blocks when asked for, a Responses ``reasoning`` item), streamed and
not, with its tokens counted; a tool call after it is a call; stop strings and token limits
inside it end the answer there; and a model without a reasoning parser answers as before."""

from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anthropic
import pytest
from aiohttp.test_utils import TestClient
from api_helpers import EOS, named_events, scripted, serve, sse
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from router_fakes import ScriptedInstance

from router.tokenization import ModelTokenizer
from talaria.protocol import CallEvent, CallRequest, CallUsage

REASONING = "The user greets me; I say <b>hello</b> back.\n"
CONTENT = "Hello there."
ANSWER = f"<think>\n{REASONING}</think>\n\n{CONTENT}"
QWEN3 = {"reasoning_parsers": {"tiny": "qwen3"}}
USER = [{"role": "user", "content": "Hi"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_AFTER_THINKING = f"<think>\nI will write <tool_call> when I know.\n</think>\n\n{CALL}"
STREAM_EVENT = TypeAdapter(ResponseStreamEvent)


def reasoning_tokens(tok: ModelTokenizer, text: str) -> int:
    """The answer's tokens up to the one that completes ``</think>`` (one token an event)."""
    ids = tok.encode_text(text, add_special_tokens=False)
    return next(n for n in range(1, len(ids) + 1) if "</think>" in tok.decode(ids[:n]))


def chat_parts(chunks: list[Any]) -> tuple[str, str, list[str]]:
    """A chat stream's reasoning, content, and the order of its delta kinds."""
    reasoning, content, kinds = "", "", []
    for chunk in chunks:
        if chunk == "[DONE]" or not chunk["choices"]:
            continue
        delta = chunk["choices"][0]["delta"]
        if delta.get("reasoning"):
            assert delta["reasoning_content"] == delta["reasoning"]  # both names, as clients read either
            reasoning += delta["reasoning"]
            kinds.append("reasoning")
        if delta.get("content"):
            content += delta["content"]
            kinds.append("content")
        if delta.get("tool_calls"):
            kinds.append("tool_calls")
    return reasoning, content, kinds


async def chat(client: TestClient, **kw: Any) -> dict[str, Any]:
    resp = await client.post("/v1/chat/completions", json={"model": "tiny", "messages": USER, **kw})
    assert resp.status == 200, await resp.text()
    result: dict[str, Any] = await resp.json()
    return result


async def chat_stream(client: TestClient, **kw: Any) -> list[Any]:
    return await sse(await client.post("/v1/chat/completions",
                                       json={"model": "tiny", "messages": USER, "stream": True, **kw}))


async def test_chat_returns_the_reasoning_apart_collected_and_streamed(tiny_tokenizer: ModelTokenizer) -> None:
    instance = scripted(tiny_tokenizer, ANSWER, ANSWER)
    async with serve(tiny_tokenizer, {"i0": instance}, **QWEN3) as client:
        data = await chat(client)
        chunks = await chat_stream(client, stream_options={"include_usage": True})
    message = data["choices"][0]["message"]
    assert message == {"role": "assistant", "content": CONTENT, "reasoning": REASONING,
                       "reasoning_content": REASONING}
    assert data["choices"][0]["finish_reason"] == "stop"
    thought = reasoning_tokens(tiny_tokenizer, ANSWER)
    assert data["usage"]["completion_tokens_details"] == {"reasoning_tokens": thought}
    assert data["usage"]["completion_tokens"] > thought
    reasoning, content, kinds = chat_parts(chunks)
    assert (reasoning, content) == (REASONING, CONTENT)
    assert kinds.index("content") == kinds.count("reasoning") > 3  # pieces, all before the content
    assert chunks[-2]["usage"]["completion_tokens_details"] == {"reasoning_tokens": thought}
    assert chunks[-3]["choices"][0]["finish_reason"] == "stop" and chunks[-1] == "[DONE]"


async def test_a_model_without_a_reasoning_parser_answers_as_before(tiny_tokenizer: ModelTokenizer) -> None:
    """The guard beside the change (it passes on the old code too): no parser configured and
    none in the chat template, so ``<think>`` text is the answer's, on every API."""
    instance = scripted(tiny_tokenizer, *[ANSWER] * 5)
    async with serve(tiny_tokenizer, {"i0": instance}) as client:
        data = await chat(client)
        chunks = await chat_stream(client)
        messages = await (await client.post("/v1/messages", json={
            "model": "tiny", "messages": USER, "max_tokens": 200, "thinking": {"type": "enabled",
                                                                               "budget_tokens": 100}})).json()
        responses = await (await client.post("/v1/responses", json={"model": "tiny", "input": "Hi"})).json()
    assert data["choices"][0]["message"] == {"role": "assistant", "content": ANSWER}
    assert "completion_tokens_details" not in data["usage"]
    assert chat_parts(chunks)[:2] == ("", ANSWER)
    assert messages["content"] == [{"type": "text", "text": ANSWER}]
    assert [i["type"] for i in responses["output"]] == ["message"]
    assert responses["output"][0]["content"][0]["text"] == ANSWER


class TwoEvents(ScriptedInstance):
    """Answers with ``tokens`` (then EOS) in two events, cut after ``cut`` tokens."""

    def __init__(self, tokens: list[int], cut: int) -> None:
        super().__init__("i0", [tokens + [EOS]])
        self.cut = cut

    async def submit(self, call: CallRequest) -> AsyncIterator[CallEvent]:
        self.calls.append(call)
        tokens = self.script[0]
        for part, last in ((tokens[: self.cut], False), (tokens[self.cut:], True)):
            yield CallEvent(call_id=call.call_id, token_ids=part, finished=last,
                            finish_reason="stop" if last else None,
                            usage=CallUsage(len(call.prompt_token_ids), len(tokens) if last else len(part)))


@pytest.fixture(scope="module")
def special_think_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> ModelTokenizer:
    """The tiny tokenizer with ``<think>`` / ``</think>`` added as special tokens."""
    from router_fakes import write_tiny_tokenizer
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    path = write_tiny_tokenizer(tmp_path_factory.mktemp("special-think"))
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in ("<think>", "</think>")],
                   special_tokens=True)
    tok.save_pretrained(str(path))
    return ModelTokenizer.load("tiny", path)


@pytest.mark.parametrize("special", [False, True])
async def test_tags_split_across_token_events_at_every_position(
        special: bool, tiny_tokenizer: ModelTokenizer, special_think_tokenizer: ModelTokenizer) -> None:
    """The answer's tokens in two events, cut at every token boundary (each tag's tokens at
    each of theirs); with the tags as special tokens (one token each), they still reach the
    parser and never the content."""
    tok = special_think_tokenizer if special else tiny_tokenizer
    ids = tok.encode_text(ANSWER, add_special_tokens=False)
    if special:
        assert "<think>" not in tok.decode(ids)
        assert tok.special_ids(["<think>", "</think>"]) and len(ids) < len(tiny_tokenizer.encode_text(ANSWER, False))
    for cut in range(1, len(ids) + 1):
        async with serve(tok, {"i0": TwoEvents(ids, cut)}, **QWEN3) as client:
            reasoning, content, kinds = chat_parts(await chat_stream(client))
        assert (reasoning, content) == (REASONING, CONTENT), cut
        assert "reasoning" not in kinds[kinds.index("content"):]
    async with serve(tok, {"i0": TwoEvents(ids, 3)}, **QWEN3) as client:
        assert (await chat(client))["choices"][0]["message"]["content"] == CONTENT


async def test_special_think_tags_are_skipped_as_before_without_a_parser(
        special_think_tokenizer: ModelTokenizer) -> None:
    tok = special_think_tokenizer
    async with serve(tok, {"i0": scripted(tok, ANSWER)}) as client:
        data = await chat(client)
    assert data["choices"][0]["message"]["content"] == tok.decode(tok.encode_text(ANSWER, False))


@asynccontextmanager
async def anthropic_client(tok: ModelTokenizer, *answers: str) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with serve(tok, {"i0": scripted(tok, *answers)}, **QWEN3) as http:
        client = anthropic.AsyncAnthropic(base_url=str(http.server.make_url("/")), api_key="x", max_retries=0)
        try:
            yield client
        finally:
            await client.close()


async def test_anthropic_thinking_blocks_only_when_thinking_is_enabled(tiny_tokenizer: ModelTokenizer) -> None:
    thinking: Any = {"type": "enabled", "budget_tokens": 1024}
    async with anthropic_client(tiny_tokenizer, *[ANSWER] * 4) as client:
        reply = await client.messages.create(model="tiny", max_tokens=200, messages=USER, thinking=thinking)
        async with client.messages.stream(model="tiny", max_tokens=200, messages=USER, thinking=thinking) as stream:
            events = [event async for event in stream]
            streamed = await stream.get_final_message()
        hidden = await client.messages.create(model="tiny", max_tokens=200, messages=USER)
        async with client.messages.stream(model="tiny", max_tokens=200, messages=USER) as stream:
            hidden_streamed = await stream.get_final_message()
    for message in (reply, streamed):
        assert [b.model_dump() for b in message.content] == [
            {"type": "thinking", "thinking": REASONING, "signature": ""},
            {"type": "text", "text": CONTENT, "citations": None}]
        assert message.stop_reason == "end_turn"
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert deltas.index("text_delta") == deltas.count("thinking_delta") > 3
    starts = [(e.index, e.content_block.type) for e in events if e.type == "content_block_start"]
    stops = [e.index for e in events if e.type == "content_block_stop"]
    assert starts == [(0, "thinking"), (1, "text")] and stops == [0, 1]
    for message in (hidden, hidden_streamed):  # not asked for: left out, not put in the text
        assert [(b.type, getattr(b, "text", None)) for b in message.content] == [("text", CONTENT)]
        assert message.usage.output_tokens == len(tiny_tokenizer.encode_text(ANSWER, False)) + 1


async def test_hidden_thinking_keeps_the_anthropic_stream_alive(tiny_tokenizer: ModelTokenizer) -> None:
    """Thinking not asked for is not sent, but the model still spends its time on it (minutes
    for a long thought): the stream sends a ``ping`` each ``stream_keepalive_s`` meanwhile, as
    before its first token, so an idle timeout does not cut it (``router.api.stream_keepalive``).
    Shown thinking needs one only where a token sends nothing (text held back as a possible tag)."""
    body = {"model": "tiny", "messages": USER, "max_tokens": 200, "stream": True}
    async with serve(tiny_tokenizer, {"i0": scripted(tiny_tokenizer, ANSWER, ANSWER)}, **QWEN3,
                     stream_commit_s=None, stream_keepalive_s=1e-9) as client:
        hidden = named_events(await (await client.post("/v1/messages", json=body)).text())
        shown = named_events(await (await client.post("/v1/messages", json={
            **body, "thinking": {"type": "enabled", "budget_tokens": 1024}})).text())
    names = [name for name, _ in hidden]
    first_block = names.index("content_block_start")
    assert names[:2] == ["message_start", "ping"] and names[first_block:].count("ping") == 0
    assert names.count("ping") > 3  # one at the opening, then while the model thought
    assert [d["content_block"]["type"] for n, d in hidden if n == "content_block_start"] == ["text"]
    # each token of the thought a thinking delta when shown, else a ping (at this period)
    shown_deltas = sum(d["delta"]["type"] == "thinking_delta" for n, d in shown if n == "content_block_delta")
    assert 0 < [name for name, _ in shown].count("ping") - 1 == names.count("ping") - 1 - shown_deltas


def validated(event: dict[str, Any]) -> dict[str, Any]:
    if "response" in event:
        Response.model_validate(event["response"])
    STREAM_EVENT.validate_python(event)
    return event


async def responses_pair(client: TestClient, **kw: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One Responses call collected, one streamed (each event validated by the openai SDK)."""
    body = {"model": "tiny", "input": "Hi", **kw}
    data = await (await client.post("/v1/responses", json=body)).json()
    Response.model_validate(data)
    resp = await client.post("/v1/responses", json={**body, "stream": True})
    assert resp.status == 200
    return data, [validated(d) for _, d in named_events(await resp.text())]


async def test_responses_reasoning_item_collected_and_streamed(tiny_tokenizer: ModelTokenizer) -> None:
    async with serve(tiny_tokenizer, {"i0": scripted(tiny_tokenizer, ANSWER, ANSWER)}, **QWEN3) as client:
        data, events = await responses_pair(client)
    reasoning, message = data["output"]
    assert reasoning["id"].startswith("rs_")
    assert {k: v for k, v in reasoning.items() if k != "id"} == {
        "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": REASONING}],
        "status": "completed"}
    assert message["type"] == "message" and message["content"][0]["text"] == CONTENT
    thought = reasoning_tokens(tiny_tokenizer, ANSWER)
    assert data["usage"]["output_tokens_details"] == {"reasoning_tokens": thought}
    kinds = [e["type"] for e in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    deltas = [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"]
    assert "".join(deltas) == REASONING and len(deltas) > 3
    done = kinds.index("response.reasoning_text.done")
    assert kinds[done:done + 4] == ["response.reasoning_text.done", "response.content_part.done",
                                    "response.output_item.done", "response.output_item.added"]
    final = events[-1]["response"]
    assert kinds[-1] == "response.completed"
    assert [{k: v for k, v in i.items() if k != "id"} for i in final["output"]] == [
        {k: v for k, v in i.items() if k != "id"} for i in data["output"]]
    assert final["usage"]["output_tokens_details"] == {"reasoning_tokens": thought}


def call_of(api: str, data: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    if api == "chat":
        call = data["choices"][0]["message"]["tool_calls"][0]["function"]
        return call["name"], json.loads(call["arguments"])
    if api == "messages":
        (use,) = [b for b in data["content"] if b["type"] == "tool_use"]
        return use["name"], use["input"]
    (item,) = [i for i in data["output"] if i["type"] == "function_call"]
    return item["name"], json.loads(item["arguments"])


APIS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {"messages": USER, "tools": TOOLS}),
    "messages": ("/v1/messages", {"messages": USER, "max_tokens": 300, "thinking": {"type": "adaptive"},
                                  "tools": [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}]}),
    "responses": ("/v1/responses", {"input": "Hi", "tools": [{"type": "function", "name": "get_weather",
                                                              "parameters": TOOLS[0]["function"]["parameters"]}]}),
}
THOUGHT = "I will write <tool_call> when I know.\n"


@pytest.mark.parametrize("api", list(APIS))
async def test_a_tool_call_after_thinking_is_a_call_and_the_thinking_is_not_content(
        api: str, tiny_tokenizer: ModelTokenizer) -> None:
    path, body = APIS[api]
    instance = scripted(tiny_tokenizer, CALL_AFTER_THINKING, CALL_AFTER_THINKING)
    async with serve(tiny_tokenizer, {"i0": instance}, **QWEN3) as client:
        data = await (await client.post(path, json={"model": "tiny", **body})).json()
        resp = await client.post(path, json={"model": "tiny", **body, "stream": True})
        events = named_events(await resp.text())
    assert call_of(api, data) == ("get_weather", {"city": "Paris"})
    if api == "chat":
        message = data["choices"][0]["message"]
        assert message["reasoning_content"] == THOUGHT and message["content"] is None
        assert data["choices"][0]["finish_reason"] == "tool_calls"
        reasoning, content, kinds = chat_parts([d for _, d in events])
        assert (reasoning, content) == (THOUGHT, "") and kinds[-1] == "tool_calls" and "content" not in kinds
        args = "".join(c["function"]["arguments"] for _, d in events if d != "[DONE]" and d["choices"]
                       for c in d["choices"][0]["delta"].get("tool_calls") or [])
        assert json.loads(args) == {"city": "Paris"}
    elif api == "messages":
        assert [b["type"] for b in data["content"]] == ["thinking", "tool_use"]
        assert data["content"][0]["thinking"] == THOUGHT and data["stop_reason"] == "tool_use"
        starts = [d["content_block"]["type"] for n, d in events if n == "content_block_start"]
        assert starts == ["thinking", "tool_use"] and events[-2][1]["delta"]["stop_reason"] == "tool_use"
    else:
        assert [i["type"] for i in data["output"]] == ["reasoning", "function_call"]
        added = [d["item"]["type"] for n, d in events if n == "response.output_item.added"]
        assert added == ["reasoning", "function_call"] and events[-1][0] == "response.completed"


STOPPED = "<think>\nFirst this. STOP Then that.\n</think>\n\nDone."


@pytest.mark.parametrize("api", list(APIS))
async def test_a_stop_string_or_the_token_limit_inside_the_reasoning_ends_the_answer_there(
        api: str, tiny_tokenizer: ModelTokenizer) -> None:
    path, body = APIS[api]
    body = {k: v for k, v in body.items() if k != "tools"}
    ids = tiny_tokenizer.encode_text(ANSWER, add_special_tokens=False)
    limit = next(n for n in range(len(ids)) if tiny_tokenizer.decode(ids[:n]).endswith("greets"))
    stop = {"stop_sequences": ["STOP"]} if api == "messages" else {"stop": ["STOP"]}
    cap = {"max_output_tokens": limit} if api == "responses" else {"max_tokens": limit}
    results = []
    script = [ANSWER] if api == "responses" else [STOPPED, ANSWER]
    async with serve(tiny_tokenizer, {"i0": scripted(tiny_tokenizer, *script)}, **QWEN3) as client:
        if api != "responses":  # the Responses API has no stop strings
            results.append(await (await client.post(path, json={"model": "tiny", **body, **stop})).json())
        results.append(await (await client.post(path, json={"model": "tiny", **body, **cap})).json())
    cut = "The user greets"
    if api == "chat":
        stopped, limited = results
        assert stopped["choices"][0]["message"] == {"role": "assistant", "content": "",
                                                    "reasoning": "First this. ",
                                                    "reasoning_content": "First this. "}
        assert stopped["choices"][0]["finish_reason"] == "stop"
        assert limited["choices"][0]["message"]["reasoning_content"] == cut
        assert limited["choices"][0]["finish_reason"] == "length"
        assert limited["usage"]["completion_tokens_details"]["reasoning_tokens"] == limit
    elif api == "messages":
        stopped, limited = results
        assert stopped["content"] == [{"type": "thinking", "thinking": "First this. ", "signature": ""}]
        assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("stop_sequence", "STOP")
        assert limited["content"] == [{"type": "thinking", "thinking": cut, "signature": ""}]
        assert limited["stop_reason"] == "max_tokens"
    else:
        (limited,) = results
        Response.model_validate(limited)
        assert limited["status"] == "incomplete"
        assert [(i["type"], i["status"], i["content"][0]["text"]) for i in limited["output"]] == [
            ("reasoning", "incomplete", cut)]


async def test_a_template_that_opens_think_gets_deepseek_r1_and_none_turns_it_off(
        tiny_tokenizer: ModelTokenizer) -> None:
    """A chat template whose generation prompt opens ``<think>`` (DeepSeek-R1's, QwQ's) calls
    for ``deepseek_r1`` with nothing configured: the answer begins inside its reasoning."""
    hf = copy.deepcopy(tiny_tokenizer.tokenizer)
    hf.chat_template = (tiny_tokenizer.chat_template or "").replace(
        "{{- '<|im_start|>assistant\\n' }}{%- endif %}", "{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
    ) + "{#- earlier turns: content.split('</think>')[-1] #}"
    tok = ModelTokenizer("tiny", hf, 4096)
    assert tok.encode_chat(USER)[-3:] != tiny_tokenizer.encode_chat(USER)[-3:]  # the template changed
    answer = f"{REASONING}</think>\n\n{CONTENT}"
    async with serve(tok, {"i0": scripted(tok, answer)}) as client:
        message = (await chat(client))["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (REASONING, CONTENT)
    async with serve(tok, {"i0": scripted(tok, answer)}, reasoning_parsers={"tiny": "none"}) as client:
        assert (await chat(client))["choices"][0]["message"] == {"role": "assistant", "content": answer}


async def test_a_forced_tool_call_is_content_even_where_the_prompt_opened_think(
        tiny_tokenizer: ModelTokenizer) -> None:
    rest = '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    async with serve(tiny_tokenizer, {"i0": scripted(tiny_tokenizer, rest)},
                     reasoning_parsers={"tiny": "deepseek_r1"}) as client:
        data = await chat(client, tools=TOOLS, tool_choice="required")
    assert call_of("chat", data) == ("get_weather", {"city": "Oslo"})
    assert data["choices"][0]["message"]["reasoning_content"] is None
    assert data["choices"][0]["message"]["reasoning"] is None


async def test_an_anthropic_prefill_inside_the_thinking_continues_it(tiny_tokenizer: ModelTokenizer) -> None:
    async with anthropic_client(tiny_tokenizer, f" more.</think>{CONTENT}") as client:
        reply = await client.messages.create(
            model="tiny", max_tokens=200, thinking={"type": "enabled", "budget_tokens": 1024},
            messages=USER + [{"role": "assistant", "content": "<think>\nA thought"}])
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in reply.content] == [
        ("thinking", " more."), ("text", CONTENT)]



def test_a_history_message_s_reasoning_reaches_the_template_as_reasoning_content() -> None:
    """A client that sends back vLLM's ``reasoning`` field gets it rendered as the
    ``reasoning_content`` Qwen3's template reads; ``reasoning_content`` itself wins."""
    from router.api.openai_schema import parse_chat
    turns = [{"role": "user", "content": "hi"},
             {"role": "assistant", "content": "A.", "reasoning": "think 1"},
             {"role": "assistant", "content": "B.", "reasoning": "x", "reasoning_content": "think 2"}]
    messages = parse_chat({"model": "tiny", "messages": turns}).messages
    assert messages is not None
    assert [m.get("reasoning_content") for m in messages] == [None, "think 1", "think 2"]
    assert all("reasoning" not in m for m in messages)
