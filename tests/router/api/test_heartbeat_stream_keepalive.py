"""An instance's heartbeats (empty events for a call its engine holds mid-answer:
``talaria.instance.heartbeats``) pass through every API as nothing but the API's own
keep-alive once the stream has been silent ``stream_keepalive_s``: the answer is the one a
call without the hold gets."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from api_helpers import EOS, serve
from router_fakes import ScriptedInstance
from test_silent_stream_keepalive import without_keep_alives
from test_stream_commit import KEEP_ALIVE, blocks_of
from test_stream_commit_clients import router
from test_tool_call_streams_http import APIS

from router.tokenization import ModelTokenizer
from talaria.protocol import CallEvent, CallRequest

PERIOD_S = 0.15  # stream_keepalive_s
BEAT_S = 0.03  # between heartbeats
BEATS = 25  # five periods of heartbeats
TEXT = "Reading the file now, then I will answer."
ENDPOINTS = {**APIS, "completions": ("/v1/completions", {"prompt": "Hello", "max_tokens": 200})}


class HoldingInstance(ScriptedInstance):
    """Answers ``TEXT`` a token per event; with ``beats``, that many heartbeats ``BEAT_S``
    apart after its third token."""

    def __init__(self, tok: ModelTokenizer, beats: int) -> None:
        super().__init__("i0", [tok.encode_text(TEXT, add_special_tokens=False) + [EOS]])
        self.beats = beats

    async def submit(self, call: CallRequest) -> AsyncIterator[CallEvent]:
        sent = 0
        async for event in super().submit(call):
            yield event
            sent += 1
            if sent == 3:
                for _ in range(self.beats):
                    await asyncio.sleep(BEAT_S)
                    yield CallEvent(call_id=call.call_id)


async def _stream(tok: ModelTokenizer, api: str, beats: int) -> list[tuple[str | None, Any]]:
    path, body = ENDPOINTS[api]
    async with serve(tok, {"i0": HoldingInstance(tok, beats)}, stream_keepalive_s=PERIOD_S) as client:
        resp = await client.post(path, json={"model": "tiny", **body, "stream": True})
        assert resp.status == 200, await resp.text()
        return blocks_of(await resp.text())


@pytest.mark.parametrize("api", list(ENDPOINTS))
async def test_heartbeats_become_keep_alives_and_the_answer_is_unchanged(
        tiny_tokenizer: ModelTokenizer, api: str) -> None:
    held = await _stream(tiny_tokenizer, api, BEATS)
    kinds = [kind for kind, _ in held]
    assert kinds.count(KEEP_ALIVE[api]) >= 3
    plain = await _stream(tiny_tokenizer, api, 0)
    assert without_keep_alives(api, held) == without_keep_alives(api, plain)


async def test_a_responses_keep_alive_mid_answer_carries_the_answer_so_far(
        tiny_tokenizer: ModelTokenizer) -> None:
    """Its ``response.in_progress`` is the response as it stands (the open message with its
    text so far, in progress), not the empty one of the stream's start: a client that takes
    the event's response as its state loses nothing."""
    blocks = await _stream(tiny_tokenizer, "responses", BEATS)
    text, checked = "", 0
    for kind, data in blocks:
        if kind == "response.output_text.delta":
            text += data["delta"]
        elif kind == "response.in_progress" and text:
            output = data["response"]["output"]
            assert len(output) == 1 and output[0]["status"] == "in_progress"
            assert output[0]["type"] == "message" and output[0]["content"][0]["text"] == text
            checked += 1
    assert checked >= 3 and text == TEXT


async def test_the_openai_accumulator_reads_a_held_responses_stream_as_before(
        tiny_tokenizer: ModelTokenizer) -> None:
    """``responses.stream`` (the SDK's accumulator takes a lifecycle event's output items)
    ends with the same response whether or not keep-alives went out mid-answer."""
    async def final_text(beats: int) -> tuple[str, int]:
        instance = HoldingInstance(tiny_tokenizer, beats)
        async with router(tiny_tokenizer, instance, stream_keepalive_s=PERIOD_S) as server:
            client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="k", max_retries=0)
            async with client.responses.stream(model="tiny", input="Hello world") as stream:
                kinds = [event.type async for event in stream]
                final = await stream.get_final_response()
            await client.close()
        return final.output_text, kinds.count("response.in_progress")

    held, plain = await final_text(BEATS), await final_text(0)
    assert held[0] == plain[0] == TEXT
    assert held[1] >= plain[1] + 3
