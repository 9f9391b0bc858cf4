"""Review 81: fba2c46 makes a fixed-path route answer with any of its slashes doubled,
trailing ones included (``//v1//messages/`` is ``/v1/messages``). ``GET /v1/models//`` is
not the listing: the model route ``/v1/models/{model_id:.+}`` shares the listing's index key
in aiohttp's dispatcher, so it is tried before the merged copy (indexed under ``/``) and
answers 404 for a model named ''. ``//v1/models/`` and ``/v1//models//`` are the listing."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from api_helpers import scripted, serve

from router.tokenization import ModelTokenizer


async def _get(client: TestClient, path: str) -> tuple[int, Any]:
    url = str(client.make_url("/")).rstrip("/") + path
    async with client.session.get(url) as resp:
        return resp.status, await resp.json()


@pytest.mark.parametrize("path", ["//v1/models/", "/v1//models//", "/v1/models//"])
async def test_the_listing_with_doubled_trailing_slashes(tiny_tokenizer: ModelTokenizer, path: str) -> None:
    async with serve(tiny_tokenizer, {"i0": scripted(tiny_tokenizer, "Hello.")}) as client:
        status, body = await _get(client, path)
        assert status == 200, body
        assert body["object"] == "list"
