"""What real agent clients send, with the official ``anthropic`` and ``openai`` SDKs over HTTP
(issue 27): Claude Code's max_tokens beyond a small model's context, a chat ``developer``
message, images in a resent history; and, in the router's books, a side call of another
model under the main loop's session. Scripted instances answer with chosen token ids and
keep what they received, so the tests read the prompt each call rendered to."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anthropic
import openai
import pytest
from aiohttp.test_utils import TestServer
from router_fakes import FakeInstance, ScriptedInstance, model_state, write_tiny_tokenizer

from router.app import RouterConfig, create_app
from router.core import RouterCore
from router.tokenization import ModelTokenizer
from talaria.protocol import (
    CallRequest,
    InstanceState,
    ModelState,
    Residency,
    SamplingParams,
    SessionKV,
)
from talaria.protocol.text import block_hashes

EOS = 2  # <|im_end|>
CONTEXT = 96
LONG = " ".join(["one two three four five six seven eight"] * 12)  # far beyond CONTEXT
PNG = "iVBORw0KGgo" + "A" * 1357  # base64 of 1025 bytes (1368 characters)
READ = [{"name": "Read", "description": "Read a file",
         "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]
CALL_TEXT = '<tool_call>\n{"name": "Read", "arguments": {"path": "shot.png"}}\n</tool_call>'


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> ModelTokenizer:
    """The tiny models' tokenizer and template with a 96-token context."""
    return ModelTokenizer.load("tiny", write_tiny_tokenizer(tmp_path_factory.mktemp("small"), CONTEXT))


@asynccontextmanager
async def router(tok: ModelTokenizer, *texts: str, **config: Any) -> AsyncIterator[tuple[str, ScriptedInstance]]:
    """A router over one scripted instance answering ``texts`` in turn (each then EOS)."""
    instance = ScriptedInstance("i0", [tok.encode_text(t, add_special_tokens=False) + [EOS] for t in texts])
    cfg = RouterConfig(models={"tiny": "/unused"}, instances={"i0": ""}, poll_interval_s=None, **config)
    server = TestServer(create_app(cfg, clients={"i0": instance}, tokenizers={"tiny": tok}))
    await server.start_server()
    try:
        yield str(server.make_url("/")).rstrip("/"), instance
    finally:
        await server.close()


async def test_claude_codes_max_tokens_is_clamped_to_the_room_left(small: ModelTokenizer) -> None:
    """max_tokens 32000 on a 96-token model: answered, the clamp named in a header; an answer
    that reaches it ends with stop_reason max_tokens, one that ends before with end_turn."""
    user = [{"role": "user", "content": "Fix the bug"}]
    async with router(small, LONG, "Done.", LONG, LONG) as (root, instance):
        claude = anthropic.AsyncAnthropic(base_url=root, api_key="unused", max_retries=0, timeout=60)
        raw = await claude.messages.with_raw_response.create(model="tiny", max_tokens=32000, messages=user)
        full = await raw.parse()
        room = CONTEXT - len(instance.calls[0].prompt_token_ids)
        assert instance.calls[0].params.max_tokens == room
        assert raw.headers["X-Talaria-Max-Tokens-Clamped"] == f"32000->{room}"
        assert full.stop_reason == "max_tokens" and full.usage.output_tokens == room
        short = await claude.messages.with_raw_response.create(model="tiny", max_tokens=32000, messages=user)
        assert (await short.parse()).stop_reason == "end_turn" and short.headers["X-Talaria-Max-Tokens-Clamped"]
        async with claude.messages.stream(model="tiny", max_tokens=64000, messages=user) as stream:
            streamed = await stream.get_final_message()
        assert streamed.stop_reason == "max_tokens" and streamed.usage.output_tokens == room
        counted = await claude.messages.count_tokens(model="tiny", messages=user)  # no output: unaffected
        assert counted.input_tokens == len(instance.calls[0].prompt_token_ids)
        # The same rule on the OpenAI API: finish_reason "length" at the room.
        gpt = openai.AsyncOpenAI(base_url=root + "/v1", api_key="unused", max_retries=0)
        chat = await gpt.chat.completions.with_raw_response.create(model="tiny", messages=user, max_tokens=32000)
        assert chat.parse().choices[0].finish_reason == "length"
        assert chat.headers["X-Talaria-Max-Tokens-Clamped"].startswith("32000->")
        await claude.close()
        await gpt.close()

    # Refusing instead is a setting, for the router or per model: the old 400 naming the room,
    # on the Messages API in Anthropic's words (Claude Code parses them to retry).
    for config in ({"max_tokens_overflow": "refuse"}, {"max_tokens_overflows": {"tiny": "refuse"}}):
        async with router(small, "x", **config) as (root, instance):
            claude = anthropic.AsyncAnthropic(base_url=root, api_key="unused", max_retries=0, timeout=60)
            with pytest.raises(anthropic.BadRequestError, match=r"exceed context limit: \d+ \+ 32000 > 96"):
                await claude.messages.create(model="tiny", max_tokens=32000, messages=user)
            assert (await claude.messages.create(model="tiny", max_tokens=8, messages=user)).content
            await claude.close()
    with pytest.raises(ValueError, match="overflow rules"):
        RouterConfig(models={"tiny": "/unused"}, instances={}, max_tokens_overflow="truncate")


