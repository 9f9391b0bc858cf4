"""The instance's internal API end to end on a real MultiModelEngine (two tiny models, CPU),
served in-process by aiohttp's TestServer and spoken to by the router's HttpInstanceClient:
sessions alternating between models, streaming, abort on disconnect and on request (blocks
freed afterwards), 429 on a full queue, bad requests answered with JSON errors and nothing
leaked, graceful shutdown."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from engine.models.tiny import make_tiny_models
from engine.multi_model.engine import MultiModelConfig, MultiModelEngine
from router.core import CallRejected
from router.instances.http import HttpInstanceClient
from talaria.instance.instance import Instance
from talaria.policies.config import PolicyConfig
from talaria.protocol import CallEvent, CallRequest, InstanceState, Overloaded, SamplingParams
from talaria.protocol.drain import DRAIN_HURRY_KEY
from talaria.serving.instance_server import (
    INFLIGHT_KEY,
    INSTANCE_KEY,
    InstanceServerSettings,
    create_instance_app,
    engine_limits,
)

pytestmark = pytest.mark.slow

LLAMA, QWEN = "tiny-llama", "tiny-qwen3"
NUM_BLOCKS = 128
BLOCK = 16


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    paths = make_tiny_models(tmp_path_factory.mktemp("e2e-models"))
    return {LLAMA: paths[LLAMA], QWEN: paths[QWEN]}


def make_instance(models: dict[str, Path], **policy: object) -> Instance:
    engine = MultiModelEngine(
        models,
        MultiModelConfig(device="cpu", block_size=BLOCK, num_kv_blocks=NUM_BLOCKS,
                         host_kv_bytes=8 << 20),
    )
    return Instance("e2e", engine, PolicyConfig(slot_quantum_s=0.5, **policy))  # type: ignore[arg-type]


async def serve(
    instance: Instance, drain_timeout_s: float = 5.0
) -> tuple[web.Application, TestServer]:
    settings = InstanceServerSettings(
        limits=engine_limits(instance.engine), drain_timeout_s=drain_timeout_s,
        disconnect_poll_s=0.05,
    )
    app = create_instance_app(instance, settings)
    server = TestServer(app)
    await server.start_server()
    return app, server


@pytest.fixture
async def served(models: dict[str, Path]) -> AsyncIterator[tuple[web.Application, TestServer]]:
    app, server = await serve(make_instance(models))
    try:
        yield app, server
    finally:
        await server.close()


def call(cid: str, session: str, model: str, prompt: list[int], max_tokens: int = 6,
         **params: object) -> CallRequest:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **params)  # type: ignore[arg-type]
    return CallRequest(cid, session, model, prompt, sp)


async def state_of(server: TestServer) -> InstanceState:
    async with aiohttp.ClientSession() as http:
        async with http.get(server.make_url("/internal/v1/state")) as r:
            assert r.status == 200
            return InstanceState.from_dict(orjson.loads(await r.read()))


async def wait_idle(app: web.Application, server: TestServer) -> InstanceState:
    """Until no call is in flight and the engine's view shows none running."""
    for _ in range(200):
        state = await state_of(server)
        running = sum(m.running_calls + m.queued_calls for m in state.models.values())
        if running == 0 and not app[INFLIGHT_KEY].handles:
            return state
        await asyncio.sleep(0.05)
    raise AssertionError(f"calls still in flight: {state}")


def assert_blocks_free(state: InstanceState) -> None:
    """Every block is free except those pinned by soft reservations of finished calls."""
    assert state.total_kv_blocks == NUM_BLOCKS
    assert state.free_kv_blocks + state.reserved_kv_blocks == state.total_kv_blocks, state


