"""At shut-down the router gives the calls in flight its drain timeout (in `talaria serve`:
the instances' longest ``drain_timeout_s``), not aiohttp's default minute (twice over: it
waits, asks, then waits again), then cancels them and each aborts itself on its instance.
Timed on the virtual clock."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import orjson
import pytest
from router_fakes import FakeInstance

from router.app import CONFIG_KEY, RouterConfig, create_app
from router.limits import InflightGate
from router.tokenization import ModelTokenizer
from talaria.cli import _router_app
from talaria.clock import run_virtual
from talaria.serving.config import InstanceEntry, ModelEntry, ServeConfig
from talaria.serving.serve import _start_router


def test_the_gate_lets_calls_finish_for_the_drain_then_cancels_the_rest() -> None:
    async def main() -> tuple[dict[str, float], float, int]:
        loop = asyncio.get_running_loop()
        gate = InflightGate(8, 1.0)
        ended: dict[str, float] = {}

        async def call(name: str, takes_s: float) -> None:
            with gate.admit():
                try:
                    await asyncio.sleep(takes_s)
                    ended[name] = loop.time()
                except asyncio.CancelledError:
                    ended[f"{name} cancelled"] = loop.time()
                    await asyncio.sleep(0.5)  # its abort on the instance
                    raise

        tasks = [asyncio.ensure_future(call("quick", 1.0)), asyncio.ensure_future(call("endless", 3600.0))]
        await asyncio.sleep(0)
        await gate.drain(2.0, grace_s=5.0)
        await asyncio.gather(*tasks, return_exceptions=True)
        return ended, loop.time(), gate.inflight

    ended, now, inflight = run_virtual(main())
    assert ended == {"quick": pytest.approx(1.0), "endless cancelled": pytest.approx(2.0)}
    assert now == pytest.approx(2.5) and inflight == 0


async def _shutdown(tokenizer: ModelTokenizer, drain_s: float) -> tuple[float, list[str]]:
    """A streamed call held after its first token when the router (as `talaria serve` runs
    it) shuts down: how long the shut-down took, and the calls its instance was told to abort."""
    inst = FakeInstance("i0", list(range(10, 20)), hold=asyncio.Event())
    config = RouterConfig(models={"tiny": "/unused"}, instances={"i0": ""}, poll_interval_s=None,
                          drain_timeout_s=drain_s)
    app = create_app(config, {"i0": inst}, tokenizers={"tiny": tokenizer})
    serve_config = ServeConfig.from_dict({"router": {"port": 0}})
    loop = asyncio.get_running_loop()
    runner = await _start_router(serve_config, app)
    url = f"http://127.0.0.1:{runner.addresses[-1][1]}/v1/completions"
    body = orjson.dumps({"model": "tiny", "prompt": "Hello world", "max_tokens": 8, "stream": True})
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
        async with http.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 200
            await resp.content.readline()  # the first token's event
            start = loop.time()
            await runner.cleanup()
            waited = loop.time() - start
    return waited, inst.aborted


@pytest.mark.parametrize("drain_s", [2.0, 0.0])
def test_a_call_in_flight_gets_the_drain_timeout_then_is_aborted_on_its_instance(
    tokenizer: ModelTokenizer, drain_s: float, capsys: pytest.CaptureFixture[str],
) -> None:
    waited, aborted = run_virtual(_shutdown(tokenizer, drain_s))
    assert len(aborted) == 1
    assert drain_s <= waited < drain_s + 0.5


def test_serve_gives_the_router_its_instances_longest_drain(model_dir: Path) -> None:
    config = ServeConfig(models={"tiny": ModelEntry(str(model_dir))},
                         instances=[InstanceEntry("a", port=9901, drain_timeout_s=3.0),
                                    InstanceEntry("b", port=9902, drain_timeout_s=7.0)])
    app = _router_app(config, {"a": "http://127.0.0.1:9901", "b": "http://127.0.0.1:9902"})
    assert app[CONFIG_KEY].drain_timeout_s == 7.0
