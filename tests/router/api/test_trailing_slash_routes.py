"""A route asked for with one trailing slash is the route itself, served in place: a client
that joins ``/chat/completions/`` onto its base URL got a 404 (vLLM's and SGLang's servers
redirect it). The key is still checked there, ``/metrics/`` included, and the Messages API's
errors keep Anthropic's shape."""

from __future__ import annotations

import pytest
from aiohttp import web
from api_helpers import chat_body, scripted, serve

from router.route_slashes import add_trailing_slash_routes
from router.tokenization import ModelTokenizer

MESSAGES = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}


@pytest.mark.parametrize(("method", "path", "body"), [
    ("POST", "/v1/chat/completions/", chat_body(max_tokens=4)),
    ("POST", "/v1/completions/", {"model": "tiny", "prompt": "Hi", "max_tokens": 4}),
    ("POST", "/v1/messages/", MESSAGES),
    ("POST", "/v1/messages/count_tokens/", MESSAGES),
    ("POST", "/v1/responses/", {"model": "tiny", "input": "Hi", "max_output_tokens": 4}),
    ("GET", "/v1/models/", None),
    ("GET", "/v1/models/tiny/", None),
    ("GET", "/health/", None),
    ("HEAD", "/v1/models/", None),
])
async def test_a_route_with_a_trailing_slash_is_the_route(
        tiny_tokenizer: ModelTokenizer, method: str, path: str, body: dict | None) -> None:
    async with serve(tiny_tokenizer, {"i0": scripted(tiny_tokenizer, "Hello.")}) as client:
        resp = await client.request(method, path, json=body)
        assert resp.status == 200, await resp.text()


async def test_the_key_and_the_error_shape_hold_with_the_slash(tiny_tokenizer: ModelTokenizer) -> None:
    async with serve(tiny_tokenizer, {"i0": scripted(tiny_tokenizer, "Hello.")}, api_key="sk-test") as client:
        for path in ("/metrics/", "/v1/models/"):
            assert (await client.get(path)).status == 401
        resp = await client.get("/metrics/", headers={"Authorization": "Bearer sk-test"})
        assert resp.status == 200
        resp = await client.post("/v1/messages/", json={**MESSAGES, "model": "nope"}, headers={"x-api-key": "sk-test"})
        assert resp.status == 404 and (await resp.json())["error"]["type"] == "not_found_error"
        assert (await client.post("/v1/chat//completions", json=chat_body())).status in (401, 404)


def test_no_copy_is_added_for_a_route_that_takes_the_slash_itself() -> None:
    """``/v1/models/{model_id:.+}`` matches ``/v1/models/tiny/`` already (the model list
    strips the slash); a copy at ``{model_id}/`` would never be matched."""
    app = web.Application()
    app.router.add_get("/v1/models/{model_id:.+}", _ok)
    app.router.add_get("/v1/models/{model_id}/meta", _ok)
    add_trailing_slash_routes(app.router)
    paths = sorted({r.resource.canonical for r in app.router.routes() if r.resource is not None})
    assert paths == ["/v1/models/{model_id}", "/v1/models/{model_id}/meta", "/v1/models/{model_id}/meta/"]


async def _ok(_request: web.Request) -> web.Response:
    return web.Response()