async def test_sessions_alternate_between_models_and_stream(
    served: tuple[web.Application, TestServer],
) -> None:
    app, server = served
    client = HttpInstanceClient("e2e", str(server.make_url("/")))
    try:
        prompts = {LLAMA: list(range(3, 40)), QWEN: list(range(50, 90))}
        outputs: dict[str, list[list[int]]] = {LLAMA: [], QWEN: []}
        usages = {LLAMA: [], QWEN: []}  # type: dict[str, list]
        for turn in range(3):
            for model in (LLAMA, QWEN):  # every turn switches model twice
                events: list[CallEvent] = [
                    e async for e in client.submit(call(f"{model}-{turn}", f"s-{model}", model,
                                                        prompts[model]))
                ]
                assert len(events) >= 2, "tokens arrive as a stream, not one blob"
                assert all(not e.finished for e in events[:-1]) and events[-1].finished
                out = [t for e in events for t in e.token_ids]
                assert len(out) == 6 and events[-1].finish_reason == "length"
                usage = events[-1].usage
                assert usage is not None and usage.prompt_tokens == len(prompts[model])
                assert usage.completion_tokens == 6
                outputs[model].append(out)
                usages[model].append(usage)
                # The agent's next prompt: previous prompt + output + a tool result.
                prompts[model] = prompts[model] + out + [7, 8, 9, 10 + turn]
        # Continuations reuse the session's KV (restored from host after each switch).
        for model in (LLAMA, QWEN):
            assert all(u.cached_tokens >= BLOCK for u in usages[model][1:]), usages[model]
        state = await wait_idle(app, server)
        assert state.switches >= 5
        assert set(state.models) == {LLAMA, QWEN}
        assert_blocks_free(state)
        # Greedy and deterministic: the first prompt again gives the first output again.
        again = [e async for e in client.submit(call("again", "s-x", LLAMA, list(range(3, 40))))]
        assert [t for e in again for t in e.token_ids] == outputs[LLAMA][0]
    finally:
        await client.close()


async def test_a_call_beyond_the_kv_region_runs_with_the_staging_region_lent(
    served: tuple[web.Application, TestServer],
) -> None:
    """A prompt of 2100 tokens needs 132 blocks where the model's KV region has 128: the
    instance accepts it (until the reported capacity counted the lent region, its API
    refused it with a 400), lends the staging region to the KV cache at the switch to the
    model, and serves it."""
    app, server = served
    client = HttpInstanceClient("e2e", str(server.make_url("/")))
    prompt = [3 + (i * 7) % 400 for i in range(2100)]
    try:
        events = [e async for e in client.submit(call("long-prompt", "s-lp", QWEN, prompt, 4))]
    finally:
        await client.close()
    assert events[-1].finished and events[-1].finish_reason == "length"
    assert events[-1].error is None
    assert sum(len(e.token_ids) for e in events) == 4
    state = await wait_idle(app, server)
    assert state.staging_lends == 1
    assert state.total_kv_blocks > NUM_BLOCKS  # the lent view stays until the next switch


async def test_an_answer_that_may_outgrow_the_kv_region_runs_in_the_lent_region(
    served: tuple[web.Application, TestServer],
) -> None:
    """1500 prompt tokens and up to 1600 of answer fit only with the staging region lent
    (3100 tokens; the region holds 2048): the call is admitted only once it is lent and
    gives its whole answer (admitted into the KV region alone, the engine refused it: "may
    grow to 3100 tokens; the KV cache holds at most 2048")."""
    app, server = served
    client = HttpInstanceClient("e2e", str(server.make_url("/")))
    prompt = [3 + (i * 11) % 400 for i in range(1500)]
    try:
        async with asyncio.timeout(20):
            events = [e async for e in client.submit(call("long-answer", "s-la", QWEN, prompt,
                                                          1600))]
    finally:
        await client.close()
    assert events[-1].finish_reason == "length" and events[-1].error is None
    assert sum(len(e.token_ids) for e in events) == 1600
    assert (await wait_idle(app, server)).staging_lends == 1


async def test_client_disconnect_aborts_and_frees_blocks(
    served: tuple[web.Application, TestServer],
) -> None:
    app, server = served
    body = orjson.dumps(call("long", "s-long", QWEN, list(range(5, 25)), max_tokens=1500).to_dict())
    async with aiohttp.ClientSession() as http:
        response = await http.post(server.make_url("/internal/v1/calls"), data=body)
        assert response.status == 200
        first = CallEvent.from_dict(orjson.loads(await response.content.readline()))
        assert first.call_id == "long" and not first.finished
        mid = await state_of(server)
        assert mid.models[QWEN].running_calls == 1
        assert mid.free_kv_blocks < NUM_BLOCKS
        response.close()  # the client goes away mid-stream
    state = await wait_idle(app, server)
    assert_blocks_free(state)
    assert state.reserved_kv_blocks == 0  # an aborted call leaves no reservation


async def test_abort_endpoint_ends_the_stream(served: tuple[web.Application, TestServer]) -> None:
    app, server = served
    client = HttpInstanceClient("e2e", str(server.make_url("/")))
    try:
        stream = client.submit(call("to-abort", "s-a", LLAMA, list(range(9, 30)), max_tokens=1500))
        first = await anext(stream)
        assert not first.finished
        await client.abort("to-abort")
        rest = [e async for e in stream]
        assert rest[-1].finished and rest[-1].finish_reason == "abort"
        assert len(first.token_ids) + sum(len(e.token_ids) for e in rest) < 1500
    finally:
        await client.close()
    assert_blocks_free(await wait_idle(app, server))


