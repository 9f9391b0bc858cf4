"""A streamed call that waits for its first token (its model's slot is another model's) commits
its stream after ``stream_commit_s``: its 200 and its API's opening events, then a keep-alive
every ``stream_keepalive_s`` until that token, then the answer it would have had. A failure
after the commit ends the stream with its API's error event; one before it keeps its HTTP
status; ``stream_commit_s=None`` sends nothing before the first token, as before.

The instance holds its call's first event until the test opens a gate, which it does once it
has read the keep-alives it wants (no sleeping for them)."""

from __future__ import annotations

import asyncio
import math
import re
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientResponse
from api_helpers import HeldBack, serve, sse_blocks
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from router.app import CONFIG_KEY, RouterConfig
from router.limits import RouterLimits
from router.tokenization import ModelTokenizer
from talaria.cli import _router_app
from talaria.serving.config import ConfigError, ServeConfig

USER = [{"role": "user", "content": "Hello world"}]
APIS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {"messages": USER, "max_tokens": 40}),
    "completions": ("/v1/completions", {"prompt": "Hello world", "max_tokens": 40}),
    "messages": ("/v1/messages", {"messages": USER, "max_tokens": 40}),
    "responses": ("/v1/responses", {"input": "Hello world", "max_output_tokens": 40}),
}
# What a committed stream opens with, and the event it repeats as its keep-alive.
OPENING = {"chat": ["chunk"], "completions": [], "messages": ["message_start", "ping"],
           "responses": ["response.created", "response.in_progress"]}
KEEP_ALIVE = {"chat": "comment", "completions": "comment", "messages": "ping",
              "responses": "response.in_progress"}
FAST = {"stream_commit_s": 0.02, "stream_keepalive_s": 0.02}
STREAM_EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
# Codex's reading of a rate_limit_exceeded error's message (codex-rs/codex-api, responses SSE)
CODEX_RETRY_AFTER = re.compile(r"Please try again in (\d+(?:\.\d+)?)(s|ms)")


def opened() -> asyncio.Event:
    gate = asyncio.Event()
    gate.set()
    return gate


def blocks_of(text: str) -> list[tuple[str | None, Any]]:
    """An SSE body's blocks as (kind, data): ``chunk`` for unnamed data."""
    return sse_blocks(text, unnamed="chunk")


def normalized(value: Any) -> Any:
    """Without what differs between two calls (ids, times, sequence numbers)."""
    if isinstance(value, dict):
        return {k: normalized(v) for k, v in value.items()
                if k not in ("id", "created", "created_at", "item_id", "sequence_number")}
    if isinstance(value, list | tuple):
        return [normalized(v) for v in value]
    return value


