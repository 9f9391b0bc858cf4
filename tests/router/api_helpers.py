"""Router API test helpers: the router's app on aiohttp's test server over given instance
clients, request bodies, the tokens of a reply, an SSE body read into its events, and an
instance that holds its call's first event back until a gate opens."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
from aiohttp.test_utils import TestClient, TestServer
from router_fakes import ScriptedInstance

from router.app import RouterConfig, create_app
from router.core import CallRejected
from router.tokenization import ModelTokenizer
from talaria.protocol import CallEvent, CallRequest, InstanceUnavailable, Overloaded

REPLY_TEXT = "Hello world, this is a test."
ANSWER = REPLY_TEXT  # what a HeldBack instance answers


@asynccontextmanager
async def serve(
    tokenizer: ModelTokenizer, clients: dict[str, Any], **config: Any
) -> AsyncIterator[TestClient]:
    cfg = RouterConfig(models={"tiny": "/unused"}, instances={i: "" for i in clients},
                       poll_interval_s=None, **config)
    app = create_app(cfg, clients, tokenizers={"tiny": tokenizer})
    async with TestClient(TestServer(app)) as client:
        yield client


def reply(tokenizer: ModelTokenizer, text: str = REPLY_TEXT) -> list[int]:
    return tokenizer.encode_text(text, add_special_tokens=False)


def chat_body(**kw: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Hello world"}], **kw}


async def sse(resp: Any) -> list[Any]:
    assert resp.status == 200, await resp.text()
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    out = []
    for block in (await resp.text()).split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else orjson.loads(data))
    return out


EOS = 2  # <|im_end|> in the tiny tokenizer


def scripted(tok: ModelTokenizer, *answers: str, cached_tokens: int = 0) -> ScriptedInstance:
    """An instance answering each call with the next text (then EOS)."""
    instance = ScriptedInstance("i0", [tok.encode_text(t, add_special_tokens=False) + [EOS] for t in answers])
    instance.cached_tokens = cached_tokens
    return instance


def named_events(text: str) -> list[tuple[str | None, Any]]:
    """An SSE body's events as (event name or None, data)."""
    return [(name, data) for name, data in sse_blocks(text) if name != "comment" and data is not None]


def sse_blocks(text: str, unnamed: str | None = None) -> list[tuple[str | None, Any]]:
    """An SSE body's blocks as (kind, data): kind the event's name, ``unnamed`` for data
    without one, ``comment`` for a comment line."""
    out: list[tuple[str | None, Any]] = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        if block.startswith(":"):
            out.append(("comment", block))
            continue
        name, data = unnamed, None
        for line in block.splitlines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                raw = line[len("data: "):]
                data = raw if raw == "[DONE]" else orjson.loads(raw)
        out.append((name, data))
    return out


class HeldBack(ScriptedInstance):
    """Answers ``ANSWER`` once ``gate`` opens (a call waiting for its model's slot), or then
    fails as ``fails`` says: its engine's error event, a full queue, gone, or refusing."""

    def __init__(self, tok: ModelTokenizer, gate: asyncio.Event, fails: str | None = None) -> None:
        super().__init__("i0", [tok.encode_text(ANSWER, add_special_tokens=False) + [EOS]])
        self.gate = gate
        self.fails = fails
        self.received: list[str] = []

    async def submit(self, call: CallRequest) -> AsyncIterator[CallEvent]:
        self.received.append(call.call_id)
        await self.gate.wait()
        if self.fails == "instance":
            yield CallEvent(call_id=call.call_id, finished=True, finish_reason="error", error="engine failed")
        elif self.fails == "overloaded":
            raise Overloaded("i0: the queue is full", retry_after_s=2.5)
        elif self.fails == "unavailable":
            raise InstanceUnavailable("i0: gone")
        elif self.fails == "rejected":
            raise CallRejected(400, "i0: the prompt holds a token the model does not know")
        else:
            async for event in super().submit(call):
                yield event
