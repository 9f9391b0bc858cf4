"""An assistant turn in a chat history may hold what OpenAI documents for it: content parts
of type ``text`` or ``refusal``, or no content beside a ``refusal`` string (an answer the
model refused, replayed from OpenAI's API). The turn's text is the refusal, as the Responses
API reads a ``refusal`` part; never a 400 that fails the conversation for good."""

from __future__ import annotations

from typing import Any

import pytest
from api_helpers import scripted, serve

from router.tokenization import ModelTokenizer

REFUSED = "I can't help with that."
TURNS: list[dict[str, Any]] = [
    {"role": "assistant", "content": [{"type": "refusal", "refusal": REFUSED}]},
    {"role": "assistant", "content": None, "refusal": REFUSED},
    {"role": "assistant", "content": [{"type": "text", "text": "I can't"},
                                      {"type": "refusal", "refusal": " help with that."}]},
]


@pytest.mark.parametrize("turn", TURNS)
async def test_a_refused_assistant_turn_is_its_text(tiny_tokenizer: ModelTokenizer, turn: dict[str, Any]) -> None:
    instance = scripted(tiny_tokenizer, "ok")
    messages = [{"role": "user", "content": "hi"}, turn, {"role": "user", "content": "again"}]
    async with serve(tiny_tokenizer, {"i0": instance}) as client:
        resp = await client.post("/v1/chat/completions", json={"model": "tiny", "messages": messages})
        assert resp.status == 200, await resp.text()
    prompt = tiny_tokenizer.tokenizer.decode(instance.calls[0].prompt_token_ids)
    assert f"<|im_start|>assistant\n{REFUSED}<|im_end|>" in prompt


@pytest.mark.parametrize("turn", [
    {"role": "assistant", "content": [{"type": "refusal", "refusal": 3}]},
    {"role": "user", "content": [{"type": "refusal", "refusal": REFUSED}]},
    {"role": "assistant", "content": None, "refusal": 3},
    {"role": "assistant", "content": None},
])
async def test_a_malformed_or_misplaced_refusal_is_still_a_400(
    tiny_tokenizer: ModelTokenizer, turn: dict[str, Any],
) -> None:
    messages = [{"role": "user", "content": "hi"}, turn, {"role": "user", "content": "again"}]
    async with serve(tiny_tokenizer, {"i0": scripted(tiny_tokenizer, "ok")}) as client:
        resp = await client.post("/v1/chat/completions", json={"model": "tiny", "messages": messages})
        assert resp.status == 400, await resp.text()
        assert (await resp.json())["error"]["param"] == "messages[1].content"
