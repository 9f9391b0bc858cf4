"""The router's HTTP API through aiohttp's test server, with fake instances."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import orjson
import pytest
from api_helpers import REPLY_TEXT, chat_body, reply, serve, sse
from router_fakes import FakeInstance

from router.app import CORE_KEY, RouterConfig
from router.tokenization import ModelTokenizer
from talaria.protocol import InstanceState


async def test_chat_non_streaming_with_usage(tokenizer: ModelTokenizer) -> None:
    a = FakeInstance("a", reply(tokenizer), cached_tokens=4, restored_tokens=3)
    async with serve(tokenizer, {"a": a}) as client:
        resp = await client.post("/v1/chat/completions", json=chat_body(max_tokens=100))
        assert resp.status == 200, await resp.text()
        data = await resp.json()
    assert data["object"] == "chat.completion"
    assert data["choices"][0]["message"] == {"role": "assistant", "content": REPLY_TEXT}
    assert data["choices"][0]["finish_reason"] == "stop"
    prompt_ids = tokenizer.encode_chat([{"role": "user", "content": "Hello world"}])
    assert a.calls[0].prompt_token_ids == prompt_ids
    assert re.fullmatch(r"inferred-[0-9a-f]{8}-0", a.calls[0].session_id)
    assert a.calls[0].last_call  # inferred: tentative, see below
    usage = data["usage"]
    assert usage["prompt_tokens"] == len(prompt_ids)
    assert usage["completion_tokens"] == len(reply(tokenizer))
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    # restored_tokens: the extension saying how many cached tokens came back from host KV
    assert usage["prompt_tokens_details"] == {"cached_tokens": 4, "restored_tokens": 3}


async def test_an_id_kept_from_before_a_restart_names_no_new_anonymous_conversation(
        tokenizer: ModelTokenizer) -> None:
    """Each router process names its inferred sessions with a random part of its own: a
    client that kept the id a router gave it before a restart (the counter starts again)
    gets a session of its own, not the new anonymous conversation of the same number."""
    async with serve(tokenizer, {"a": (before := FakeInstance("a", reply(tokenizer)))}) as client:
        await client.post("/v1/chat/completions", json=chat_body(max_tokens=50))
    kept = before.calls[0].session_id
    async with serve(tokenizer, {"a": (a := FakeInstance("a", reply(tokenizer)))}) as client:
        await client.post("/v1/chat/completions", json=chat_body(max_tokens=50))
        anonymous = a.calls[0].session_id
        resp = await client.post("/v1/chat/completions", json=chat_body(max_tokens=50),
                                 headers={"X-Session-ID": kept})
        assert resp.status == 200
        record = client.server.app[CORE_KEY].sessions.get(anonymous)
    assert anonymous != kept and a.calls[1].session_id == kept
    assert record is not None and record.calls == 1  # not joined by the kept id's call


async def test_chat_streaming_with_usage(tokenizer: ModelTokenizer) -> None:
    a = FakeInstance("a", reply(tokenizer))
    async with serve(tokenizer, {"a": a}) as client:
        resp = await client.post("/v1/chat/completions", json=chat_body(
            stream=True, stream_options={"include_usage": True}, max_tokens=3))
        events = await sse(resp)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == tokenizer.decode(reply(tokenizer)[:3])
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


async def test_completions_string_and_token_prompts(tokenizer: ModelTokenizer) -> None:
    a = FakeInstance("a", reply(tokenizer))
    async with serve(tokenizer, {"a": a}) as client:
        resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 50})
        data = await resp.json()
        assert resp.status == 200 and data["object"] == "text_completion"
        assert data["choices"][0]["text"] == REPLY_TEXT
        resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 50,
                                                          "logprobs": 0})
        data = await resp.json()
        assert a.calls[1].prompt_token_ids == [5, 6, 7]
        lp = data["choices"][0]["logprobs"]
        assert "".join(lp["tokens"]) == REPLY_TEXT and lp["token_logprobs"][0] == -0.25
        resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "stream": True,
                                                          "max_tokens": 50})
        events = await sse(resp)
    assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == REPLY_TEXT
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


async def test_stop_string_truncates_and_aborts(tokenizer: ModelTokenizer) -> None:
    a = FakeInstance("a", reply(tokenizer))
    async with serve(tokenizer, {"a": a}) as client:
        for stream in (False, True):
            resp = await client.post("/v1/chat/completions", json=chat_body(stop=[" is"], stream=stream))
            if stream:
                events = await sse(resp)
                text = "".join(c["choices"][0]["delta"].get("content", "") for c in events[:-1] if c["choices"])
                assert events[-2]["choices"][0]["finish_reason"] == "stop"
            else:
                data = await resp.json()
                text = data["choices"][0]["message"]["content"]
                assert data["choices"][0]["finish_reason"] == "stop"
            assert text == "Hello world, this"
        core = client.app[CORE_KEY]
    assert a.aborted == [c.call_id for c in a.calls]
    # the answer ended at the router, whole: a call answered, not one its client left
    assert core.metrics.requests.get(model="tiny", instance="a", outcome="ok") == 2
    assert core.metrics.requests.get(model="tiny", instance="a", outcome="aborted") == 0
    prompt = len(a.calls[0].prompt_token_ids)
    assert core.metrics.prompt_tokens.get(model="tiny") == 2 * prompt
    assert core.metrics.completion_tokens.get(model="tiny") > 0
    assert core.metrics.completion_tokens.get(model="tiny") < 2 * len(reply(tokenizer))


async def test_stop_string_in_the_last_event_leaves_nothing_behind(tokenizer: ModelTokenizer) -> None:
    """A stop string in the event that also finishes the call: the instance finished it
    (nothing to abort), and the router keeps no mark of it."""
    a = FakeInstance("a", reply(tokenizer))
    assert tokenizer.decode(reply(tokenizer)[-1:]) == "."  # the last event's token
    async with serve(tokenizer, {"a": a}) as client:
        resp = await client.post("/v1/chat/completions", json=chat_body(stop=["."]))
        data = await resp.json()
        core = client.app[CORE_KEY]
    assert data["choices"][0]["message"]["content"] == "Hello world, this is a test"
    assert a.aborted == []
    assert core.metrics.requests.get(model="tiny", instance="a", outcome="ok") == 1
    assert not core._stopped


async def test_sessions_from_header_and_body(tokenizer: ModelTokenizer) -> None:
    a = FakeInstance("a", reply(tokenizer))
    async with serve(tokenizer, {"a": a}) as client:
        await client.post("/v1/chat/completions", json=chat_body(), headers={"X-Session-ID": "hdr"})
        await client.post("/v1/chat/completions", json=chat_body(session_id="body",
                                                                 talaria={"expected_gap_s": 2.0}))
        await client.post("/v1/chat/completions", json=chat_body(session_id="body", talaria={"last_call": True}))
        resp = await client.post("/v1/chat/completions", json=chat_body(session_id="x"),
                                 headers={"X-Session-ID": "y"})
        assert resp.status == 400
        core = client.app[CORE_KEY]
        assert "hdr" in core.sessions and "body" not in core.sessions
    assert [c.session_id for c in a.calls] == ["hdr", "body", "body"]
    assert a.calls[1].expected_gap_s == 2.0 and not a.calls[1].last_call
    assert a.calls[2].last_call


async def test_retry_before_first_token(tokenizer: ModelTokenizer) -> None:
    down = FakeInstance("a", reply(tokenizer), unavailable=True)
    up = FakeInstance("b", reply(tokenizer))
    async with serve(tokenizer, {"a": down, "b": up}, policy="load") as client:
        resp = await client.post("/v1/chat/completions", json=chat_body(stream=True))
        events = await sse(resp)
        assert events[-1] == "[DONE]" and len(down.calls) == 1 and len(up.calls) == 1
        health = await (await client.get("/health")).json()
        assert health["healthy_instances"] == ["b"]


async def test_error_after_first_token(tokenizer: ModelTokenizer) -> None:
    a = FakeInstance("a", reply(tokenizer), fail_after=3)
    async with serve(tokenizer, {"a": a}) as client:
        events = await sse(await client.post("/v1/chat/completions", json=chat_body(stream=True)))
        assert events[-1] == "[DONE]"
        message = events[-2]["error"]["message"]  # generic, naming the request; detail in the log
        assert message == f"the call failed on its instance; request id {a.calls[0].call_id}"
        assert not any(c.get("choices") and c["choices"][0].get("finish_reason") for c in events[:-2])
        resp = await client.post("/v1/chat/completions", json=chat_body())
        assert resp.status == 502
        error = (await resp.json())["error"]
        assert error["message"] == f"the call failed on its instance; request id {a.calls[1].call_id}"
        assert error["type"] == "server_error"  # OpenAI's type for every 5xx


async def test_503_and_429(tokenizer: ModelTokenizer) -> None:
    down = FakeInstance("a", reply(tokenizer), unavailable=True)
    async with serve(tokenizer, {"a": down}) as client:
        resp = await client.post("/v1/chat/completions", json=chat_body())
        error = (await resp.json())["error"]
        assert resp.status == 503 and error["code"] == "no_healthy_instance"
        assert error["type"] == "server_error"
        resp = await client.post("/v1/chat/completions", json=chat_body())
        assert resp.status == 503 and len(down.calls) == 1  # marked down: not tried again
    busy = FakeInstance("a", reply(tokenizer), overloaded=True)
    async with serve(tokenizer, {"a": busy}) as client:
        resp = await client.post("/v1/chat/completions", json=chat_body(stream=True))
        assert resp.status == 429 and resp.headers["Retry-After"] == "3"
        assert (await resp.json())["error"]["type"] == "rate_limit_error"


BAD_INPUTS: list[tuple[str, Any, int, str]] = [
    ("/v1/chat/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/chat/completions", [1, 2], 400, "JSON object"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, 400, "'model'"),
    ("/v1/chat/completions", {"model": 3, "messages": []}, 400, "model must be"),
    ("/v1/chat/completions", {"model": "tiny"}, 400, "'messages'"),
    ("/v1/chat/completions", {"model": "tiny", "messages": "hi"}, 400, "messages must be"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "bot", "content": "x"}]}, 400, "role"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": 5}]}, 400, "content"),
    ("/v1/chat/completions", chat_body(max_tokens=-1), 400, "max_tokens must be at least 1"),
    ("/v1/chat/completions", chat_body(user=5), 400, "user must be a string"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "user": ["u"]}, 400, "user must be a string"),
    ("/v1/completions", {"model": "tiny", "prompt": ["a", "b"]}, 400, "a batch of 2 prompts is not supported"),
    ("/v1/completions", {"model": "tiny", "prompt": [[1], [2], [3]]}, 400, "a batch of 3 prompts"),
    ("/v1/chat/completions", chat_body(max_tokens="10"), 400, "max_tokens must be an integer"),
    ("/v1/chat/completions", chat_body(max_tokens=10**9), 400, "max_tokens"),
    ("/v1/chat/completions", chat_body(max_completion_tokens=0), 400, "max_completion_tokens"),
    ("/v1/chat/completions", chat_body(temperature=3), 400, "temperature"),
    ("/v1/chat/completions", chat_body(temperature="hot"), 400, "temperature"),
    ("/v1/chat/completions", chat_body(top_p=-0.1), 400, "top_p"),
    ("/v1/chat/completions", chat_body(n=2), 400, "n=1"),
    ("/v1/chat/completions", chat_body(stop=[1]), 400, "stop"),
    ("/v1/chat/completions", chat_body(stream="yes"), 400, "stream must be a boolean"),
    ("/v1/chat/completions", chat_body(stream_options={"include_usage": True}), 400, "stream_options"),
    ("/v1/chat/completions", chat_body(seed=1.5), 400, "seed"),
    ("/v1/chat/completions", chat_body(session_id=7), 400, "session_id"),
    ("/v1/chat/completions", chat_body(talaria={"expected_gap_s": -1}), 400, "expected_gap_s"),
    ("/v1/chat/completions", chat_body(messages=[{"role": "user", "content": "word " * 300}]), 400,
     "prompt tokens"),
    ("/v1/completions", {"model": "tiny"}, 400, "'prompt'"),
    ("/v1/completions", {"model": "tiny", "prompt": 42}, 400, "prompt must be"),
    ("/v1/completions", {"model": "tiny", "prompt": [1, -2]}, 400, "token ids"),
    ("/v1/completions", {"model": "tiny", "prompt": [1, 100000]}, 400, "outside the vocabulary"),
    ("/v1/completions", {"model": "tiny", "prompt": ""}, 400, "empty"),
    ("/v1/chat/completions", {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}, 404, "gpt-9"),
    ("/v1/chat/completions", b"x" * 5000, 413, "exceeded"),
]


async def test_bad_input_battery_then_still_serving(tokenizer: ModelTokenizer) -> None:
    a = FakeInstance("a", reply(tokenizer))
    async with serve(tokenizer, {"a": a}, max_body_bytes=4096) as client:
        for path, body, status, needle in BAD_INPUTS:
            raw = body if isinstance(body, bytes) else orjson.dumps(body)
            resp = await client.post(path, data=raw, headers={"Content-Type": "application/json"})
            assert resp.status == status, (body, await resp.text())
            err = (await resp.json())["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert needle in err["message"], (needle, err)
        resp = await client.get("/v1/chat/completions")
        assert resp.status == 405 and "error" in await resp.json()
        resp = await client.post("/v1/chat/completions", json=chat_body())
        assert resp.status == 200
    assert len(a.calls) == 1


async def test_api_key(tokenizer: ModelTokenizer) -> None:
    a = FakeInstance("a", reply(tokenizer))
    async with serve(tokenizer, {"a": a}, api_key="sekret") as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            resp = await client.post("/v1/chat/completions", json=chat_body(), headers=headers)
            assert resp.status == 401
            assert (await resp.json())["error"]["code"] == "invalid_api_key"
        resp = await client.post("/v1/chat/completions", json=chat_body(),
                                 headers={"Authorization": "Bearer sekret"})
        assert resp.status == 200
        assert (await client.get("/health")).status == 200  # health needs no key
        assert (await client.get("/metrics")).status == 401  # metrics show states and sessions
        metrics = await client.get("/metrics", headers={"Authorization": "Bearer sekret"})
        assert metrics.status == 200 and "talaria" in await metrics.text()


@pytest.mark.parametrize("key", ["", "   ", "sekret\n"])
def test_a_key_no_client_can_send_is_refused_not_read_as_no_key(key: str) -> None:
    """An empty key used to turn authentication off in silence; one with spaces around it
    could never match (headers are read stripped)."""
    with pytest.raises(ValueError, match="api_key"):
        RouterConfig(models={"tiny": "/unused"}, instances={}, api_key=key)


async def test_models_health_metrics(tokenizer: ModelTokenizer) -> None:
    a = FakeInstance("a", reply(tokenizer), cached_tokens=2,
                     state=InstanceState("a", kv_demotions=3, staging_lends=1))
    async with serve(tokenizer, {"a": a}) as client:
        models = await (await client.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["tiny"]
        assert models["data"][0]["max_model_len"] == 256
        await client.post("/v1/chat/completions", json=chat_body(), headers={"X-Session-ID": "s"})
        await asyncio.sleep(0.01)  # the post-call state refresh
        text = await (await client.get("/metrics")).text()
    assert 'talaria_router_requests_total{instance="a",model="tiny",outcome="ok"} 1' in text
    assert 'talaria_router_cached_tokens_total{model="tiny"} 2' in text
    assert 'talaria_router_ttft_seconds_count{model="tiny"} 1' in text
    assert 'talaria_instance_healthy{instance="a"} 1' in text
    assert "talaria_router_sessions 1" in text
    assert 'talaria_instance_kv_demotions{instance="a"} 3' in text
    assert 'talaria_instance_staging_lends{instance="a"} 1' in text


async def test_an_instance_that_never_reported_shows_as_unhealthy_not_as_nothing(
    tokenizer: ModelTokenizer,
) -> None:
    """The health gauge was written for the instances with a report or in the healthy set,
    so one down since the start (its first poll failed: it never reported) vanished from
    /metrics, and an alert on ``talaria_instance_healthy == 0`` never fired for it. Every
    configured instance has its gauge."""
    a = FakeInstance("a", reply(tokenizer))
    b = FakeInstance("b", reply(tokenizer), unavailable=True)
    async with serve(tokenizer, {"a": a, "b": b}) as client:
        core = client.server.app[CORE_KEY]
        assert await core.refresh("a") and not await core.refresh("b")
        text = await (await client.get("/metrics")).text()
    assert 'talaria_instance_healthy{instance="a"} 1' in text
    assert 'talaria_instance_healthy{instance="b"} 0' in text


async def test_client_disconnect_aborts_call(tokenizer: ModelTokenizer) -> None:
    hold = asyncio.Event()
    a = FakeInstance("a", reply(tokenizer), hold=hold)
    async with serve(tokenizer, {"a": a}) as client:
        resp = await client.post("/v1/chat/completions", json=chat_body(stream=True))
        assert resp.status == 200
        await resp.content.readuntil(b"\n\n")  # the role chunk
        resp.close()  # the client goes away mid-stream
        hold.set()
        for _ in range(100):
            if a.aborted:
                break
            await asyncio.sleep(0.01)
    assert a.aborted == [a.calls[0].call_id]


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="unknown placement policy"):
        RouterConfig(models={"m": "/x"}, instances={}, policy="random")
    with pytest.raises(ValueError, match="at least one model"):
        RouterConfig(models={}, instances={})
    with pytest.raises(ValueError, match="max_model_lens"):
        RouterConfig(models={"m": "/x"}, instances={}, max_model_lens={"z": 5})


async def test_concurrent_sessions_all_complete(tokenizer: ModelTokenizer) -> None:
    a = FakeInstance("a", reply(tokenizer))
    b = FakeInstance("b", reply(tokenizer))
    async with serve(tokenizer, {"a": a, "b": b}, policy="cache_aware") as client:
        async def one(i: int) -> str:
            resp = await client.post("/v1/chat/completions", json=chat_body(stream=i % 2 == 0),
                                     headers={"X-Session-ID": f"s{i % 4}"})
            if i % 2 == 0:
                events = await sse(resp)
                return "".join(c["choices"][0]["delta"].get("content", "") for c in events[:-1] if c["choices"])
            return (await resp.json())["choices"][0]["message"]["content"]

        texts = await asyncio.gather(*(one(i) for i in range(12)))
        core = client.app[CORE_KEY]
        assert all(v == 0 for v in core.context.outstanding_tokens.values())
        assert all(v == 0 for v in core.context.outstanding_prefill.values())
        assert {r.session_id: r.calls for r in map(core.sessions.get, ["s0", "s1", "s2", "s3"])} == {
            "s0": 3, "s1": 3, "s2": 3, "s3": 3}
    assert texts == [REPLY_TEXT] * 12
    assert len(a.calls) + len(b.calls) == 12


async def test_a_streamed_call_does_not_start_a_task_per_event(tokenizer: ModelTokenizer) -> None:
    """Noticing a client that leaves takes one watcher per call, not a task per event."""
    a = FakeInstance("a", list(reply(tokenizer)) * 40)
    loop = asyncio.get_running_loop()
    created: list[str] = []

    def counting(loop: asyncio.AbstractEventLoop, coro: Any, **kw: Any) -> asyncio.Task[Any]:
        created.append(getattr(coro, "__qualname__", ""))
        return asyncio.Task(coro, loop=loop, **kw)

    async with serve(tokenizer, {"a": a}) as client:
        loop.set_task_factory(counting)
        try:
            events = await sse(await client.post(
                "/v1/chat/completions", json=chat_body(stream=True, max_tokens=200)))
        finally:
            loop.set_task_factory(None)
    streamed = sum(1 for e in events if e != "[DONE]")
    assert streamed > 100 and len(created) < 20, (streamed, created[:10])
