"""What one request, and all of them together, may take from the router: session ids checked,
prompt size checked before tokenizing and huge prompts tokenized apart, a cap on calls in
flight, a bounded session table, a body deadline, one whitelist of request fields, and a
/health that tells a load balancer when no instance is healthy."""

from __future__ import annotations

import asyncio
import copy
import threading
from pathlib import Path
from typing import Any

import pytest
from api_helpers import chat_body, reply, serve
from router_fakes import FakeInstance, book_call

from router.app import CORE_KEY
from router.sessions.table import SessionTable
from router.tokenization import ModelTokenizer

# Set while a test wants large encodes to wait (a module global: tokenizers are deep-copied).
LARGE_ENCODE_GATE = threading.Event()


class CountingTokenizer:
    """A real tokenizer that counts encodes and, for texts over ``slow_over`` characters,
    waits for ``LARGE_ENCODE_GATE`` first."""

    def __init__(self, inner: Any, slow_over: int = 1 << 30) -> None:
        self.inner = inner
        self.slow_over = slow_over
        self.encoded: list[int] = []
        self.threads: list[str] = []  # the thread of each encode (its tokenizer lane)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.encoded.append(len(text))
        self.threads.append(threading.current_thread().name)
        if len(text) > self.slow_over:
            assert LARGE_ENCODE_GATE.wait(30)
        return self.inner.encode(text, add_special_tokens=add_special_tokens)

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __deepcopy__(self, memo: dict[int, Any]) -> CountingTokenizer:
        twin = CountingTokenizer(copy.deepcopy(self.inner, memo), self.slow_over)
        twin.encoded = self.encoded  # one count for both lanes
        twin.threads = self.threads
        return twin


def completion(prompt: Any, **kw: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 4, **kw}


@pytest.mark.parametrize(
    ("where", "value", "status"),
    [
        ("header", "s" * 256, 200),
        ("header", "s" * 257, 400),
        ("header", "x" * 8000, 400),  # (aiohttp itself refuses header lines over 8 KiB)
        ("body", "x" * (1 << 20), 400),
        ("body", "line\nbreak", 400),
        ("body", "nul\x00", 400),
        ("body", "caf\u00e9", 400),
        ("body", "tab\there", 400),
        ("body", "ok-id_1.2:3", 200),
    ],
)
async def test_session_ids_are_bounded_printable_ascii(
    tokenizer: ModelTokenizer, where: str, value: str, status: int
) -> None:
    a = FakeInstance("a", reply(tokenizer))
    async with serve(tokenizer, {"a": a}) as client:
        body = chat_body(session_id=value) if where == "body" else chat_body()
        headers = {"X-Session-ID": value} if where == "header" else {}
        resp = await client.post("/v1/chat/completions", json=body, headers=headers)
        assert resp.status == status, await resp.text()
        if status == 400:
            assert not a.calls  # nothing stored, nothing sent
            assert "session" in (await resp.json())["error"]["param"].lower()
        else:
            assert resp.headers["X-Session-ID"] == value


async def test_a_huge_prompt_is_refused_before_it_is_tokenized(model_dir: Path) -> None:
    base = ModelTokenizer.load("tiny", model_dir)
    counting = CountingTokenizer(base.tokenizer)
    tok = ModelTokenizer("tiny", counting, base.context_len)
    a = FakeInstance("a", reply(base))
    async with serve(tok, {"a": a}, max_body_bytes=8 << 20) as client:
        resp = await client.post("/v1/completions", json=completion("x" * (4 << 20)))
        assert resp.status == 400
        assert "bytes" in (await resp.json())["error"]["message"]
        resp = await client.post("/v1/chat/completions", json=chat_body(
            messages=[{"role": "user", "content": "y" * (4 << 20)}]))
        assert resp.status == 400
    assert counting.encoded == []  # neither was tokenized


def big_tools(description_bytes: int) -> list[dict[str, Any]]:
    schema = {"type": "object", "properties": {"path": {"type": "string"}}}
    return [{"type": "function", "function": {"name": "read", "description": "d" * description_bytes,
                                              "parameters": schema}}]


async def test_tool_schemas_count_in_the_prompt_size(model_dir: Path) -> None:
    """Small messages, huge tools: refused before tokenizing (both APIs), and tools under the
    bound but over the small lane's size are tokenized in the large lane."""
    base = ModelTokenizer.load("tiny", model_dir)
    counting = CountingTokenizer(base.tokenizer)
    tok = ModelTokenizer("tiny", counting, base.context_len, large_prompt_bytes=1000)
    a = FakeInstance("a", reply(base))
    too_big = base.context_len * 32 + 1
    async with serve(tok, {"a": a}, tool_formats={"tiny": "hermes"}) as client:
        resp = await client.post("/v1/chat/completions", json=chat_body(tools=big_tools(too_big)))
        assert resp.status == 400 and "bytes" in (await resp.json())["error"]["message"]
        anthropic = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
                     "tools": [{"name": "read", "description": "d" * too_big,
                                "input_schema": {"type": "object"}}]}
        resp = await client.post("/v1/messages", json=anthropic)
        assert resp.status == 400 and "bytes" in (await resp.json())["error"]["message"]
        assert counting.encoded == []
        resp = await client.post("/v1/chat/completions", json=chat_body(tools=big_tools(3000)))
        assert resp.status == 200, await resp.text()
    assert counting.threads == ["tokenize-large-tiny_0"]


