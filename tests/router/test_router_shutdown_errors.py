"""A call still in flight when the router's drain timeout passes at shut-down ends as any
failed call does: a stream gets its error event and ``[DONE]`` (it was a silently truncated
body: the connection closed mid-stream), a call not answered yet gets a 503 (it was a closed
connection with no status at all), and its instance is told to abort it. Timed on the
virtual clock."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import orjson
from router_fakes import FakeInstance

from router.app import RouterConfig, create_app
from router.tokenization import ModelTokenizer
from talaria.clock import VIRTUAL_CLOCK_RESOLUTION_S, run_virtual
from talaria.protocol import CallEvent, CallRequest
from talaria.serving.config import ServeConfig
from talaria.serving.serve import _start_router


class SilentInstance(FakeInstance):
    """Takes every call and never gives its first event."""

    async def submit(self, call: CallRequest) -> AsyncIterator[CallEvent]:
        self.calls.append(call)
        await asyncio.Event().wait()
        yield CallEvent(call_id=call.call_id)  # never reached


async def _shut_down_mid_call(
    tokenizer: ModelTokenizer, inst: FakeInstance, stream: bool, commit_s: float | None = 10.0
) -> tuple[int, bytes, float, list[str]]:
    """One call held on ``inst`` while the router shuts down with a 1 s drain: its status,
    its body as the client read it, how long the shut-down took, the calls aborted."""
    config = RouterConfig(models={"tiny": "/unused"}, instances={"i0": ""}, poll_interval_s=None,
                          drain_timeout_s=1.0, stream_commit_s=commit_s)
    app = create_app(config, {"i0": inst}, tokenizers={"tiny": tokenizer})
    runner = await _start_router(ServeConfig.from_dict({"router": {"port": 0}}), app)
    url = f"http://127.0.0.1:{runner.addresses[-1][1]}/v1/completions"
    body = orjson.dumps({"model": "tiny", "prompt": "Hello world", "max_tokens": 8, "stream": stream})
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:

        async def client() -> tuple[int, bytes]:
            async with http.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
                data = b""
                try:
                    async for chunk in resp.content.iter_any():
                        data += chunk
                except aiohttp.ClientPayloadError:
                    data += b"<truncated>"
                return resp.status, data

        task = asyncio.ensure_future(client())
        while not inst.calls:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        start = loop.time()
        await runner.cleanup()
        waited = loop.time() - start
        try:
            status, data = await task
        except aiohttp.ClientError as exc:
            status, data = 0, repr(exc).encode()
    return status, data, waited, inst.aborted


def test_a_stream_past_the_drain_gets_its_error_event_and_done(tokenizer: ModelTokenizer) -> None:
    inst = FakeInstance("i0", list(range(10, 20)), hold=asyncio.Event())
    status, data, waited, aborted = run_virtual(_shut_down_mid_call(tokenizer, inst, stream=True))
    assert status == 200
    events = [line for line in data.split(b"\n") if line.startswith(b"data: ")]
    assert b"<truncated>" not in data, data
    assert events[-1] == b"data: [DONE]", data
    assert b'"error"' in events[-2], data
    assert b"server is shutting down" in events[-2] and b"server_shutting_down" in events[-2], data
    assert aborted == [inst.calls[0].call_id]
    assert 1.0 - VIRTUAL_CLOCK_RESOLUTION_S <= waited < 1.5  # the drain, then the cut


def test_a_collected_call_cut_mid_answer_by_the_drain_is_told_the_server_shuts_down(
    tokenizer: ModelTokenizer,
) -> None:
    """Its first tokens came, then the drain ended: a 503 saying the server is shutting down
    (it read "the call failed on its instance", a 502, as if the instance had failed)."""
    inst = FakeInstance("i0", list(range(10, 20)), hold=asyncio.Event())
    status, data, _waited, aborted = run_virtual(_shut_down_mid_call(tokenizer, inst, stream=False))
    assert status == 503, data
    error = orjson.loads(data)["error"]
    assert error["code"] == "server_shutting_down" and "server is shutting down" in error["message"]
    assert aborted == [inst.calls[0].call_id]


def test_a_call_not_answered_by_the_drain_gets_a_503(tokenizer: ModelTokenizer) -> None:
    inst = SilentInstance("i0", [])
    status, data, waited, aborted = run_virtual(_shut_down_mid_call(tokenizer, inst, stream=False))
    assert status == 503, data
    assert b"shutting down" in data
    assert aborted == [inst.calls[0].call_id]
    assert 1.0 - VIRTUAL_CLOCK_RESOLUTION_S <= waited < 1.5  # the drain, then the cut


def test_a_committed_stream_not_answered_by_the_drain_gets_its_error_event(
    tokenizer: ModelTokenizer,
) -> None:
    inst = SilentInstance("i0", [])
    status, data, _waited, aborted = run_virtual(
        _shut_down_mid_call(tokenizer, inst, stream=True, commit_s=0.0))
    assert status == 200
    assert data.rstrip().endswith(b"data: [DONE]"), data
    assert b"shutting down" in data
    assert aborted == [inst.calls[0].call_id]
