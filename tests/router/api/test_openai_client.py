"""The official openai client against the router, over real localhost HTTP: the router
reaches a fake instance through HttpInstanceClient, so the whole wire path is exercised."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from aiohttp.test_utils import TestServer
from instance_app import fake_instance_app

from router.app import RouterConfig, create_app
from router.tokenization import ModelTokenizer


async def test_openai_client_end_to_end(tokenizer: ModelTokenizer, model_dir: Path) -> None:
    instance = TestServer(fake_instance_app({"calls": "ok"}, model="tiny"))
    await instance.start_server()
    url = str(instance.make_url("/"))
    config = RouterConfig(models={"tiny": str(model_dir)}, instances={"i0": url}, api_key="k",
                          poll_interval_s=0.05)
    router = TestServer(create_app(config))  # loads the tokenizer, builds HTTP clients
    await router.start_server()
    try:
        client = openai.AsyncOpenAI(base_url=str(router.make_url("/v1")), api_key="k", max_retries=0)
        expected = tokenizer.decode([7, 8, 9])
        chat = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=3,
            extra_headers={"X-Session-ID": "agent-1"},
        )
        assert chat.choices[0].message.content == expected
        assert chat.choices[0].finish_reason == "length"
        assert chat.usage is not None and chat.usage.completion_tokens == 3
        assert chat.usage.prompt_tokens_details is not None
        assert chat.usage.prompt_tokens_details.cached_tokens == 1

        stream = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=3, stream=True,
            stream_options={"include_usage": True}, extra_body={"session_id": "agent-1"},
        )
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            usage = chunk.usage or usage
        assert text == expected and usage is not None and usage.total_tokens > 3

        completion = await client.completions.create(model="tiny", prompt="Hello", max_tokens=3)
        assert completion.choices[0].text == expected

        models = await client.models.list()
        assert [m.id for m in models.data] == ["tiny"]

        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                                 max_tokens=-5)
        bad = openai.AsyncOpenAI(base_url=str(router.make_url("/v1")), api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await bad.models.list()
        await client.close()
        await bad.close()
    finally:
        await router.close()
        await instance.close()
