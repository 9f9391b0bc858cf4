"""A stream that has begun sends its API's keep-alive whenever it has been silent for
``stream_keepalive_s`` while its call's events keep coming (``router.api.stream_keepalive``).

With parallel tool calls on, text a model writes after a whole call is dropped but still
runs on its instance (a later call could follow it), so a model that rambles after its call
sends nothing on the stream all that while; so does text held back for a possible stop
string. The instance here paces its tokens so that the silent stretch outlasts several
keep-alive periods (``SILENT_PACE_S`` apart), while the text before the call, sent token by
token ``PACE_S`` apart, gets none (an event loop stalled for most of a period at a token
that sends nothing would give it one, so the period is 15 paces). Apart from the keep-alives the stream is the one an unpaced
instance gets."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from api_helpers import EOS, serve
from router_fakes import ScriptedInstance
from test_stream_commit import KEEP_ALIVE, OPENING, blocks_of
from test_tool_call_streams_http import APIS, ARGUMENTS

from router.tokenization import ModelTokenizer
from talaria.protocol import CallEvent, CallRequest

PERIOD_S = 0.15  # stream_keepalive_s
PACE_S = 0.01  # between the tokens of text that is sent
SILENT_PACE_S = 0.03  # between the tokens of text that sends nothing
TEXT = "Writing a.py, one moment.\n"
CALL = f'<tool_call>\n{{"name": "write", "arguments": {ARGUMENTS}}}\n</tool_call>'
RAMBLE = "\nNow I wait for the result." * 3  # dropped: written after the call


class PacedInstance(ScriptedInstance):
    """Answers ``parts`` (text, and the seconds between its tokens: 0 unpaced) a token per
    event."""

    def __init__(self, tok: ModelTokenizer, parts: list[tuple[str, float]]) -> None:
        ids: list[int] = []
        self.paces: list[float] = []
        for text, pace_s in parts:
            part = tok.encode_text(text, add_special_tokens=False)
            ids += part
            self.paces += [pace_s] * len(part)
        super().__init__("i0", [ids + [EOS]])
        self.paces.append(0.0)

    async def submit(self, call: CallRequest) -> AsyncIterator[CallEvent]:
        async for i, event in _numbered(super().submit(call)):
            if self.paces[i]:
                await asyncio.sleep(self.paces[i])
            yield event


async def _numbered(events: AsyncIterator[CallEvent]) -> AsyncIterator[tuple[int, CallEvent]]:
    i = 0
    async for event in events:
        yield i, event
        i += 1


def normalized(value: Any) -> Any:
    """Without what differs between two calls (ids, times, sequence numbers)."""
    if isinstance(value, dict):
        return {k: normalized(v) for k, v in value.items()
                if k not in ("id", "call_id", "created", "created_at", "item_id", "sequence_number")}
    if isinstance(value, list | tuple):
        return [normalized(v) for v in value]
    return value


def without_keep_alives(api: str, blocks: list[tuple[str | None, Any]]) -> Any:
    return normalized([b for b in blocks if b[0] != KEEP_ALIVE[api]])


def call_span(api: str, blocks: list[tuple[str | None, Any]]) -> tuple[int, int]:
    """The indices of the stream's first and last event of the tool call."""
    if api == "chat":
        marks = [i for i, (kind, data) in enumerate(blocks) if kind == "chunk" and isinstance(data, dict)
                 and data["choices"] and data["choices"][0]["delta"].get("tool_calls")]
        return marks[0], marks[-1]
    if api == "messages":
        start = next(i for i, (kind, data) in enumerate(blocks) if kind == "content_block_start"
                     and data["content_block"]["type"] == "tool_use")
        return start, next(i for i in range(start, len(blocks)) if blocks[i][0] == "content_block_stop")
    marks = [i for i, (kind, data) in enumerate(blocks) if kind in ("response.output_item.added",
             "response.output_item.done") and data["item"]["type"] == "function_call"]
    return marks[0], marks[-1]


async def stream(tok: ModelTokenizer, path: str, body: dict[str, Any], paced: bool,
                 parts: list[tuple[str, float]]) -> list[tuple[str | None, Any]]:
    instance = PacedInstance(tok, parts if paced else [(text, 0.0) for text, _ in parts])
    config = {"stream_keepalive_s": PERIOD_S} if paced else {}
    async with serve(tok, {"i0": instance}, **config) as client:
        resp = await client.post(path, json={"model": "tiny", **body, "stream": True})
        assert resp.status == 200, await resp.text()
        return blocks_of(await resp.text())


@pytest.mark.parametrize("api", list(APIS))
async def test_a_stream_silent_after_its_call_keeps_alive_and_answers_as_before(
        tiny_tokenizer: ModelTokenizer, api: str) -> None:
    path, body = APIS[api]
    parts = [(TEXT, PACE_S), (CALL, 0.0), (RAMBLE, SILENT_PACE_S)]
    blocks = await stream(tiny_tokenizer, path, body, True, parts)
    start, end = call_span(api, blocks)
    keep_alive = KEEP_ALIVE[api]
    assert [kind for kind, _ in blocks[:len(OPENING[api])]] == OPENING[api]
    # the text before the call, sent steadily over several periods: no keep-alive
    assert not [kind for kind, _ in blocks[len(OPENING[api]):start] if kind == keep_alive]
    # the ramble after it, silent for several periods: keep-alives, then the answer's end
    after = [kind for kind, _ in blocks[end + 1:]]
    silent = after.count(keep_alive)
    assert silent >= 3 and after[:silent] == [keep_alive] * silent
    if keep_alive == "comment":
        assert {data for kind, data in blocks if kind == "comment"} == {": keep-alive"}
    if api == "responses":
        assert [data["sequence_number"] for _, data in blocks] == list(range(len(blocks)))
    unpaced = await stream(tiny_tokenizer, path, body, False, parts)
    assert without_keep_alives(api, blocks) == without_keep_alives(api, unpaced)


async def test_text_held_back_for_a_stop_string_keeps_the_stream_alive(tiny_tokenizer: ModelTokenizer) -> None:
    """A text completion's tokens that may begin its stop string send nothing until they
    cannot: the stream sends its comment meanwhile, and the text is the same after it."""
    stop = "x" * 40 + "!"
    body = {"prompt": "Hello", "max_tokens": 200, "stop": [stop]}
    parts = [("Start ", PACE_S), ("x" * 36, SILENT_PACE_S), ("y end.", 0.0)]
    blocks = await stream(tiny_tokenizer, "/v1/completions", body, True, parts)
    kinds = [kind for kind, _ in blocks]
    assert kinds.count("comment") >= 3
    text = "".join(data["choices"][0]["text"] for kind, data in blocks if kind == "chunk" and data != "[DONE]")
    assert text == "Start " + "x" * 36 + "y end."
    unpaced = await stream(tiny_tokenizer, "/v1/completions", body, False, parts)
    assert without_keep_alives("completions", blocks) == without_keep_alives("completions", unpaced)
