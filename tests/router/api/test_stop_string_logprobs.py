"""Logprobs of an answer cut at a stop string cover the tokens up to and including the one
whose text completed the stop string, and none after it, however the instance grouped the
tokens into events: the collected answer's, each streamed chunk's, in chat and in legacy
completions (``router.api.stop_cut`` states the rule and where it comes from)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from api_helpers import chat_body, reply, serve, sse
from router_fakes import FakeInstance

from router.api.stream_output import OutputAssembler
from router.tokenization import ModelTokenizer
from talaria.protocol import CallEvent, CallRequest

# REPLY_TEXT's tokens: He|llo| w|or|ld|,| th|is| is| a| tes|t|.
# (stop strings, the answer's text, how many tokens the answer keeps)
CASES = [
    ([" is"], "Hello world, this", 9),  # `` is`` completes it: a token wholly in the stop string
    (["is a"], "Hello world, this ", 10),  # starts inside `` is``, `` a`` completes it
    (["wor"], "Hello ", 4),  # starts inside `` w``, ``or`` completes it
    ([" t"], "Hello world,", 7),  # `` th`` completes it and runs past its end
    (["t."], "Hello world, this is a tes", 13),  # the last token completes it: nothing to drop
    # ``is`` completes (with ``is``) before ``this is`` (with `` is``), which starts earlier:
    # the one completed first ends the answer, whatever came in the same event
    (["this is", "is"], "Hello world, th", 8),
]


def _logprob(k: int) -> float:
    return -0.01 * (k + 1)  # a token's logprob names its place in the answer


def _groups(ids: list[int], size: int) -> list[list[int]]:
    return [ids[k:k + size] for k in range(0, len(ids), size)]


@pytest.mark.parametrize("size", [1, 2, 3, 13])
@pytest.mark.parametrize(("stops", "text", "kept"), CASES)
def test_an_answer_cut_at_a_stop_string_keeps_the_logprobs_of_its_tokens_only(
    tokenizer: ModelTokenizer, stops: list[str], text: str, kept: int, size: int,
) -> None:
    ids = reply(tokenizer)
    assert len(ids) == 13
    out = OutputAssembler(tokenizer, tokenizer.encode_text("Hi"), stops, want_logprobs=True)
    streamed_chat: list[dict[str, Any]] = []
    streamed_tokens: list[str] = []
    streamed_offsets: list[int] = []
    start = 0
    for group in _groups(ids, size):
        piece = out.add(CallEvent("c", token_ids=group,
                                  logprobs=[_logprob(start + k) for k in range(len(group))],
                                  finished=start + len(group) == len(ids), finish_reason="stop"))
        start += len(group)
        chat, completion = out.chat_logprobs(piece), out.completion_logprobs(piece)
        assert chat is not None and completion is not None
        streamed_chat += chat["content"]
        streamed_tokens += completion["tokens"]
        streamed_offsets += completion["text_offset"]
        if out.done:
            break
    assert out.text == text and out.finish_reason == "stop"
    expected = [tokenizer.decode([t]) for t in ids[:kept]]
    chat, completion = out.chat_logprobs(), out.completion_logprobs()
    assert chat is not None and completion is not None
    assert [c["token"] for c in chat["content"]] == expected
    assert [c["logprob"] for c in chat["content"]] == [_logprob(k) for k in range(kept)]
    assert completion["tokens"] == expected
    assert completion["token_logprobs"] == [_logprob(k) for k in range(kept)]
    assert completion["text_offset"] == [len("".join(expected[:k])) for k in range(kept)]
    # the chunks streamed carry the same logprobs, none past the stop string
    assert streamed_chat == chat["content"]
    assert streamed_tokens == completion["tokens"] and streamed_offsets == completion["text_offset"]
    # the tokens counted are those the logprobs cover
    assert out.usage()["completion_tokens"] == kept


class OneEventInstance(FakeInstance):
    """Sends its whole reply in one event, with each token's logprob (an instance that
    produced several tokens in one step, or whose events were joined on the way)."""

    async def submit(self, call: CallRequest) -> AsyncIterator[CallEvent]:
        self.calls.append(call)
        tokens = self.reply[: call.params.max_tokens]
        yield CallEvent(call_id=call.call_id, token_ids=tokens,
                        logprobs=[_logprob(k) for k in range(len(tokens))], finished=True,
                        finish_reason="stop", usage=self.usage(call, 0, 1))


async def test_each_api_returns_the_logprobs_of_the_tokens_before_the_stop_string(
    tokenizer: ModelTokenizer,
) -> None:
    """`` a`` completes ``is a``; `` tes``, ``t`` and ``.`` came in the same event, and no
    logprobs of theirs reach the client, collected or streamed."""
    ids = reply(tokenizer)
    expected = [tokenizer.decode([t]) for t in ids[:10]]
    logprobs = [_logprob(k) for k in range(10)]
    instance = OneEventInstance("a", ids)
    async with serve(tokenizer, {"a": instance}) as client:
        resp = await client.post("/v1/chat/completions", json=chat_body(
            stop=["is a"], logprobs=True))
        assert resp.status == 200, await resp.text()
        choice = (await resp.json())["choices"][0]
        assert choice["message"]["content"] == "Hello world, this "
        assert [c["token"] for c in choice["logprobs"]["content"]] == expected
        assert [c["logprob"] for c in choice["logprobs"]["content"]] == logprobs
        assert (await resp.json())["usage"]["completion_tokens"] == 10

        resp = await client.post("/v1/chat/completions", json=chat_body(
            stop=["is a"], logprobs=True, stream=True))
        chunks = [c for c in (await sse(resp))[:-1] if c["choices"]]
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "Hello world, this "
        content = [t for c in chunks if c["choices"][0].get("logprobs")
                   for t in c["choices"][0]["logprobs"]["content"]]
        assert [c["token"] for c in content] == expected
        assert [c["logprob"] for c in content] == logprobs

        body = {"model": "tiny", "prompt": "Hi", "stop": ["is a"], "logprobs": 0}
        resp = await client.post("/v1/completions", json=body)
        assert resp.status == 200, await resp.text()
        choice = (await resp.json())["choices"][0]
        assert choice["text"] == "Hello world, this "
        assert choice["logprobs"]["tokens"] == expected
        assert choice["logprobs"]["token_logprobs"] == logprobs

        resp = await client.post("/v1/completions", json={**body, "stream": True})
        chunks = [c for c in (await sse(resp))[:-1] if c["choices"]]
        assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello world, this "
        lps = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
        assert [t for lp in lps for t in lp["tokens"]] == expected
        assert [v for lp in lps for v in lp["token_logprobs"]] == logprobs
