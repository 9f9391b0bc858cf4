"""The official ``openai`` and ``anthropic`` clients read a stream that committed before its
first token (``router.api.stream_commit``) as the stream they read when the token came at
once: the keep-alives (SSE comments, ``ping``, repeated ``response.in_progress``) change
nothing in what they return, and a failure after the commit is an error they raise. Over
real localhost HTTP; the instance holds its call until two keep-alives have gone out. On the
virtual clock, a call waiting 240 s for its slot outlives a 60 s read timeout (a proxy's, or
an SDK's ``timeout``) only when its stream commits."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anthropic
import openai
import pytest
from aiohttp.test_utils import TestServer
from api_helpers import ANSWER, EOS, HeldBack
from router_fakes import ScriptedInstance

from router.api.stream_commit import FirstEvent
from router.api.stream_output import OutputAssembler
from router.app import CORE_KEY, RouterConfig, create_app
from router.tokenization import ModelTokenizer
from talaria.clock import run_virtual
from talaria.protocol import CallEvent, CallRequest

USER = [{"role": "user", "content": "Hello world"}]
PROMPT_IDS = list(range(10, 40))


@asynccontextmanager
async def router(tok: ModelTokenizer, instance: ScriptedInstance, **config: Any) -> AsyncIterator[TestServer]:
    cfg = RouterConfig(models={"tiny": "/unused"}, instances={"i0": ""}, poll_interval_s=None, **config)
    server = TestServer(create_app(cfg, clients={"i0": instance}, tokenizers={"tiny": tok}))
    await server.start_server()
    try:
        yield server
    finally:
        await server.close()


class KeepAlives:
    """Counts the keep-alives the router sends; a call's second opens its instance's gate."""

    def __init__(self) -> None:
        self.sent: list[str] = []  # the call id of each
        self.gate = asyncio.Event()

    def held_back(self, tok: ModelTokenizer, fails: str | None = None, cached_tokens: int = 0,
                  at_once: bool = False) -> HeldBack:
        """An instance holding its call until two keep-alives went out (``at_once``: not at all)."""
        self.gate = asyncio.Event()
        if at_once:
            self.gate.set()
        instance = HeldBack(tok, self.gate, fails)
        instance.cached_tokens = cached_tokens
        return instance


@pytest.fixture
def keep_alives(monkeypatch: pytest.MonkeyPatch) -> KeepAlives:
    spy = KeepAlives()
    original = FirstEvent.stream

    async def stream(self: FirstEvent, out: OutputAssembler, opening: Callable[[CallEvent | None], Awaitable[None]],
                     keep_alive: Callable[[], Awaitable[None]]) -> CallEvent | None:
        async def counted() -> None:
            await keep_alive()
            spy.sent.append(out.request_id)
            if spy.sent.count(out.request_id) == 2:
                spy.gate.set()

        return await original(self, out, opening, counted)

    monkeypatch.setattr(FirstEvent, "stream", stream)
    return spy


async def test_the_openai_client_reads_a_committed_chat_stream_as_before(
    tiny_tokenizer: ModelTokenizer, keep_alives: KeepAlives,
) -> None:
    async def chat(committed: bool) -> tuple[list[Any], list[Any]]:
        instance = keep_alives.held_back(tiny_tokenizer, at_once=not committed)
        async with router(tiny_tokenizer, instance, stream_commit_s=0.02, stream_keepalive_s=0.02) as server:
            client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="k", max_retries=0)
            stream = await client.chat.completions.create(
                model="tiny", messages=USER, max_tokens=40, stream=True, stream_options={"include_usage": True})
            chunks = [chunk async for chunk in stream]
            await client.close()
        deltas = [c.choices[0].delta.model_dump(exclude_none=True) for c in chunks if c.choices]
        return deltas, [(c.choices[0].finish_reason if c.choices else None, c.usage) for c in chunks]

    plain = await chat(committed=False)
    assert not keep_alives.sent
    committed = await chat(committed=True)
    assert len(keep_alives.sent) == 2
    assert committed == plain
    deltas = committed[0]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert not any("role" in d for d in deltas[1:])
    assert "".join(d.get("content", "") for d in deltas) == ANSWER


async def test_the_openai_client_reads_a_committed_responses_stream_as_before(
    tiny_tokenizer: ModelTokenizer, keep_alives: KeepAlives,
) -> None:
    async def respond(committed: bool) -> tuple[list[str], Any]:
        instance = keep_alives.held_back(tiny_tokenizer, at_once=not committed)
        async with router(tiny_tokenizer, instance, stream_commit_s=0.02, stream_keepalive_s=0.02) as server:
            client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="k", max_retries=0)
            stream = await client.responses.create(model="tiny", input="Hello world", stream=True)
            events = [event async for event in stream]
            await client.close()
        numbers = [e.sequence_number for e in events]
        assert numbers == list(range(len(events)))
        final = events[-1]
        assert final.type == "response.completed"
        return [e.type for e in events], final.response.output_text

    plain_kinds, plain_text = await respond(committed=False)
    kinds, text = await respond(committed=True)
    assert text == plain_text == ANSWER
    assert kinds[:4] == ["response.created"] + ["response.in_progress"] * 3
    assert kinds[4:] == plain_kinds[2:]


async def test_the_anthropic_client_reads_a_committed_stream_as_before(
    tiny_tokenizer: ModelTokenizer, keep_alives: KeepAlives,
) -> None:
    """The usage's cached split is known at the first event: ``message_start`` sent before it
    counts the whole prompt as input, and the ``message_delta`` at the end sets the split,
    which the client's final message carries, as for a stream that did not wait."""
    async def stream(committed: bool) -> tuple[Any, Any]:
        instance = keep_alives.held_back(tiny_tokenizer, cached_tokens=5, at_once=not committed)
        async with router(tiny_tokenizer, instance, stream_commit_s=0.02, stream_keepalive_s=0.02) as server:
            client = anthropic.AsyncAnthropic(base_url=str(server.make_url("/")), api_key="k", max_retries=0)
            async with client.messages.stream(model="tiny", max_tokens=40, messages=USER) as events:
                start = [e async for e in events][0]
                final = await events.get_final_message()
            await client.close()
        assert start.type == "message_start"
        return start.message.usage, final

    plain_start, plain = await stream(committed=False)
    start, final = await stream(committed=True)
    assert len(keep_alives.sent) == 2
    assert final.model_dump(exclude={"id"}) == plain.model_dump(exclude={"id"})
    assert final.content[0].text == ANSWER  # type: ignore[union-attr]
    assert (final.usage.input_tokens, final.usage.cache_read_input_tokens) == (plain_start.input_tokens, 5)
    assert (start.input_tokens, start.cache_read_input_tokens) == (plain_start.input_tokens + 5, 0)