async def test_full_queue_answers_429_with_retry_after(models: dict[str, Path]) -> None:
    app, server = await serve(make_instance(models, max_queue_calls=1, max_running_calls=1))
    client = HttpInstanceClient("e2e", str(server.make_url("/")))
    try:
        running = client.submit(call("r", "s-r", LLAMA, list(range(3, 20)), max_tokens=1500))
        assert not (await anext(running)).finished  # admitted and decoding
        queued = asyncio.ensure_future(
            anext(aiter(client.submit(call("q", "s-q", LLAMA, list(range(3, 20)))))))
        for _ in range(100):  # until the second call sits in the queue
            if (await state_of(server)).models[LLAMA].queued_calls == 1:
                break
            await asyncio.sleep(0.02)
        async with aiohttp.ClientSession() as http:
            body = orjson.dumps(call("x", "s-x", LLAMA, [5, 6, 7]).to_dict())
            async with http.post(server.make_url("/internal/v1/calls"), data=body) as r:
                assert r.status == 429
                assert int(r.headers["Retry-After"]) >= 1
                data = orjson.loads(await r.read())
                assert data["retry_after_s"] >= 1.0 and "max_queue_calls=1" in data["error"]["message"]
        with pytest.raises(Overloaded):
            [e async for e in client.submit(call("y", "s-y", LLAMA, [5, 6, 7]))]
        await client.abort("r")
        assert (await queued).call_id == "q"  # the queued call runs once the first is gone
        await running.aclose()
    finally:
        await client.close()
        await wait_idle(app, server)
        await server.close()


async def post_raw(server: TestServer, body: bytes) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.post(server.make_url("/internal/v1/calls"), data=body) as r:
            assert r.headers["Content-Type"].startswith("application/json")
            return r.status, orjson.loads(await r.read())


async def test_bad_requests_get_clear_json_errors_and_leak_nothing(
    served: tuple[web.Application, TestServer],
) -> None:
    app, server = served
    good = call("ok", "s", LLAMA, [3, 4, 5]).to_dict()
    engine = app[INSTANCE_KEY].engine
    lent = engine.kv_capacity_blocks(LLAMA, lent=True) * BLOCK
    assert lent > NUM_BLOCKS * BLOCK  # the talaria policy lends its staging region
    cases: list[tuple[bytes, int, str]] = [
        (b"", 400, "empty"),
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (orjson.dumps({k: v for k, v in good.items() if k != "model"}), 400, "model"),
        (orjson.dumps({**good, "model": "gpt-9"}), 404, "'gpt-9' is not served"),
        (orjson.dumps({**good, "prompt_token_ids": list(range(5000))}), 400, "at most 4095"),
        (orjson.dumps({**good, "prompt_token_ids": [3, 99999]}), 400, "outside the vocabulary"),
        (orjson.dumps({**good, "prompt_token_ids": []}), 400, "empty"),
        (orjson.dumps({**good, "prompt_token_ids": ["a"]}), 400, "list of integers"),
        (orjson.dumps({**good, "params": {**good["params"], "temperature": -1}}), 400, "temperature"),
        (orjson.dumps({**good, "params": {**good["params"], "max_tokens": 0}}), 400, "max_tokens"),
        (orjson.dumps({**good, "params": {"beam_width": 4}}), 400, "beam_width"),
        # Within the context (4096) but beyond what one call's KV can hold (its 128 blocks of
        # 16 with the staging region lent to them): it would be accepted and then failed.
        (orjson.dumps({**good, "params": {**good["params"], "max_tokens": lent + 1}}), 400,
         f"the KV cache of instance 'e2e' holds {lent} tokens"),
        # 1020 levels (orjson reads up to 1024): the seed's error message was a RecursionError
        (orjson.dumps({**good, "params": {"seed": 0}}).replace(
            b'"seed":0', b'"seed":' + b"[" * 1020 + b"0" + b"]" * 1020), 400,
         "params.seed[0] is nested more than 64 levels deep"),
    ]
    for body, status, needle in cases:
        got, data = await post_raw(server, body)
        assert got == status, (body[:60], data)
        assert needle in data["error"]["message"], (needle, data)
        assert data["error"]["type"]
    async with aiohttp.ClientSession() as http:
        async with http.get(server.make_url("/no/such/route")) as r:
            assert r.status == 404 and "error" in orjson.loads(await r.read())
    state = await wait_idle(app, server)
    assert state.models[LLAMA].queued_calls == 0 and state.switches == 0
    assert state.models[LLAMA].kv_capacity_tokens == lent
    # Still serving after all that.
    client = HttpInstanceClient("e2e", str(server.make_url("/")))
    try:
        events = [e async for e in client.submit(CallRequest.from_dict(good))]
        assert events[-1].finish_reason == "length"
        with pytest.raises(CallRejected) as info:
            [e async for e in client.submit(call("z", "s", "gpt-9", [1]))]
        assert info.value.status == 404
    finally:
        await client.close()
    assert_blocks_free(await wait_idle(app, server))


