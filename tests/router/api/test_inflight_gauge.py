"""The router's calls in flight, which its 429 cap reads, are exported beside that cap."""

from __future__ import annotations

import asyncio

from api_helpers import chat_body, reply, serve
from router_fakes import FakeInstance

from router.limits import RouterLimits
from router.tokenization import ModelTokenizer


def _gauge(text: str, name: str) -> float:
    (value,) = [line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")]
    return float(value)


async def test_the_calls_in_flight_are_a_gauge(tokenizer: ModelTokenizer) -> None:
    hold = asyncio.Event()
    a = FakeInstance("a", reply(tokenizer), hold=hold)
    async with serve(tokenizer, {"a": a}, limits=RouterLimits(max_inflight_calls=7)) as client:
        text = await (await client.get("/metrics")).text()
        assert _gauge(text, "talaria_router_calls_in_flight") == 0
        assert _gauge(text, "talaria_router_max_calls_in_flight") == 7
        calls = [asyncio.ensure_future(client.post("/v1/chat/completions", json=chat_body()))
                 for _ in range(2)]
        for _ in range(200):
            if len(a.calls) == 2:
                break
            await asyncio.sleep(0.01)
        text = await (await client.get("/metrics")).text()
        assert _gauge(text, "talaria_router_calls_in_flight") == 2
        hold.set()
        for response in await asyncio.gather(*calls):
            assert response.status == 200
        text = await (await client.get("/metrics")).text()
        assert _gauge(text, "talaria_router_calls_in_flight") == 0
