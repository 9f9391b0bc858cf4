"""``GET /v1/models`` pages the list as Anthropic's List Models does when the Anthropic SDK
asks (``limit``, default 20, ``after_id``, ``before_id``; ``first_id``, ``last_id`` and
``has_more`` describe the page), and lists every model for the OpenAI SDK, whose list has
no pages. Every model came back to both, ``has_more`` false, whatever the query asked."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anthropic
import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer
from api_helpers import reply
from router_fakes import FakeInstance

from router.app import RouterConfig, create_app
from router.tokenization import ModelTokenizer

NAMES = [f"m{k:02d}" for k in range(25)]  # listed in this order (by name)
ANTHROPIC = {"anthropic-version": "2023-06-01"}


@asynccontextmanager
async def catalog(tokenizer: ModelTokenizer) -> AsyncIterator[TestClient]:
    config = RouterConfig(models={n: "/unused" for n in NAMES}, instances={"a": ""}, poll_interval_s=None)
    app = create_app(config, {"a": FakeInstance("a", reply(tokenizer))},
                     tokenizers={n: tokenizer for n in NAMES})
    async with TestClient(TestServer(app)) as client:
        yield client


async def test_the_anthropic_sdk_gets_pages_and_walks_them(tokenizer: ModelTokenizer) -> None:
    async with catalog(tokenizer) as client:
        root = str(client.make_url("/"))
        ant = anthropic.AsyncAnthropic(base_url=root, api_key="unused", max_retries=0)
        first = await ant.models.list()  # Anthropic's default limit, 20
        page = await ant.models.list(limit=3, after_id="m05")
        before = await ant.models.list(limit=3, before_id="m05")
        start = await ant.models.list(limit=3, before_id="m02")
        last = await ant.models.list(limit=10, after_id="m19")
        walked = [m.id async for m in ant.models.list(limit=7)]  # the SDK follows last_id
        walked_back = [m.id async for m in ant.models.list(limit=4, before_id="m10")]
        await ant.close()
    assert [m.id for m in first.data] == NAMES[:20]
    assert (first.first_id, first.last_id, first.has_more) == ("m00", "m19", True)
    assert [m.id for m in page.data] == ["m06", "m07", "m08"]
    assert (page.first_id, page.last_id, page.has_more) == ("m06", "m08", True)
    assert [m.id for m in before.data] == ["m02", "m03", "m04"]  # the page just before m05
    assert (before.first_id, before.last_id, before.has_more) == ("m02", "m04", True)
    assert [m.id for m in start.data] == ["m00", "m01"]
    assert start.has_more is False  # nothing more before it
    assert [m.id for m in last.data] == NAMES[20:]
    assert (last.first_id, last.last_id, last.has_more) == ("m20", "m24", False)
    assert walked == NAMES
    assert sorted(walked_back) == NAMES[:10]


async def test_the_openai_sdk_gets_every_model(tokenizer: ModelTokenizer) -> None:
    async with catalog(tokenizer) as client:
        oai = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused", max_retries=0)
        listed = [m.id async for m in oai.models.list()]
        await oai.close()
        raw = await (await client.get("/v1/models", params={"limit": "2"})).json()
    assert listed == NAMES
    assert [m["id"] for m in raw["data"]] == NAMES  # OpenAI's list has no pages
    assert raw["has_more"] is False


@pytest.mark.parametrize(("query", "field"), [
    ({"limit": "0"}, "limit"), ({"limit": "1001"}, "limit"), ({"limit": "two"}, "limit"),
    ({"after_id": "nope"}, "after_id"), ({"before_id": "nope"}, "before_id"),
    ({"after_id": "m01", "before_id": "m05"}, "before_id"),
])
async def test_a_bad_page_is_a_400_naming_the_field(
    tokenizer: ModelTokenizer, query: dict[str, str], field: str,
) -> None:
    async with catalog(tokenizer) as client:
        resp = await client.get("/v1/models", params=query, headers=ANTHROPIC)
        body = await resp.json()
        fine = await client.get("/v1/models", params={"limit": "1000"}, headers=ANTHROPIC)
        listed = await fine.json()
    assert resp.status == 400
    assert body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert field in body["error"]["message"]
    assert fine.status == 200
    assert len(listed["data"]) == len(NAMES)
