"""``top_p: 0`` is taken, as OpenAI's and Anthropic's APIs take it (their range is [0, 1]),
and samples greedily: a nucleus of probability 0 holds the likeliest token alone. It was a
400 (``top_p must be in (0, 1]``), the engine's range, though clients send it beside
``temperature: 0`` to ask for determinism. The Responses API echoes the value sent."""

from __future__ import annotations

from typing import Any

import pytest
from api_helpers import scripted, serve

from router.tokenization import ModelTokenizer

USER = [{"role": "user", "content": "Hi"}]
BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {"messages": USER, "max_tokens": 4}),
    "messages": ("/v1/messages", {"messages": USER, "max_tokens": 4}),
    "responses": ("/v1/responses", {"input": "Hi", "max_output_tokens": 4}),
}


@pytest.mark.parametrize("api", sorted(BODIES))
@pytest.mark.parametrize("temperature", [None, 0.7])
async def test_top_p_zero_samples_greedily(
        tiny_tokenizer: ModelTokenizer, api: str, temperature: float | None) -> None:
    instance = scripted(tiny_tokenizer, "Hello.")
    path, body = BODIES[api]
    sampling = {"top_p": 0, **({"temperature": temperature} if temperature is not None else {})}
    async with serve(tiny_tokenizer, {"i0": instance}) as client:
        resp = await client.post(path, json={"model": "tiny", **body, **sampling})
        assert resp.status == 200, await resp.text()
        data = await resp.json()
    params = instance.calls[0].params
    assert params.temperature == 0.0 and params.top_p == 1.0
    if api == "responses":
        assert data["top_p"] == 0.0 and data["temperature"] == (1.0 if temperature is None else temperature)