async def test_the_clients_raise_a_failure_after_the_commit(tiny_tokenizer: ModelTokenizer) -> None:
    """A queue that turns out full after the commit: each client raises, none ends quietly."""
    instance = KeepAlives().held_back(tiny_tokenizer, fails="overloaded", at_once=True)
    async with router(tiny_tokenizer, instance, stream_commit_s=0.0) as server:
        client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="k", max_retries=0)
        stream = await client.chat.completions.create(model="tiny", messages=USER, max_tokens=40, stream=True)
        with pytest.raises(openai.APIError, match="queue is full. Please try again in 3s"):
            async for _ in stream:
                pass
        await client.close()
        claude = anthropic.AsyncAnthropic(base_url=str(server.make_url("/")), api_key="k", max_retries=0)
        with pytest.raises(anthropic.APIStatusError, match="queue is full. Please try again in 3s.*overloaded_error"):
            async with claude.messages.stream(model="tiny", max_tokens=40, messages=USER) as events:
                async for _ in events:
                    pass
        await claude.close()


class WaitsForItsSlot(ScriptedInstance):
    """Answers after ``wait_s`` on the loop's clock: another model holds the slot."""

    def __init__(self, tok: ModelTokenizer, wait_s: float) -> None:
        super().__init__("i0", [tok.encode_text(ANSWER, add_special_tokens=False) + [EOS]])
        self.wait_s = wait_s

    async def submit(self, call: CallRequest) -> AsyncIterator[CallEvent]:
        await asyncio.sleep(self.wait_s)
        async for event in super().submit(call):
            yield event


@pytest.mark.parametrize("commit_s", [10.0, None], ids=["committed", "commit-off"])
def test_a_call_waiting_240_s_for_its_slot_outlives_a_60_s_read_timeout_only_when_committed(
    tiny_tokenizer: ModelTokenizer, commit_s: float | None,
) -> None:
    """At the defaults (commit after 10 s, a keep-alive every 15 s). The prompt is token ids
    and its hashing inline: the virtual clock does not wait for a thread's work."""
    async def main() -> str | None:
        instance = WaitsForItsSlot(tiny_tokenizer, 240.0)  # within the first-token deadline, 300 s
        async with router(tiny_tokenizer, instance, stream_commit_s=commit_s) as server:
            server.app[CORE_KEY].hash_executor = None
            client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="k", max_retries=0,
                                        timeout=openai.Timeout(60.0, connect=5.0))
            try:
                stream = await client.completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=40,
                                                         stream=True)
                return "".join([c.choices[0].text async for c in stream if c.choices])
            except openai.APITimeoutError:
                return None
            finally:
                await client.close()

    assert run_virtual(main()) == (ANSWER if commit_s is not None else None)