async def test_shutdown_drains_in_flight_calls(models: dict[str, Path]) -> None:
    app, server = await serve(make_instance(models), drain_timeout_s=30.0)
    client = HttpInstanceClient("e2e", str(server.make_url("/")))
    stream = client.submit(call("d", "s-d", LLAMA, list(range(3, 20)), max_tokens=40))
    first = await anext(stream)
    rest_task = asyncio.ensure_future(_collect(stream))
    await asyncio.sleep(0)
    await server.close()  # drains: the in-flight call finishes
    rest = await rest_task
    await client.close()
    assert rest[-1].finish_reason == "length"
    assert len(first.token_ids) + sum(len(e.token_ids) for e in rest) == 40
    assert not app[INFLIGHT_KEY].handles


async def test_shutdown_aborts_calls_past_the_drain_timeout(models: dict[str, Path]) -> None:
    app, server = await serve(make_instance(models), drain_timeout_s=0.2)
    client = HttpInstanceClient("e2e", str(server.make_url("/")))
    stream = client.submit(call("d", "s-d", LLAMA, list(range(3, 20)), max_tokens=1500))
    await anext(stream)
    rest_task = asyncio.ensure_future(_collect(stream))
    await asyncio.sleep(0)
    await server.close()
    rest = await rest_task
    await client.close()
    assert rest[-1].finish_reason == "abort"
    assert not app[INFLIGHT_KEY].handles


async def _collect(stream: AsyncIterator[CallEvent]) -> list[CallEvent]:
    return [e async for e in stream]


async def test_client_leaving_while_queued_drops_its_call(models: dict[str, Path]) -> None:
    app, server = await serve(make_instance(models, max_running_calls=1))
    client = HttpInstanceClient("e2e", str(server.make_url("/")))
    try:
        running = client.submit(call("r", "s-r", LLAMA, list(range(3, 20)), max_tokens=1500))
        assert not (await anext(running)).finished
        async with aiohttp.ClientSession() as http:
            body = orjson.dumps(call("q", "s-q", LLAMA, list(range(3, 20))).to_dict())
            response = await http.post(server.make_url("/internal/v1/calls"), data=body)
            assert response.status == 200  # headers go out at once; no event yet
            for _ in range(100):
                if (await state_of(server)).models[LLAMA].queued_calls == 1:
                    break
                await asyncio.sleep(0.02)
            response.close()  # gone before its call was ever admitted
        for _ in range(100):
            if "q" not in app[INFLIGHT_KEY].handles:
                break
            await asyncio.sleep(0.02)
        state = await state_of(server)
        assert state.models[LLAMA].queued_calls == 0 and state.models[LLAMA].running_calls == 1
        await client.abort("r")
        await running.aclose()
    finally:
        await client.close()
        await wait_idle(app, server)
        await server.close()


async def test_a_second_signal_cuts_the_drain_short(models: dict[str, Path]) -> None:
    """The drain would wait ten minutes for the call; a second signal (the hurry event
    `talaria instance` sets) ends it at once, aborted."""
    instance = make_instance(models)
    settings = InstanceServerSettings(limits=engine_limits(instance.engine), drain_timeout_s=600.0,
                                      disconnect_poll_s=0.05)
    app = create_instance_app(instance, settings)
    hurry = asyncio.Event()
    app[DRAIN_HURRY_KEY] = hurry
    server = TestServer(app)
    await server.start_server()
    client = HttpInstanceClient("e2e", str(server.make_url("/")))
    stream = client.submit(call("d", "s-d", LLAMA, list(range(3, 20)), max_tokens=1500))
    await anext(stream)
    rest_task = asyncio.ensure_future(_collect(stream))
    asyncio.get_running_loop().call_later(0.3, hurry.set)
    await server.close()
    rest = await rest_task
    await client.close()
    assert rest[-1].finish_reason == "abort"
    assert not app[INFLIGHT_KEY].handles