async def test_token_counts_take_a_place_under_the_in_flight_cap(tokenizer: ModelTokenizer) -> None:
    from router.limits import RouterLimits

    hold = asyncio.Event()
    a = FakeInstance("a", reply(tokenizer), hold=hold)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello world"}]}
    async with serve(tokenizer, {"a": a}, limits=RouterLimits(max_inflight_calls=1)) as client:
        held = asyncio.ensure_future(client.post("/v1/chat/completions", json=chat_body()))
        for _ in range(200):
            if a.calls:
                break
            await asyncio.sleep(0.01)
        resp = await client.post("/v1/messages/count_tokens", json=body)
        assert resp.status == 429
        hold.set()
        assert (await held).status == 200
        resp = await client.post("/v1/messages/count_tokens", json=body)
        assert resp.status == 200 and (await resp.json())["input_tokens"] > 0


async def test_a_large_prompt_does_not_hold_up_a_small_one(model_dir: Path) -> None:
    base = ModelTokenizer.load("tiny", model_dir)
    tok = ModelTokenizer("tiny", CountingTokenizer(base.tokenizer, slow_over=2000),
                         base.context_len, large_prompt_bytes=1000)
    a = FakeInstance("a", reply(base))
    LARGE_ENCODE_GATE.clear()
    try:
        async with serve(tok, {"a": a}) as client:
            large = asyncio.ensure_future(client.post("/v1/completions", json=completion("z " * 2000)))
            await asyncio.sleep(0.2)  # the large prompt is being tokenized (and waits)
            small = await asyncio.wait_for(
                client.post("/v1/completions", json=completion("Hello world")), 10)
            assert small.status == 200 and not large.done()
            LARGE_ENCODE_GATE.set()
            assert (await large).status == 400  # too many tokens, found once tokenized
    finally:
        LARGE_ENCODE_GATE.set()


async def test_calls_beyond_the_cap_get_429_with_retry_after(tokenizer: ModelTokenizer) -> None:
    from router.limits import RouterLimits

    hold = asyncio.Event()
    a = FakeInstance("a", reply(tokenizer), hold=hold)
    limits = RouterLimits(max_inflight_calls=2, busy_retry_after_s=3.0)
    async with serve(tokenizer, {"a": a}, limits=limits) as client:
        held = [asyncio.ensure_future(client.post("/v1/chat/completions", json=chat_body()))
                for _ in range(2)]
        for _ in range(200):
            if len(a.calls) == 2:
                break
            await asyncio.sleep(0.01)
        resp = await client.post("/v1/chat/completions", json=chat_body())
        assert resp.status == 429 and resp.headers["Retry-After"] == "3"
        assert len(a.calls) == 2
        hold.set()
        assert [(await r).status for r in held] == [200, 200]
        resp = await client.post("/v1/chat/completions", json=chat_body())
        assert resp.status == 200


def test_the_session_table_evicts_the_least_recently_seen_idle_session() -> None:
    table = SessionTable(ttl_s=1000.0, max_sessions=3)
    calls = {sid: book_call(table, sid, [1] * 10, float(i)) for i, sid in enumerate(["a", "b", "c"])}
    table.end_call(*calls["a"], 3.0)
    table.end_call(*calls["b"], 4.0)
    book_call(table, "a", [1] * 12, 5.0, 6.0)  # a is seen again: b is now the least recent idle
    book_call(table, "d", [1] * 10, 7.0)
    assert [s for s in "abcd" if s in table] == ["a", "c", "d"] and table.evicted == 1
    book_call(table, "e", [1] * 10, 8.0)  # c and d are busy: a (idle) goes
    assert "a" not in table and len(table) == 3


async def test_health_is_503_without_a_healthy_instance_and_live_stays_200(
    tokenizer: ModelTokenizer,
) -> None:
    a = FakeInstance("a", reply(tokenizer))
    async with serve(tokenizer, {"a": a}) as client:
        assert (await client.get("/health")).status == 200
        client.app[CORE_KEY].mark_down("a", "test")
        resp = await client.get("/health")
        assert resp.status == 503 and (await resp.json())["healthy_instances"] == []
        assert (await client.get("/live")).status == 200