async def test_a_chat_developer_message_reaches_the_prompt(tiny_tokenizer: ModelTokenizer) -> None:
    """OpenAI's clients and openai-agents send ``developer``: it joins the system message (the
    Responses API's merge), and a later one becomes a user turn; a role the template would
    drop is a 400 naming it."""
    async with router(tiny_tokenizer, "ok", "ok") as (root, instance):
        gpt = openai.AsyncOpenAI(base_url=root + "/v1", api_key="unused", max_retries=0)
        await gpt.chat.completions.create(model="tiny", max_tokens=4, messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "developer", "content": "Answer in French."},
            {"role": "user", "content": "Hello"},
            {"role": "developer", "content": "Mind the tests."}])
        await gpt.chat.completions.create(model="tiny", max_tokens=4, messages=[
            {"role": "developer", "content": "Only a developer."}, {"role": "user", "content": "Hi"}])
        with pytest.raises(openai.BadRequestError, match="does not render messages of role 'function'"):
            await gpt.chat.completions.create(model="tiny", max_tokens=4, messages=[
                {"role": "user", "content": "Hi"}, {"role": "function", "name": "f", "content": "lost"}])
        await gpt.close()
    decode = tiny_tokenizer.tokenizer.decode
    assert decode(instance.calls[0].prompt_token_ids) == (
        "<|im_start|>system\nYou are terse.\n\nAnswer in French.<|im_end|>\n"
        "<|im_start|>user\nHello<|im_end|>\n<|im_start|>user\nMind the tests.<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert decode(instance.calls[1].prompt_token_ids).startswith("<|im_start|>system\nOnly a developer.<|im_end|>")
    assert len(instance.calls) == 2


async def test_an_image_in_a_resent_tool_result_is_a_placeholder(tiny_tokenizer: ModelTokenizer) -> None:
    """Claude Code's Read tool returns a screenshot; the client resends it every turn. Each
    call is answered, the image is a line naming its type and size, the header counts it,
    and the next turn's prompt still extends this one's (the placeholder does not move)."""
    async with router(tiny_tokenizer, CALL_TEXT, "It shows a chart.", "Fine.") as (root, instance):
        claude = anthropic.AsyncAnthropic(base_url=root, api_key="unused", max_retries=0, timeout=60)
        user = [{"role": "user", "content": "What is in shot.png?"}]
        used = await claude.messages.create(model="tiny", max_tokens=200, messages=user, tools=READ)
        assert used.stop_reason == "tool_use"
        image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
        history = [*user, {"role": "assistant", "content": [b.model_dump() for b in used.content]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": used.content[-1].id,
                                                 "content": [{"type": "text", "text": "shot.png:"}, image]}]}]
        second = await claude.messages.with_raw_response.create(model="tiny", max_tokens=64, messages=history,
                                                                tools=READ)
        assert (await second.parse()).content[0].text == "It shows a chart."
        assert second.headers["X-Talaria-Media-Omitted"] == "1"
        pdf = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}}
        notes = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "notes"}}
        history += [{"role": "assistant", "content": "It shows a chart."},
                    {"role": "user", "content": [image, pdf, notes, {"type": "text", "text": "And these?"}]}]
        third = await claude.messages.with_raw_response.create(model="tiny", max_tokens=64, messages=history,
                                                               tools=READ)
        assert third.http_response.status_code == 200 and third.headers["X-Talaria-Media-Omitted"] == "3"
        await claude.close()
    placeholder = "[image omitted: image/png, 1.0 KB; this model reads text only]"
    decode = tiny_tokenizer.tokenizer.decode
    second_prompt, third_prompt = instance.calls[1].prompt_token_ids, instance.calls[2].prompt_token_ids
    assert f"<tool_response>\nshot.png:\n{placeholder}\n</tool_response>" in decode(second_prompt)
    assert third_prompt[: len(second_prompt)] == second_prompt
    assert decode(third_prompt).endswith(
        f"<|im_start|>user\n{placeholder}\n[document omitted: application/pdf, 5 B; this model reads text only]"
        "\nnotes\nAnd these?<|im_end|>\n<|im_start|>assistant\n")


