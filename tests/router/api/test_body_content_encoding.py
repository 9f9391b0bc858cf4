"""A request body that does not decode as its ``Content-Encoding`` says (``gzip`` over plain
JSON, say) is the client's error: a 400 in the API's shape, not a 500 with an
``unhandled_error`` traceback, as it was (found driving `talaria serve` by hand), and the
connection closes after it. A body that does decode is read as before."""

from __future__ import annotations

import gzip
import logging
from typing import Any

import orjson
import pytest
from api_helpers import chat_body, reply, serve
from router_fakes import FakeInstance
from structlog.testing import capture_logs

from router.tokenization import ModelTokenizer


def _errors(logs: list[dict[str, Any]], caplog: pytest.LogCaptureFixture) -> list[Any]:
    return ([e for e in logs if e["log_level"] in ("error", "critical")]
            + [r for r in caplog.records if r.levelno >= logging.ERROR])


@pytest.mark.parametrize(("path", "encoding"), [
    ("/v1/chat/completions", "gzip"), ("/v1/messages", "deflate"), ("/v1/responses", "gzip"),
])
async def test_a_body_its_content_encoding_cannot_decode_is_a_400(
    tokenizer: ModelTokenizer, caplog: pytest.LogCaptureFixture, path: str, encoding: str,
) -> None:
    a = FakeInstance("a", reply(tokenizer))
    async with serve(tokenizer, {"a": a}) as client:
        with capture_logs() as logs:
            resp = await client.post(path, data=orjson.dumps(chat_body(max_tokens=4)), headers={
                "Content-Type": "application/json", "Content-Encoding": encoding})
            body = await resp.json()
        assert resp.status == 400, body
        assert body["error"]["type"] == "invalid_request_error", body
        if path != "/v1/messages":  # Anthropic's shape has no code
            assert body["error"]["code"] == "bad_request_body", body
        assert f"content-encoding: {encoding}" in body["error"]["message"].lower(), body
        # aiohttp's parser stopped inside the body: the connection is not reused
        assert resp.headers.get("Connection", "").lower() == "close"
        assert _errors(logs, caplog) == []
        assert a.calls == []
        assert (await client.get("/live")).status == 200


async def test_a_gzip_body_that_decodes_is_answered(tokenizer: ModelTokenizer) -> None:
    a = FakeInstance("a", reply(tokenizer))
    async with serve(tokenizer, {"a": a}) as client:
        resp = await client.post("/v1/chat/completions", data=gzip.compress(orjson.dumps(
            chat_body(max_tokens=4))), headers={"Content-Type": "application/json",
                                                "Content-Encoding": "gzip"})
        assert resp.status == 200, await resp.text()
