"""A prompt refused by its byte bound, before it is tokenized, is over the context as surely
as one refused once tokenized: each API's clients must read it as a context overflow
(``context_length_exceeded`` on the OpenAI APIs, ``prompt is too long`` on Anthropic's), or
an agent whose history crossed the bound (one large tool result) never compacts and its
session ends on a generic 400."""

from __future__ import annotations

from typing import Any

import pytest
from api_helpers import scripted, serve

from router.app import CORE_KEY
from router.tokenization import ModelTokenizer


def _over_the_bound(tok: ModelTokenizer) -> str:
    return "x" * (tok.context_len * 32 + 1)


@pytest.mark.parametrize(("path", "param"), [
    ("/v1/chat/completions", "messages"), ("/v1/completions", "prompt"), ("/v1/responses", "input"),
])
async def test_an_openai_prompt_over_the_byte_bound_is_context_length_exceeded(
    tiny_tokenizer: ModelTokenizer, path: str, param: str,
) -> None:
    text = _over_the_bound(tiny_tokenizer)
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": text}]}
    if path == "/v1/completions":
        body = {"model": "tiny", "max_tokens": 4, "prompt": text}
    elif path == "/v1/responses":
        body = {"model": "tiny", "input": text}
    instance = scripted(tiny_tokenizer, "x")
    async with serve(tiny_tokenizer, {"i0": instance}, max_body_bytes=8 << 20) as client:
        resp = await client.post(path, json=body)
        error = (await resp.json())["error"]
        core = client.server.app[CORE_KEY]
    assert resp.status == 400 and not instance.calls
    assert error["code"] == "context_length_exceeded" and error["param"] == param, error
    assert "bytes long" in error["message"], error
    assert core.metrics.rejected.get(model="tiny", reason="prompt_bytes") == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_an_anthropic_prompt_over_the_byte_bound_says_prompt_is_too_long(
    tiny_tokenizer: ModelTokenizer, stream: bool,
) -> None:
    """Claude Code compacts on ``prompt is too long: N tokens > M maximum``; N is the least
    count the bound allows (no token is longer than its bytes per token); why follows."""
    text = _over_the_bound(tiny_tokenizer)
    body = {"model": "tiny", "max_tokens": 4, "stream": stream, "messages": [{"role": "user", "content": text}]}
    async with serve(tiny_tokenizer, {"i0": scripted(tiny_tokenizer, "x")}, max_body_bytes=8 << 20) as client:
        resp = await client.post("/v1/messages", json=body)
        data = await resp.json()
    least = -(-len(text) // 32)
    assert resp.status == 400 and data["type"] == "error"
    assert data["error"]["type"] == "invalid_request_error"
    message = data["error"]["message"]
    assert message.startswith(f"prompt is too long: {least} tokens > {tiny_tokenizer.context_len - 1} maximum; ")
    assert "bytes long" in message
