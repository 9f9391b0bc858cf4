"""API gaps a review found (2026-12-06): the text-completions endpoint's default output limit
is OpenAI's 16 tokens, not the room the context leaves; Anthropic's ``mcp_servers`` is refused
naming it, not ignored; the stop string an answer matched is the one its text matched, even
where a SentencePiece decode of the answer alone loses its leading space."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from api_helpers import scripted, serve
from router_fakes import sentencepiece_tokenizer, write_tiny_tokenizer

from router.api.output_budget import CLAMP_HEADER
from router.api.stream_output import OutputAssembler
from router.tokenization import ModelTokenizer
from talaria.protocol import CallEvent

USER = [{"role": "user", "content": "hi"}]
LONG_ANSWER = " ".join(["word"] * 40)  # well over 16 tokens


@pytest.mark.parametrize("absent", [{}, {"max_tokens": None}], ids=["absent", "null"])
async def test_text_completions_without_max_tokens_write_at_most_16_tokens(
    tiny_tokenizer: ModelTokenizer, absent: dict[str, Any],
) -> None:
    """OpenAI's legacy completions default (vLLM's ``CompletionRequest`` has it too): the
    answer ends at 16 tokens with ``length``, and no clamp is named (the client asked none).
    Chat, unchanged, may still write to the context's end."""
    instance = scripted(tiny_tokenizer, LONG_ANSWER, LONG_ANSWER)
    async with serve(tiny_tokenizer, {"i0": instance}) as client:
        resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", **absent})
        data = await resp.json()
        chat = await client.post("/v1/chat/completions", json={"model": "tiny", "messages": USER})
        assert chat.status == 200
    assert resp.status == 200, data
    assert instance.calls[0].params.max_tokens == 16
    assert data["choices"][0]["finish_reason"] == "length" and data["usage"]["completion_tokens"] == 16
    assert CLAMP_HEADER not in resp.headers
    chat_call = instance.calls[1]
    assert chat_call.params.max_tokens == tiny_tokenizer.context_len - len(chat_call.prompt_token_ids)


@pytest.mark.parametrize("rule", ["clamp", "refuse"])
async def test_the_default_16_is_cut_to_a_smaller_room_silently(tmp_path: Path, rule: str) -> None:
    """A room under 16 tokens is the limit, under either overflow rule: no 400 naming a
    ``max_tokens`` the client never sent, no clamp header."""
    small = ModelTokenizer.load("tiny", write_tiny_tokenizer(tmp_path, context_len=24))
    instance = scripted(small, LONG_ANSWER)
    async with serve(small, {"i0": instance}, max_tokens_overflow=rule) as client:
        resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": [7] * 20})
        data = await resp.json()
    assert resp.status == 200, data
    assert instance.calls[0].params.max_tokens == 4
    assert data["choices"][0]["finish_reason"] == "length"
    assert CLAMP_HEADER not in resp.headers


MCP_SERVER = {"type": "url", "url": "https://mcp.example.com/sse", "name": "example"}


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
@pytest.mark.parametrize("servers", [[MCP_SERVER], {"name": "x"}], ids=["servers", "not-a-list"])
async def test_anthropic_mcp_servers_is_refused_naming_it(
    tiny_tokenizer: ModelTokenizer, path: str, servers: Any,
) -> None:
    """The router connects to no MCP server: a client that sent one would wait for tools
    that never come (and a count would leave their definitions out), so a 400 says so."""
    instance = scripted(tiny_tokenizer, "ok")
    body = {"model": "tiny", "max_tokens": 10, "messages": USER, "mcp_servers": servers}
    async with serve(tiny_tokenizer, {"i0": instance}) as client:
        resp = await client.post(path, json=body)
        error = await resp.json()
    assert resp.status == 400 and not instance.calls
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert "mcp_servers" in error["error"]["message"]


@pytest.mark.parametrize("servers", [[], None], ids=["empty", "null"])
async def test_no_mcp_server_is_no_option(tiny_tokenizer: ModelTokenizer, servers: Any) -> None:
    async with serve(tiny_tokenizer, {"i0": scripted(tiny_tokenizer, "ok")}) as client:
        resp = await client.post("/v1/messages", json={"model": "tiny", "max_tokens": 10, "messages": USER,
                                                       "mcp_servers": servers})
        assert resp.status == 200, await resp.text()


@pytest.mark.parametrize("per_token", [False, True], ids=["one-event", "per-token"])
@pytest.mark.parametrize(("stops", "matched"), [
    ([" ol"], " ol"), (["é", " ol"], " ol"), ([" ol", " o"], " ol"), ([" o", " ol"], " o"),
])
def test_a_stop_string_with_a_leading_space_at_the_answers_start_is_the_matched_stop(
    per_token: bool, stops: list[str], matched: str,
) -> None:
    """The answer `` olé`` after ``café``: its first piece ``▁ol`` is `` ol`` in the text the
    stream cut (decoded after the prompt's tail), but ``ol`` in a decode of the answer alone,
    which found no stop string there and so read as Anthropic's ``end_turn``. The stop is the
    one the cut text matched: the earliest, the first listed where two start there."""
    tok = sentencepiece_tokenizer()
    prompt = tok.encode_text("café", add_special_tokens=False)
    answer = tok.encode_text("café olé", add_special_tokens=False)[len(prompt):]
    assert tok.tokenizer.convert_ids_to_tokens(answer) == ["▁ol", "é"]
    assert not tok.decode(answer).startswith(" ")  # the loss this is about
    out = OutputAssembler(tok, prompt, stops, want_logprobs=False)
    batches = [[t] for t in answer] if per_token else [answer]
    for k, ids in enumerate(batches):
        out.add(CallEvent("c", token_ids=ids, finished=k == len(batches) - 1, finish_reason="stop"))
    assert out.stopped_at_string and out.text == ""
    assert out.matched_stop == matched
