"""A call its instance fails with an error whose text happens to be one the router gives a
call cut by a shut-down (``router.outcomes.SHUTDOWN_ERROR``, ``INSTANCE_SHUTDOWN_ERROR``) is
a failed call, a 502 ``instance_failed``: only the router's own ``ShutDownEvent`` is told as
a 503 ``server_shutting_down``. The API once mapped those texts back to the 503, so any
instance error (or change in wording) could pass for a shut-down or break its mapping."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from api_helpers import EOS, chat_body, reply, serve, sse
from router_fakes import FakeInstance

from router.outcomes import INSTANCE_SHUTDOWN_ERROR, SHUTDOWN_ERROR
from router.tokenization import ModelTokenizer
from talaria.protocol import CallEvent, CallRequest

TEXTS = [SHUTDOWN_ERROR, INSTANCE_SHUTDOWN_ERROR]


class FailsWith(FakeInstance):
    """Streams two tokens of its reply, then fails the call with ``text`` as its error."""

    def __init__(self, reply: list[int], text: str) -> None:
        super().__init__("i0", reply)
        self.text = text

    async def submit(self, call: CallRequest) -> AsyncIterator[CallEvent]:
        self.calls.append(call)
        for token in self.reply[:2]:
            await asyncio.sleep(0)
            yield CallEvent(call.call_id, [token])
        yield CallEvent(call.call_id, finished=True, finish_reason="error", error=self.text)


@pytest.mark.parametrize("text", TEXTS)
async def test_a_collected_chat_call_failing_with_the_text_is_a_502(
    tiny_tokenizer: ModelTokenizer, text: str,
) -> None:
    inst = FailsWith(reply(tiny_tokenizer) + [EOS], text)
    async with serve(tiny_tokenizer, {"i0": inst}) as client:
        resp = await client.post("/v1/chat/completions", json=chat_body(max_tokens=50))
        error = (await resp.json())["error"]
    assert resp.status == 502, error
    assert error["code"] == "instance_failed" and "shutting down" not in error["message"]


@pytest.mark.parametrize("text", TEXTS)
async def test_a_chat_stream_failing_with_the_text_ends_with_instance_failed(
    tiny_tokenizer: ModelTokenizer, text: str,
) -> None:
    inst = FailsWith(reply(tiny_tokenizer) + [EOS], text)
    async with serve(tiny_tokenizer, {"i0": inst}) as client:
        resp = await client.post("/v1/chat/completions", json=chat_body(max_tokens=50, stream=True))
        events = await sse(resp)
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["code"] == "instance_failed" and "shutting down" not in error["message"]


@pytest.mark.parametrize("text", TEXTS)
async def test_an_anthropic_message_failing_with_the_text_is_a_502(
    tiny_tokenizer: ModelTokenizer, text: str,
) -> None:
    body = {"model": "tiny", "max_tokens": 50, "messages": [{"role": "user", "content": "Hello"}]}
    inst = FailsWith(reply(tiny_tokenizer) + [EOS], text)
    async with serve(tiny_tokenizer, {"i0": inst}) as client:
        resp = await client.post("/v1/messages", json=body)
        data = await resp.json()
    assert resp.status == 502, data
    assert "shutting down" not in data["error"]["message"]
