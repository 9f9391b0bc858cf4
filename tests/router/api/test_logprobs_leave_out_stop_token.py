"""Logprobs list the answer's tokens, never the end-of-turn token (``<|im_end|>``) that ended
it, as OpenAI's never do: in chat and in legacy completions, collected and streamed. The
instance sends that token as the answer's last (its id counts in the usage); it was listed
as the last logprob. A token of the text that ends an answer stays listed."""

from __future__ import annotations

from typing import Any

import pytest
from api_helpers import EOS, REPLY_TEXT, chat_body, reply, serve, sse
from router_fakes import FakeInstance

from router.tokenization import ModelTokenizer


def _chat_tokens(data: dict[str, Any], stream: bool) -> list[str]:
    if not stream:
        return [t["token"] for t in data["choices"][0]["logprobs"]["content"]]
    return [t["token"] for c in data if c != "[DONE]" and c["choices"] and c["choices"][0].get("logprobs")
            for t in c["choices"][0]["logprobs"]["content"]]


def _completion_tokens(data: Any, stream: bool) -> tuple[list[str], list[int]]:
    chunks = [c for c in data if c != "[DONE]" and c["choices"]] if stream else [data]
    lps = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    return [t for lp in lps for t in lp["tokens"]], [o for lp in lps for o in lp["text_offset"]]


async def _answers(client: Any, stream: bool) -> tuple[list[str], list[str], list[int], dict[str, Any]]:
    resp = await client.post("/v1/chat/completions", json=chat_body(
        logprobs=True, stream=stream, max_tokens=50, stream_options={"include_usage": True} if stream else None))
    data = await sse(resp) if stream else await resp.json()
    chat = _chat_tokens(data, stream)
    usage = (data[-2] if stream else data)["usage"]
    resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "logprobs": 0,
                                                      "max_tokens": 50, "stream": stream})
    tokens, offsets = _completion_tokens(await sse(resp) if stream else await resp.json(), stream)
    return chat, tokens, offsets, usage


@pytest.mark.parametrize("stream", [False, True])
async def test_the_token_that_ended_the_answer_is_not_listed(tokenizer: ModelTokenizer, stream: bool) -> None:
    answer = reply(tokenizer)
    async with serve(tokenizer, {"a": FakeInstance("a", answer + [EOS])}) as client:
        chat, tokens, offsets, usage = await _answers(client, stream)
    assert "".join(chat) == REPLY_TEXT
    assert len(chat) == len(answer)
    assert "".join(tokens) == REPLY_TEXT
    assert len(offsets) == len(answer)
    assert usage["completion_tokens"] == len(answer) + 1  # the instance's count, EOS included


@pytest.mark.parametrize("stream", [False, True])
async def test_a_text_token_that_ends_the_answer_stays_listed(tokenizer: ModelTokenizer, stream: bool) -> None:
    answer = reply(tokenizer)  # no EOS: the answer ends on its last text token
    async with serve(tokenizer, {"a": FakeInstance("a", answer)}) as client:
        chat, tokens, _offsets, _usage = await _answers(client, stream)
    assert "".join(chat) == "".join(tokens) == REPLY_TEXT
    assert len(chat) == len(tokens) == len(answer)
