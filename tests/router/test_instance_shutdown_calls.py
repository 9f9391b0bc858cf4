"""A call its instance aborts as that instance shuts down on its own (its drain over: the
abort's ``abort_reason`` is ``shutting_down``) is no failure of the instance. Before its first
event it is re-placed on another instance and completes there, the shutting-down instance
taking no call until a poll finds it answering; with no other instance, and once tokens
were sent, its client is told the instance is shutting down: a 503 ``server_shutting_down``
(collected), that error in its stream (streamed), in the OpenAI and Anthropic shapes. It
read "the call failed on its instance" (a 502), as if the instance had crashed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from api_helpers import EOS, chat_body, named_events, reply, serve, sse
from router_fakes import FakeInstance

from router.app import CORE_KEY
from router.core import RouterCore
from router.tokenization import ModelTokenizer
from talaria.protocol import (
    SHUTTING_DOWN,
    CallEvent,
    CallRequest,
    CallUsage,
    InstanceState,
    InstanceUnreachable,
    SamplingParams,
)

REPLY = [10, 11, 12, 13, 14]


class ShuttingDown(FakeInstance):
    """Streams the first ``before`` tokens of its reply, then ends the call as an instance
    whose shut-down's drain ended does: an abort with ``abort_reason`` ``shutting_down``.
    From then on its state polls are refused (it stopped listening) until it ``restarts``."""

    def __init__(self, instance_id: str, reply: list[int], before: int = 0) -> None:
        super().__init__(instance_id, reply)
        self.before = before
        self.shut = False

    async def submit(self, call: CallRequest) -> AsyncIterator[CallEvent]:
        self.calls.append(call)
        for i, token in enumerate(self.reply[: self.before]):
            await asyncio.sleep(0)
            yield CallEvent(call.call_id, [token], usage=self.usage(call, i, len(self.reply)))
        self.shut = True
        yield CallEvent(
            call.call_id, finished=True, finish_reason="abort", abort_reason=SHUTTING_DOWN,
            error=f"instance {self.instance_id!r} is shutting down: the call was aborted past its drain",
            usage=CallUsage(len(call.prompt_token_ids), self.before),
        )

    async def state(self) -> InstanceState:
        if self.shut:
            raise InstanceUnreachable(f"{self.instance_id}: connection refused")
        return await super().state()

    def restarts(self) -> None:
        self.shut = False
        self.before = len(self.reply)


def _request(i: int) -> CallRequest:
    return CallRequest(f"c{i}", f"s{i}", "m", list(range(40)), SamplingParams(max_tokens=5))


async def test_a_call_cut_before_its_first_event_completes_on_the_other_instance() -> None:
    going, other = ShuttingDown("a", REPLY), FakeInstance("b", REPLY)
    core = RouterCore({"a": going, "b": other}, "load", refresh_after_call=False)
    events = [e async for e in core.submit(_request(0))]
    assert len(going.calls) == 1  # placed there first, then re-placed
    assert [t for e in events for t in e.token_ids] == REPLY
    assert events[-1].finished and events[-1].error is None and events[-1].instance_id == "b"
    assert core.metrics.call_failures.get(instance="a", kind="instance_shutdown") == 1
    assert core.metrics.call_failures.get(instance="a", kind="unavailable") == 0
    assert core.metrics.requests.get(model="m", instance="b", outcome="ok") == 1
    assert "a" not in core.call_health.failures  # not against its health
    # It takes no call until a poll finds it answering: the next call goes to b at once.
    assert core.healthy == {"b"}
    [e async for e in core.submit(_request(1))]
    assert len(going.calls) == 1 and len(other.calls) == 2
    assert not await core.refresh("a")  # still going away: refused
    going.restarts()
    assert await core.refresh("a") and core.healthy == {"a", "b"}


async def test_a_chat_call_cut_before_its_first_event_answers_from_the_other_instance(
    tiny_tokenizer: ModelTokenizer,
) -> None:
    answer = reply(tiny_tokenizer) + [EOS]
    going, other = ShuttingDown("i0", answer), FakeInstance("i1", answer)
    async with serve(tiny_tokenizer, {"i0": going, "i1": other}, policy="load") as client:
        resp = await client.post("/v1/chat/completions", json=chat_body(max_tokens=50))
        data = await resp.json()
        core = client.server.app[CORE_KEY]
    assert resp.status == 200, data
    assert data["choices"][0]["message"]["content"] == tiny_tokenizer.decode(reply(tiny_tokenizer))
    assert len(going.calls) == 1 and len(other.calls) == 1
    assert core.metrics.call_failures.get(instance="i0", kind="instance_shutdown") == 1


async def _two(tok: ModelTokenizer, before: int) -> tuple[ShuttingDown, FakeInstance, dict[str, Any]]:
    answer = reply(tok) + [EOS]
    going, other = ShuttingDown("i0", answer, before=before), FakeInstance("i1", answer)
    return going, other, {"i0": going, "i1": other}


def _shutting_down(message: str) -> bool:
    return "instance serving the call is shutting down" in message


async def test_a_collected_chat_call_cut_mid_answer_is_a_503_saying_so(
    tiny_tokenizer: ModelTokenizer,
) -> None:
    going, other, clients = await _two(tiny_tokenizer, before=2)
    async with serve(tiny_tokenizer, clients, policy="load") as client:
        resp = await client.post("/v1/chat/completions", json=chat_body(max_tokens=50))
        error = (await resp.json())["error"]
    assert resp.status == 503, error
    assert error["code"] == "server_shutting_down" and _shutting_down(error["message"])
    assert not other.calls  # its tokens were sent: not re-placed


async def test_a_chat_stream_cut_mid_answer_ends_with_the_shutting_down_error(
    tiny_tokenizer: ModelTokenizer,
) -> None:
    going, other, clients = await _two(tiny_tokenizer, before=2)
    async with serve(tiny_tokenizer, clients, policy="load") as client:
        resp = await client.post("/v1/chat/completions", json=chat_body(max_tokens=50, stream=True))
        events = await sse(resp)
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["code"] == "server_shutting_down" and _shutting_down(error["message"])
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in events[:-2] if c.get("choices"))
    assert text == tiny_tokenizer.decode(reply(tiny_tokenizer)[:2])
    assert not other.calls


async def test_an_anthropic_message_cut_mid_answer_is_told_the_instance_shuts_down(
    tiny_tokenizer: ModelTokenizer,
) -> None:
    body = {"model": "tiny", "max_tokens": 50, "messages": [{"role": "user", "content": "Hello"}]}
    _going, _other, clients = await _two(tiny_tokenizer, before=2)
    async with serve(tiny_tokenizer, clients, policy="load") as client:
        resp = await client.post("/v1/messages", json=body)
        data = await resp.json()
    assert resp.status == 503, data
    assert data["type"] == "error" and _shutting_down(data["error"]["message"])
    _going, _other, clients = await _two(tiny_tokenizer, before=2)
    async with serve(tiny_tokenizer, clients, policy="load") as client:
        resp = await client.post("/v1/messages", json={**body, "stream": True})
        events = named_events(await resp.text())
    name, error = events[-1]
    assert name == "error" and _shutting_down(error["error"]["message"]), events
    assert error["error"]["type"] == "overloaded_error"  # Anthropic's 503


async def test_with_no_other_instance_a_call_cut_before_its_first_event_is_a_503(
    tiny_tokenizer: ModelTokenizer,
) -> None:
    going = ShuttingDown("i0", reply(tiny_tokenizer) + [EOS])
    async with serve(tiny_tokenizer, {"i0": going}) as client:
        resp = await client.post("/v1/chat/completions", json=chat_body(max_tokens=50))
        error = (await resp.json())["error"]
    assert resp.status == 503, error
    assert error["code"] == "server_shutting_down" and "i0 is shutting down" in error["message"]
    going.shut = False  # a stream committed at once gets the same error in it
    async with serve(tiny_tokenizer, {"i0": going}, stream_commit_s=0.0) as client:
        resp = await client.post("/v1/chat/completions", json=chat_body(max_tokens=50, stream=True))
        events = await sse(resp)
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["code"] == "server_shutting_down" and "i0 is shutting down" in error["message"]