def without_keep_alives(api: str, blocks: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    return normalized([b for b in blocks if b[0] != KEEP_ALIVE[api]])


async def read_block(resp: ClientResponse) -> tuple[str, Any]:
    return blocks_of((await resp.content.readuntil(b"\n\n")).decode())[0]


async def plain_stream(tok: ModelTokenizer, api: str) -> list[tuple[str, Any]]:
    """The stream as it was before the commit existed: the first token comes at once."""
    path, body = APIS[api]
    async with serve(tok, {"i0": HeldBack(tok, opened())}, stream_commit_s=None) as client:
        resp = await client.post(path, json={"model": "tiny", "stream": True, **body})
        assert resp.status == 200
        return blocks_of(await resp.text())


@pytest.mark.parametrize("api", list(APIS))
async def test_a_waiting_stream_commits_then_keeps_alive_then_answers_as_before(
    tiny_tokenizer: ModelTokenizer, api: str,
) -> None:
    gate = asyncio.Event()
    instance = HeldBack(tiny_tokenizer, gate)
    path, body = APIS[api]
    async with serve(tiny_tokenizer, {"i0": instance}, **FAST) as client:
        resp = await client.post(path, json={"model": "tiny", "stream": True, **body})
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        assert resp.headers["X-Session-ID"]
        early = [await read_block(resp) for _ in OPENING[api]]
        while sum(kind == KEEP_ALIVE[api] for kind, _ in early) < 2 + OPENING[api].count(KEEP_ALIVE[api]):
            early.append(await read_block(resp))
        assert not instance.calls  # all of it before the instance answered at all
        gate.set()
        blocks = early + blocks_of(await resp.text())
    assert [kind for kind, _ in early[:len(OPENING[api])]] == OPENING[api]
    assert {kind for kind, _ in early[len(OPENING[api]):]} == {KEEP_ALIVE[api]}
    if KEEP_ALIVE[api] == "comment":
        assert {data for kind, data in early if kind == "comment"} == {": keep-alive"}
    assert without_keep_alives(api, blocks) == without_keep_alives(api, await plain_stream(tiny_tokenizer, api))
    if api == "chat":  # the role comes once, in the opening chunk
        chunks = [d for kind, d in blocks if kind == "chunk" and d != "[DONE]"]
        assert [c for c in chunks if "role" in c["choices"][0]["delta"]] == [blocks[0][1]]
    if api == "responses":
        assert [d["sequence_number"] for _, d in blocks] == list(range(len(blocks)))
        for kind, data in blocks:
            assert STREAM_EVENT.validate_python(data).type == kind


# (api, failure) -> what ends the stream: the error chunk's code, the Anthropic error's type,
# the Responses error's code. Full queues are Anthropic's in-stream overloaded_error (what its
# streams send where a call gets 529 before them), not a rate_limit_error (the client's).
AFTER_COMMIT = {
    "instance": ("instance_failed", "api_error", "server_error"),
    "overloaded": ("rate_limit_exceeded", "overloaded_error", "rate_limit_exceeded"),
    "unavailable": ("no_healthy_instance", "overloaded_error", "server_error"),
    "rejected": (None, "invalid_request_error", "invalid_prompt"),
}


@pytest.mark.parametrize("fails", list(AFTER_COMMIT))
@pytest.mark.parametrize("api", list(APIS))
async def test_a_failure_after_the_commit_ends_the_stream_with_its_error(
    tiny_tokenizer: ModelTokenizer, api: str, fails: str,
) -> None:
    """Committed at once, so every failure before the first token comes after the commit:
    never a silent close, each API's error event (the engine's detail stays in the log)."""
    path, body = APIS[api]
    async with serve(tiny_tokenizer, {"i0": HeldBack(tiny_tokenizer, opened(), fails)},
                     stream_commit_s=0.0) as client:
        resp = await client.post(path, json={"model": "tiny", "stream": True, **body})
        assert resp.status == 200
        text = await resp.text()
    blocks = blocks_of(text)
    assert [kind for kind, _ in blocks[:len(OPENING[api])]] == OPENING[api]
    assert "engine failed" not in text
    chunk_code, anthropic_type, responses_code = AFTER_COMMIT[fails]
    if api in ("chat", "completions"):
        assert blocks[-1] == ("chunk", "[DONE]")
        error = blocks[-2][1]["error"]
        assert error["code"] == chunk_code
        if fails == "overloaded":
            assert blocks[-2][1]["retry_after_s"] == 2.5
    elif api == "messages":
        assert [kind for kind, _ in blocks] == ["message_start", "ping", "error"]
        error = blocks[-1][1]["error"]
        assert error["type"] == anthropic_type and error["message"]
    else:
        assert [kind for kind, _ in blocks[-2:]] == ["error", "response.failed"]
        assert blocks[-2][1]["code"] == responses_code
        failed = blocks[-1][1]["response"]
        assert failed["status"] == "failed" and failed["error"]["code"] == responses_code
        for kind, data in blocks:
            assert STREAM_EVENT.validate_python(data).type == kind
    if fails == "instance":
        assert "the call failed on its instance" in text
    if fails == "overloaded":  # the delay Retry-After gives before the commit, in the message
        said = [blocks[-2][1]["message"], failed["error"]["message"]] if api == "responses" else [error["message"]]
        for message in said:
            assert message.endswith("Please try again in 3s."), message
            seconds = CODEX_RETRY_AFTER.search(message)  # as Codex reads a rate limit's delay
            assert seconds is not None and seconds.groups() == ("3", "s")


BEFORE_COMMIT = {"instance": 502, "overloaded": 429, "unavailable": 503, "rejected": 400}


@pytest.mark.parametrize("fails", list(BEFORE_COMMIT))
@pytest.mark.parametrize("api", list(APIS))
async def test_a_failure_before_the_commit_keeps_its_http_status(
    tiny_tokenizer: ModelTokenizer, api: str, fails: str,
) -> None:
    path, body = APIS[api]
    async with serve(tiny_tokenizer, {"i0": HeldBack(tiny_tokenizer, opened(), fails)},
                     stream_commit_s=30.0) as client:
        resp = await client.post(path, json={"model": "tiny", "stream": True, **body})
        text = await resp.text()
    assert resp.status == BEFORE_COMMIT[fails], text
    assert resp.headers["Content-Type"].startswith("application/json")
    if fails == "overloaded":
        assert resp.headers["Retry-After"] == "3"


@pytest.mark.parametrize("api", list(APIS))
async def test_with_the_commit_off_nothing_is_sent_before_the_first_token(
    tiny_tokenizer: ModelTokenizer, api: str,
) -> None:
    gate = asyncio.Event()
    path, body = APIS[api]
    async with serve(tiny_tokenizer, {"i0": HeldBack(tiny_tokenizer, gate)},
                     stream_commit_s=None, stream_keepalive_s=0.01) as client:
        post = asyncio.ensure_future(client.post(path, json={"model": "tiny", "stream": True, **body}))
        done, _ = await asyncio.wait({post}, timeout=0.2)
        assert not done  # not even the headers
        gate.set()
        resp = await post
        blocks = blocks_of(await resp.text())
    assert normalized(blocks) == normalized(await plain_stream(tiny_tokenizer, api))


@pytest.mark.parametrize("api", list(APIS))
async def test_a_client_that_leaves_a_committed_stream_aborts_its_call(
    tiny_tokenizer: ModelTokenizer, api: str,
) -> None:
    instance = HeldBack(tiny_tokenizer, asyncio.Event())
    path, body = APIS[api]
    async with serve(tiny_tokenizer, {"i0": instance}, stream_commit_s=0.0, stream_keepalive_s=0.01,
                     limits=RouterLimits(disconnect_poll_s=0.01)) as client:
        resp = await client.post(path, json={"model": "tiny", "stream": True, **body})
        assert resp.status == 200
        await read_block(resp)  # an opening event or a keep-alive
        resp.close()
        for _ in range(200):
            if instance.aborted:
                break
            await asyncio.sleep(0.01)
    assert instance.aborted == instance.received


@pytest.mark.parametrize(("settings", "named"), [
    ({"stream_commit_s": -1.0}, "stream_commit_s"),
    ({"stream_commit_s": math.nan}, "stream_commit_s"),
    ({"stream_commit_s": math.inf}, "stream_commit_s"),
    ({"stream_keepalive_s": 0.0}, "stream_keepalive_s"),
    ({"stream_keepalive_s": math.inf}, "stream_keepalive_s"),
])
def test_the_router_config_refuses_stream_settings_it_cannot_use(settings: dict[str, float], named: str) -> None:
    with pytest.raises(ValueError, match=f"^{named} must be"):
        RouterConfig(models={"m": "/x"}, instances={}, **settings)


def test_the_serve_config_names_a_stream_setting_it_cannot_use(model_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"\[router\]\.stream_keepalive_s must be > 0"):
        ServeConfig.from_dict({"router": {"stream_keepalive_s": 0}})
    with pytest.raises(ConfigError, match=r"\[router\]\.stream_commit_s must be a float"):
        ServeConfig.from_dict({"router": {"stream_commit_s": "never"}})
    with pytest.raises(ConfigError, match=r"\[router\]\.stream_commit_s must be a finite number"):
        ServeConfig.from_dict({"router": {"stream_commit_s": math.nan}})
    for given, wired in ((None, 10.0), (0, 0.0), (-1, None)):  # unset: the default; negative: off
        router = {"stream_keepalive_s": 5} if given is None else {"stream_commit_s": given}
        config = ServeConfig.from_dict({"router": router, "models": {"tiny": str(model_dir)},
                                        "instances": [{"id": "a", "port": 9901}]})
        app = _router_app(config, {"a": "http://127.0.0.1:9901"})
        assert app[CONFIG_KEY].stream_commit_s == wired
        assert app[CONFIG_KEY].stream_keepalive_s == (5.0 if given is None else 15.0)
