"""Opt-in CORS (``router.cors``): with origins allowed, a browser's preflight is a 204 allowing
the route's methods and the headers the APIs read, before the API key is checked, and every
answer to an allowed origin (collected, streamed, an error, a 401) carries
``Access-Control-Allow-Origin``. Every ``OPTIONS`` was a 405. Without origins, or from
another origin, the router answers as it always did."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from api_helpers import chat_body, reply, serve, sse
from router_fakes import FakeInstance

from router.app import RouterConfig
from router.cors import CorsConfig
from router.tokenization import ModelTokenizer
from talaria.cli import _router_app
from talaria.serving.config import ConfigError, ModelEntry, ServeConfig

SITE = "http://localhost:5173"
KEY = "sk-test-cors-key"
PREFLIGHT = {"Origin": SITE, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"}
ALLOW = "Access-Control-Allow-Origin"


def _listed(value: str) -> set[str]:
    return {v.strip().lower() for v in value.split(",")}


async def _calls(client: TestClient, origin: str, key: str = KEY) -> dict[str, Any]:
    """Each kind of answer to a call from ``origin``: its status and its allowance."""
    auth = {"Origin": origin, "Authorization": f"Bearer {key}"}
    out: dict[str, Any] = {}
    resp = await client.post("/v1/chat/completions", json=chat_body(), headers=auth)
    out["chat"] = (resp.status, resp.headers.get(ALLOW), resp.headers.get("Vary"))
    resp = await client.post("/v1/chat/completions", json=chat_body(stream=True), headers=auth)
    await sse(resp)
    out["stream"] = (resp.status, resp.headers.get(ALLOW))
    resp = await client.post("/v1/chat/completions", json=chat_body(model="nope"), headers=auth)
    out["error"] = (resp.status, resp.headers.get(ALLOW))
    resp = await client.post("/v1/messages", json={"model": "tiny", "messages": []}, headers=auth)
    out["anthropic_error"] = (resp.status, resp.headers.get(ALLOW))
    resp = await client.post("/v1/chat/completions", json=chat_body(), headers={"Origin": origin})
    out["no_key"] = (resp.status, resp.headers.get(ALLOW))
    return out


async def test_an_allowed_origin_gets_its_preflight_and_every_answer_allowed(tokenizer: ModelTokenizer) -> None:
    instance = FakeInstance("a", reply(tokenizer))
    async with serve(tokenizer, {"a": instance}, api_key=KEY, cors=CorsConfig((SITE,))) as client:
        pre = await client.options("/v1/chat/completions", headers=PREFLIGHT)  # no key, as browsers send it
        pre_models = await client.options("/v1/models", headers={**PREFLIGHT, "Access-Control-Request-Method": "GET"})
        pre_other = await client.options("/v1/chat/completions", headers={**PREFLIGHT, "Origin": "http://evil.test"})
        pre_nowhere = await client.options("/nowhere", headers=PREFLIGHT)
        allowed = await _calls(client, SITE)
        other = await _calls(client, "http://evil.test")
    assert pre.status == 204
    assert pre.headers[ALLOW] == SITE
    assert "post" in _listed(pre.headers["Access-Control-Allow-Methods"])
    headers = _listed(pre.headers["Access-Control-Allow-Headers"])
    assert {"authorization", "content-type", "x-stainless-os",  # the ones asked for
            "x-api-key", "anthropic-version", "x-session-id"} <= headers
    assert pre_models.status == 204 and "get" in _listed(pre_models.headers["Access-Control-Allow-Methods"])
    assert pre_other.status == 401 and ALLOW not in pre_other.headers  # as without CORS: no key
    assert pre_nowhere.status == 404
    assert allowed == {"chat": (200, SITE, "Origin"), "stream": (200, SITE), "error": (404, SITE),
                       "anthropic_error": (400, SITE), "no_key": (401, SITE)}
    assert other == {"chat": (200, None, "Origin"), "stream": (200, None), "error": (404, None),
                     "anthropic_error": (400, None), "no_key": (401, None)}


async def test_any_origin(tokenizer: ModelTokenizer) -> None:
    async with serve(tokenizer, {"a": FakeInstance("a", reply(tokenizer))}, cors=CorsConfig(("*",))) as client:
        pre = await client.options("/v1/messages", headers={**PREFLIGHT, "Origin": "https://app.example"})
        resp = await client.post("/v1/chat/completions", json=chat_body(), headers={"Origin": "https://app.example"})
    assert pre.status == 204 and pre.headers[ALLOW] == "*"
    assert resp.status == 200 and resp.headers[ALLOW] == "*"
    assert "Origin" not in resp.headers.get("Vary", "")


async def test_without_origins_the_router_answers_as_before(tokenizer: ModelTokenizer) -> None:
    async with serve(tokenizer, {"a": FakeInstance("a", reply(tokenizer))}) as client:
        pre = await client.options("/v1/chat/completions", headers=PREFLIGHT)
        resp = await client.post("/v1/chat/completions", json=chat_body(), headers={"Origin": SITE})
    assert pre.status == 405 and ALLOW not in pre.headers
    assert resp.status == 200 and ALLOW not in resp.headers and "Vary" not in resp.headers


@pytest.mark.parametrize("origin", ["http://localhost:5173/", "localhost:5173", "http://a.test/app", ""])
def test_an_origin_no_browser_sends_is_refused(origin: str) -> None:
    with pytest.raises(ValueError, match="no origin a browser sends"):
        RouterConfig(models={"tiny": "/unused"}, instances={}, cors=CorsConfig((origin,)))
    with pytest.raises(ConfigError, match=r"\[router\]\.cors_origins"):
        ServeConfig.from_dict({"router": {"cors_origins": [origin]}})
    with pytest.raises(ConfigError, match=r"\[router\]\.cors_origins must be a list"):
        ServeConfig.from_dict({"router": {"cors_origins": origin}})


async def test_the_serve_configs_origins_reach_the_router(model_dir: Path) -> None:
    config = ServeConfig.from_dict({"router": {"cors_origins": [SITE], "poll_interval_s": 60.0}})
    config.models = {"tiny": ModelEntry(str(model_dir))}
    app = _router_app(config, {"i0": "http://127.0.0.1:9"})
    async with TestClient(TestServer(app)) as client:
        pre = await client.options("/v1/chat/completions", headers=PREFLIGHT)
    assert pre.status == 204 and pre.headers[ALLOW] == SITE
