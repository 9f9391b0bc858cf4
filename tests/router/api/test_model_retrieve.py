"""``GET /v1/models/{id}``: both official SDKs' ``models.retrieve`` ask it (an agent checking
that its configured model is served); it was a 404 for every model, served or not."""

from __future__ import annotations

import anthropic
import openai
import pytest
from aiohttp.test_utils import TestServer
from api_helpers import reply
from router_fakes import FakeInstance

from router.app import RouterConfig, create_app
from router.tokenization import ModelTokenizer


async def test_both_sdks_retrieve_a_served_model_and_get_404_for_another(tokenizer: ModelTokenizer) -> None:
    config = RouterConfig(models={"tiny": "/unused"}, instances={"a": ""}, poll_interval_s=None)
    app = create_app(config, {"a": FakeInstance("a", reply(tokenizer))}, tokenizers={"tiny": tokenizer})
    async with TestServer(app) as server:
        root = str(server.make_url("/"))
        oai = openai.AsyncOpenAI(base_url=root + "v1", api_key="unused", max_retries=0)
        ant = anthropic.AsyncAnthropic(base_url=root, api_key="unused", max_retries=0)
        model = await oai.models.retrieve("tiny")
        info = await ant.models.retrieve("tiny")
        with pytest.raises(openai.NotFoundError) as missing:
            await oai.models.retrieve("nope")
        with pytest.raises(anthropic.NotFoundError) as ant_missing:
            await ant.models.retrieve("nope")
        await oai.close()
        await ant.close()
    assert (model.id, model.object, model.owned_by) == ("tiny", "model", "talaria")
    assert (info.id, info.type, info.display_name) == ("tiny", "model", "tiny")
    assert missing.value.code == "model_not_found"
    # each SDK's own error shape (the Anthropic SDK's 404 was OpenAI-shaped)
    assert ant_missing.value.body == {"type": "error", "error": {
        "type": "not_found_error", "message": "the model 'nope' does not exist; known models: tiny"}}
