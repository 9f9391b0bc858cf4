"""Errors aiohttp raises on the Messages API's paths keep what the OpenAI paths keep: a 405
names the methods allowed (``Allow``, which RFC 9110 requires of a 405), and a client error
that Anthropic's table does not list is a request error, not ``api_error`` (Anthropic's type
for its own internal failures, which SDKs and agents treat as retryable)."""

from __future__ import annotations

from api_helpers import scripted, serve

from router.tokenization import ModelTokenizer


async def test_a_get_on_the_messages_api_is_a_405_naming_post(tiny_tokenizer: ModelTokenizer) -> None:
    async with serve(tiny_tokenizer, {"i0": scripted(tiny_tokenizer, "ok")}) as client:
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            resp = await client.get(path)
            assert resp.status == 405
            assert resp.headers.get("Allow") == "POST"
            assert await resp.json() == {"type": "error", "error": {
                "type": "invalid_request_error", "message": "Method Not Allowed"}}
        # The OpenAI paths, as before.
        resp = await client.get("/v1/chat/completions")
        assert resp.status == 405 and resp.headers.get("Allow") == "POST"


async def test_an_unknown_messages_path_is_still_not_found(tiny_tokenizer: ModelTokenizer) -> None:
    async with serve(tiny_tokenizer, {"i0": scripted(tiny_tokenizer, "ok")}) as client:
        resp = await client.get("/v1/messages/batches")
        assert resp.status == 404
        assert (await resp.json())["error"]["type"] == "not_found_error"
