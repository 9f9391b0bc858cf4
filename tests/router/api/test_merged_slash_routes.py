"""A route asked for with its slashes doubled anywhere (a base URL ending in ``/`` joined to
``/v1/messages``, or ``/v1/`` to ``/chat/completions``) is the route itself, served in place;
it was a 404. The key is checked on what the path names, so doubling a slash never skips
it, and the Messages API's errors keep Anthropic's shape."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient
from api_helpers import chat_body, scripted, serve
from test_trailing_slash_routes import MESSAGES

from router.route_slashes import add_merged_slash_routes, merged_path
from router.tokenization import ModelTokenizer

KEY = {"Authorization": "Bearer sk-test"}


async def _ask(client: TestClient, method: str, path: str, body: Any = None,
               headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """``path`` sent as written (a test client would read ``//v1`` as a host)."""
    url = str(client.make_url("/")).rstrip("/") + path
    async with client.session.request(method, url, json=body, headers=headers) as resp:
        json = resp.content_type == "application/json"
        return resp.status, await resp.json() if json else await resp.text()


@pytest.mark.parametrize(("method", "path", "body"), [
    ("POST", "/v1//chat/completions", chat_body(max_tokens=4)),
    ("POST", "//v1/chat/completions", chat_body(max_tokens=4)),
    ("POST", "//v1/completions//", {"model": "tiny", "prompt": "Hi", "max_tokens": 4}),
    ("POST", "//v1/messages", MESSAGES),
    ("POST", "/v1//messages//count_tokens", MESSAGES),
    ("POST", "///v1//responses", {"model": "tiny", "input": "Hi", "max_output_tokens": 4}),
    ("GET", "//v1/models", None),
    ("GET", "//health", None),
])
async def test_a_route_with_doubled_slashes_is_the_route(
        tiny_tokenizer: ModelTokenizer, method: str, path: str, body: Any) -> None:
    async with serve(tiny_tokenizer, {"i0": scripted(tiny_tokenizer, "Hello.")}) as client:
        status, answer = await _ask(client, method, path, body)
        assert status == 200, answer


async def test_the_key_and_the_error_shape_hold_with_doubled_slashes(tiny_tokenizer: ModelTokenizer) -> None:
    async with serve(tiny_tokenizer, {"i0": scripted(tiny_tokenizer, "Hello.")}, api_key="sk-test") as client:
        for method, path, body in (("POST", "//v1/chat/completions", chat_body(max_tokens=4)),
                                   ("POST", "/v1//messages", MESSAGES), ("GET", "//metrics", None),
                                   ("GET", "//v1//models", None)):
            assert (await _ask(client, method, path, body))[0] == 401, path
            assert (await _ask(client, method, path, body, KEY))[0] == 200, path
        assert (await _ask(client, "GET", "//health"))[0] == 200  # a probe needs no key
        status, error = await _ask(client, "POST", "//v1/messages", {**MESSAGES, "model": "nope"}, KEY)
        assert status == 404 and error["error"]["type"] == "not_found_error"


def test_only_fixed_paths_get_the_copies() -> None:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", _ok)
    app.router.add_get("/", _ok)
    app.router.add_get("/v1/models/{model_id:.+}", _ok)
    add_merged_slash_routes(app.router)
    added = [r.resource.canonical for r in app.router.routes()
             if r.resource is not None and "_slash" in r.resource.canonical]
    assert added == ["/{_slash0}v1{_slash1}chat{_slash2}completions{_slash3}"]


def test_merged_path() -> None:
    assert merged_path("///v1//messages/") == "/v1/messages/"
    assert merged_path("/health") == "/health"


async def _ok(_request: web.Request) -> web.Response:
    return web.Response()
