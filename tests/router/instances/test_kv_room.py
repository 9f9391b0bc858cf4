"""A call that can never fit the KV cache of any instance serving its model is refused at
admission with a 400 naming the limit, on every API, and counted as the client's error (it
was accepted, failed by the instance, and answered 502 ``instance_failed``); a ``max_tokens``
beyond that room is clamped to it by default (``router.api.output_budget``), refused under
``max_tokens_overflow = "refuse"``."""

from __future__ import annotations

import re
from typing import Any

import pytest
from api_helpers import chat_body, serve
from router_fakes import FakeInstance, model_state

from router.app import CORE_KEY
from router.instances.kv_room import kv_capacity, output_room
from router.tokenization import ModelTokenizer
from talaria.protocol import InstanceState, Residency

CAPACITY = 64  # tokens of one call in each fake instance's KV cache; the context is 256


def instance(instance_id: str, capacity: int = CAPACITY) -> FakeInstance:
    state = InstanceState(instance_id, models={"tiny": model_state("tiny", kv_capacity_tokens=capacity)})
    return FakeInstance(instance_id, [5, 6, 7], state=state)


def request_of(api: str, max_tokens: int, text: str = "Hello world") -> tuple[str, dict[str, Any]]:
    user = [{"role": "user", "content": text}]
    if api == "chat":
        return "/v1/chat/completions", chat_body(messages=user, max_tokens=max_tokens)
    if api == "completions":
        return "/v1/completions", {"model": "tiny", "prompt": text, "max_tokens": max_tokens}
    if api == "messages":
        return "/v1/messages", {"model": "tiny", "messages": user, "max_tokens": max_tokens}
    return "/v1/responses", {"model": "tiny", "input": text, "max_output_tokens": max_tokens}