async def test_a_slow_body_gets_408(tokenizer: ModelTokenizer) -> None:
    from router.limits import RouterLimits

    a = FakeInstance("a", reply(tokenizer))

    async def trickle() -> Any:
        yield b'{"model": "tiny", '
        await asyncio.sleep(5)
        yield b'"messages": []}'

    async with serve(tokenizer, {"a": a}, limits=RouterLimits(body_timeout_s=0.2)) as client:
        resp = await client.post("/v1/chat/completions", data=trickle(),
                                 headers={"Content-Type": "application/json"})
        assert resp.status == 408
        assert (await resp.json())["error"]["code"] == "request_timeout"


@pytest.mark.parametrize(
    ("path", "extra", "needle"),
    [
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
        ("/v1/chat/completions", {"frequency_penalty": 0.5}, "frequency_penalty"),
        ("/v1/chat/completions", {"top_logprobs": 5, "logprobs": True}, "top_logprobs"),
        ("/v1/chat/completions", {"n": True}, "n=1"),
        ("/v1/chat/completions", {"prediction": {"type": "content"}, "modalities": ["audio"]},
         "modalities, prediction"),
        ("/v1/completions", {"best_of": True}, "best_of"),
        ("/v1/completions", {"n": True}, "n=1"),
        ("/v1/completions", {"logprobs": 5}, "logprobs"),
        ("/v1/completions", {"suffix": "x"}, "suffix"),
    ],
)
async def test_unsupported_fields_are_refused_by_name(
    tokenizer: ModelTokenizer, path: str, extra: dict[str, Any], needle: str
) -> None:
    a = FakeInstance("a", reply(tokenizer))
    base = chat_body() if path.endswith("chat/completions") else completion("Hello")
    async with serve(tokenizer, {"a": a}) as client:
        resp = await client.post(path, json={**base, **extra})
        assert resp.status == 400
        assert needle in (await resp.json())["error"]["message"]
    assert not a.calls


async def test_no_op_values_and_tiny_temperatures_are_accepted(tokenizer: ModelTokenizer) -> None:
    a = FakeInstance("a", reply(tokenizer))
    extra = {"frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "n": 1,
             "top_logprobs": 0, "user": "u", "tools": None, "temperature": 1e-320}
    async with serve(tokenizer, {"a": a}) as client:
        resp = await client.post("/v1/chat/completions", json=chat_body(**extra))
        assert resp.status == 200, await resp.text()
    assert a.calls[0].params.greedy  # a temperature too small to divide by samples greedily


def test_router_limits_are_checked() -> None:
    from router.limits import RouterLimits

    with pytest.raises(ValueError, match="max_inflight_calls"):
        RouterLimits(max_inflight_calls=0)
    with pytest.raises(ValueError, match="max_session_id_chars"):
        RouterLimits(max_session_id_chars=5000)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"])
async def test_a_prompt_over_the_byte_bound_is_counted_as_a_refusal(tokenizer: ModelTokenizer, path: str) -> None:
    """``talaria_router_rejected_total`` counted a prompt refused over the context once
    tokenized, but not one refused by the byte bound before it: the largest prompts went
    uncounted."""
    a = FakeInstance("a", reply(tokenizer))
    text = "x" * (tokenizer.context_len * 32 + 1)
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 4}
    if path == "/v1/completions":
        body["prompt"] = text
    elif path == "/v1/responses":
        body = {"model": "tiny", "input": text}
    else:
        body["messages"] = [{"role": "user", "content": text}]
    async with serve(tokenizer, {"a": a}, max_body_bytes=8 << 20) as client:
        resp = await client.post(path, json=body)
        refused = await resp.text()
        core = client.server.app[CORE_KEY]
    assert resp.status == 400 and "bytes long" in refused, refused
    assert core.metrics.rejected.get(model="tiny", reason="prompt_bytes") == 1
    assert not a.calls


async def test_chat_accepts_the_fields_that_do_not_change_the_answer(tokenizer: ModelTokenizer) -> None:
    """Fields the Responses API already ignores (``store``, ``metadata``, ``prompt_cache_key``,
    ...) were a 400 on chat completions, and so were ``response_format`` and ``modalities`` at
    the values that ask for what the server does anyway: clients that send them explicitly
    (LiteLLM-based agents pass them through) failed every call."""
    a = FakeInstance("a", reply(tokenizer))
    extra = {"store": False, "metadata": {"k": "v"}, "prompt_cache_key": "pk",
             "safety_identifier": "s", "service_tier": "auto",
             "response_format": {"type": "text"}, "modalities": ["text"]}
    async with serve(tokenizer, {"a": a}) as client:
        resp = await client.post("/v1/chat/completions", json=chat_body(**extra))
        assert resp.status == 200, await resp.text()
        for name, bad in (("store", "yes"), ("metadata", "x"), ("prompt_cache_key", 3),
                          ("response_format", {"type": "json_object"}), ("modalities", ["audio"])):
            resp = await client.post("/v1/chat/completions", json=chat_body(**{name: bad}))
            assert resp.status == 400, name
            assert (await resp.json())["error"]["param"] == name
    assert len(a.calls) == 1