async def test_a_side_call_of_another_model_leaves_the_main_loop_where_its_kv_is() -> None:
    """The issue's mechanism: a side call of another model runs on the main loop's instance a
    under the same session id, and a switches the main loop's model out (its KV to host, its
    weights staged). a reports each session id it was sent with what ran last under it. The
    main loop's next call must find its KV there: before, the session id named the side
    call's model on a and the record was the side call's, so the call moved to b and
    recomputed its prompt. (Staged: host KV holds a session where its model is staged only
    while the model holding the slot is its own side call's, ``router.instances.placement.Talaria``.)"""
    a, b = FakeInstance("a", [5, 6]), FakeInstance("b", [5, 6])
    core = RouterCore({"a": a, "b": b}, "talaria", refresh_after_call=False, block_size=16)
    main = list(range(1, 300))
    await _drain(core, CallRequest("c1", "cc", "big", main, SamplingParams(max_tokens=2)))
    await _drain(core, CallRequest("c2", "cc", "small", [7] * 40, SamplingParams(max_tokens=2)))
    assert [(c.session_id, c.last_call) for c in a.calls] == [("cc", False), ("cc#1", True)]  # tentative
    reported = {c.session_id: SessionKV(c.session_id, c.model, host_tokens=len(c.prompt_token_ids) + 2)
                for c in a.calls}  # what a keeps per session id: the last call under it
    core.update_state(InstanceState("a", block_size=16, sessions=reported, models={
        "big": _model("big", Residency.STAGED), "small": _model("small", Residency.ACTIVE)}))
    core.update_state(InstanceState("b", block_size=16, models={"big": _model("big", Residency.ACTIVE)}))
    more = main + [5, 6] + list(range(400, 440))
    await _drain(core, CallRequest("c3", "cc", "big", more, SamplingParams(max_tokens=2)))
    assert [c.call_id for c in a.calls] == ["c1", "c2", "c3"] and b.calls == []
    record = core.sessions.get("cc")
    assert record is not None and record.main is not None and record.main.key == "cc"
    assert record.main.kv.blocks == len(block_hashes(more + [5, 6], 16)) and len(record.branches) == 2
    await core.close()


def _model(name: str, residency: Residency) -> ModelState:
    return model_state(name, residency, prefill_tokens_per_s=1000.0, switch_host_s=1.0)


async def _drain(core: RouterCore, call: CallRequest) -> list[Any]:
    return [e async for e in core.submit(call)]