@pytest.mark.parametrize("api", ["chat", "completions", "messages", "responses"])
async def test_output_beyond_the_kv_cache_is_clamped_to_it_by_default(
    tokenizer: ModelTokenizer, api: str
) -> None:
    a, b = instance("a"), instance("b", CAPACITY // 2)
    async with serve(tokenizer, {"a": a, "b": b}) as client:
        core = client.server.app[CORE_KEY]
        for i in ("a", "b"):
            await core.refresh(i)
        path, body = request_of(api, max_tokens=CAPACITY)  # fits the context, not the KV cache
        resp = await client.post(path, json=body)
        assert resp.status == 200, await resp.text()
        asked, room = resp.headers["X-Talaria-Max-Tokens-Clamped"].split("->")
    sent = [c for c in a.calls + b.calls]
    assert int(asked) == CAPACITY and 0 < int(room) < CAPACITY
    assert len(sent) == 1 and sent[0].params.max_tokens == int(room)
    assert len(sent[0].prompt_token_ids) + int(room) == CAPACITY  # the larger instance's room


@pytest.mark.parametrize("api", ["chat", "completions", "messages", "responses"])
async def test_output_beyond_the_kv_cache_is_a_400_before_the_call_is_accepted_if_refused(
    tokenizer: ModelTokenizer, api: str
) -> None:
    a, b = instance("a"), instance("b", CAPACITY // 2)
    async with serve(tokenizer, {"a": a, "b": b}, max_tokens_overflow="refuse") as client:
        core = client.server.app[CORE_KEY]
        for i in ("a", "b"):
            await core.refresh(i)
        path, body = request_of(api, max_tokens=CAPACITY)  # fits the context, not the KV cache
        resp = await client.post(path, json=body)
        assert resp.status == 400, await resp.text()
        message = (await resp.json())["error"]["message"]
        path, body = request_of(api, max_tokens=8)
        fits = await client.post(path, json=body)
        assert fits.status == 200, await fits.text()
    if api == "messages":  # Anthropic's words, prompt + max_tokens > the room's limit
        assert re.search(rf"exceed context limit: \d+ \+ {CAPACITY} > {CAPACITY},", message), message
    else:
        assert f"holds {CAPACITY} tokens of one call" in message  # the larger instance's
    assert len(a.calls) + len(b.calls) == 1  # only the call that fits was sent
    assert core.metrics.rejected.get(model="tiny", reason="kv_capacity") == 1


@pytest.mark.parametrize(("api", "param"), [("chat", "messages"), ("completions", "prompt"),
                                          ("messages", None), ("responses", "input")])
async def test_a_prompt_that_leaves_no_room_in_the_kv_cache_is_a_400(
    tokenizer: ModelTokenizer, api: str, param: str | None,
) -> None:
    """The context overflow error of each API (``context_length_exceeded`` naming the
    prompt's field; Anthropic's ``prompt is too long``), bounded by the KV cache."""
    a = instance("a", capacity=16)
    async with serve(tokenizer, {"a": a}) as client:
        await client.server.app[CORE_KEY].refresh("a")
        path, body = request_of(api, max_tokens=8, text="Hello world, this is a test " * 4)
        resp = await client.post(path, json=body)
        assert resp.status == 400, await resp.text()
        error = (await resp.json())["error"]
    if param is None:
        assert error["type"] == "invalid_request_error"
        assert re.fullmatch(r"prompt is too long: \d+ tokens > 15 maximum", error["message"]), error
    else:
        assert error["param"] == param and "none is left for output" in error["message"]
        assert error["code"] == "context_length_exceeded"
    assert not a.calls


async def test_until_every_instance_reported_its_capacity_only_the_context_bounds_a_call(
    tokenizer: ModelTokenizer,
) -> None:
    a, b = instance("a"), instance("b")
    async with serve(tokenizer, {"a": a, "b": b}) as client:
        await client.server.app[CORE_KEY].refresh("a")  # b has not reported
        resp = await client.post("/v1/chat/completions", json=chat_body(max_tokens=CAPACITY * 2))
        assert resp.status == 200, await resp.text()


def test_the_capacity_is_the_largest_among_the_instances_serving_the_model() -> None:
    def state(i: str, **models: tuple[Residency, int]) -> InstanceState:
        return InstanceState(i, models={m: model_state(m, r, kv_capacity_tokens=c)
                                        for m, (r, c) in models.items()})

    states = {"a": state("a", m=(Residency.ACTIVE, 100), n=(Residency.HOST, 900)),
              "b": state("b", m=(Residency.HOST, 300)),
              "c": state("c", m=(Residency.ABSENT, 5000), n=(Residency.ACTIVE, 50))}
    assert kv_capacity(states, states, "m") == 300  # c does not serve m
    assert kv_capacity(states, states, "n") == 900
    assert kv_capacity(states, [*states, "d"], "m") is None  # d has not reported
    assert kv_capacity({"e": state("e", m=(Residency.ACTIVE, 0))}, ["e"], "m") is None
    assert output_room("m", 100, 4096, 300).tokens == 200
    assert output_room("m", 100, 250, 300).tokens == 150
    assert output_room("m", 100, 4096, None).tokens == 3996


@pytest.mark.parametrize("api", ["chat", "completions", "messages", "responses"])
async def test_a_prompt_over_the_context_is_counted_as_a_refusal(
    tokenizer: ModelTokenizer, api: str,
) -> None:
    """``talaria_router_rejected_total{reason="context_length"}`` counted only the refusals
    its output room found, and a prompt over the context is refused before that, when it is
    tokenized: the most common refusal an agent meets was never counted."""
    a = instance("a", capacity=4096)
    async with serve(tokenizer, {"a": a}) as client:
        await client.server.app[CORE_KEY].refresh("a")
        path, body = request_of(api, max_tokens=8, text="Hello world, this is a test " * 60)
        resp = await client.post(path, json=body)
        text = await resp.text()
        core = client.server.app[CORE_KEY]
    assert resp.status == 400 and "255" in text, text  # the context's bound (256), not the KV cache's
    assert core.metrics.rejected.get(model="tiny", reason="context_length") == 1
    assert not a.calls
