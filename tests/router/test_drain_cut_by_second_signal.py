"""A second SIGINT / SIGTERM cuts a shut-down's drain short: the router stops waiting for
the calls in flight, ends them as at its drain timeout (each aborted on its instance), and
returns; the first signal alone leaves them their whole drain. Timed on the virtual clock."""

from __future__ import annotations

import asyncio
import os
import signal

import aiohttp
import orjson
import pytest
from router_fakes import FakeInstance

from router.app import RouterConfig, create_app
from router.limits import InflightGate
from router.tokenization import ModelTokenizer
from talaria.clock import run_virtual
from talaria.protocol.drain import DRAIN_HURRY_KEY
from talaria.serving.config import ServeConfig
from talaria.serving.serve import _start_router
from talaria.serving.signals import ShutdownSignals


def test_the_gate_stops_waiting_when_hurried_and_cancels_what_is_left() -> None:
    async def main() -> tuple[dict[str, float], float]:
        loop = asyncio.get_running_loop()
        gate = InflightGate(8, 1.0)
        hurry = asyncio.Event()
        ended: dict[str, float] = {}

        async def call(name: str, takes_s: float) -> None:
            with gate.admit():
                try:
                    await asyncio.sleep(takes_s)
                    ended[name] = loop.time()
                except asyncio.CancelledError:
                    ended[f"{name} cancelled"] = loop.time()
                    raise

        tasks = [asyncio.ensure_future(call("quick", 1.0)), asyncio.ensure_future(call("endless", 3600.0))]
        await asyncio.sleep(0)
        loop.call_later(5.0, hurry.set)
        await gate.drain(600.0, grace_s=2.0, hurry=hurry)
        await asyncio.gather(*tasks, return_exceptions=True)
        return ended, loop.time()

    ended, now = run_virtual(main())
    assert ended == {"quick": pytest.approx(1.0), "endless cancelled": pytest.approx(5.0)}
    assert now == pytest.approx(5.0)


def test_a_gate_hurried_before_its_drain_does_not_wait() -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        gate = InflightGate(8, 1.0)
        hurry = asyncio.Event()
        hurry.set()

        async def endless() -> None:
            with gate.admit():
                await asyncio.sleep(3600.0)

        task = asyncio.ensure_future(endless())
        await asyncio.sleep(0)
        cut: list[int] = []
        await gate.drain(600.0, grace_s=2.0, cut=lambda: cut.append(1), hurry=hurry)
        await asyncio.gather(task, return_exceptions=True)
        assert cut == [1]  # ended as at the timeout: waiting calls cut first
        return loop.time()

    assert run_virtual(main()) == pytest.approx(2.0)  # only the cut's grace


async def _shutdown(tokenizer: ModelTokenizer, hurry_after_s: float | None) -> tuple[float, list[str]]:
    """A streamed call held after its first token when the router shuts down with a 30 s
    drain (within the call's 60 s stall deadline), hurried ``hurry_after_s`` into it: how long the shut-down took and what its
    instance was told to abort."""
    inst = FakeInstance("i0", list(range(10, 20)), hold=asyncio.Event())
    config = RouterConfig(models={"tiny": "/unused"}, instances={"i0": ""}, poll_interval_s=None,
                          drain_timeout_s=30.0)
    app = create_app(config, {"i0": inst}, tokenizers={"tiny": tokenizer})
    hurry = asyncio.Event()
    app[DRAIN_HURRY_KEY] = hurry
    loop = asyncio.get_running_loop()
    runner = await _start_router(ServeConfig.from_dict({"router": {"port": 0}}), app)
    url = f"http://127.0.0.1:{runner.addresses[-1][1]}/v1/completions"
    body = orjson.dumps({"model": "tiny", "prompt": "Hello world", "max_tokens": 8, "stream": True})
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
        async with http.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 200
            await resp.content.readline()  # the first token's event
            start = loop.time()
            if hurry_after_s is not None:
                loop.call_later(hurry_after_s, hurry.set)
            else:
                loop.call_later(40.0, inst.hold.set)  # type: ignore[union-attr]
            await runner.cleanup()
            waited = loop.time() - start
    return waited, inst.aborted


def test_a_hurried_router_ends_its_calls_in_flight_and_stops(tokenizer: ModelTokenizer) -> None:
    waited, aborted = run_virtual(_shutdown(tokenizer, hurry_after_s=3.0))
    assert len(aborted) == 1
    assert 3.0 <= waited < 10.0  # not the 30 s drain


def test_without_a_second_signal_the_drain_runs_its_course(tokenizer: ModelTokenizer) -> None:
    waited, aborted = run_virtual(_shutdown(tokenizer, hurry_after_s=None))
    assert len(aborted) == 1 and 30.0 <= waited < 31.0


def test_the_first_signal_stops_the_second_hurries(capsys: pytest.CaptureFixture[str]) -> None:
    async def main() -> list[tuple[bool, bool]]:
        signals = ShutdownSignals("talaria serve", 30.0).install()
        seen = [(signals.stop.is_set(), signals.hurry.is_set())]
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGINT):
            os.kill(os.getpid(), sig)
            await asyncio.sleep(0.05)  # the loop runs the handler
            seen.append((signals.stop.is_set(), signals.hurry.is_set()))
        return seen

    assert asyncio.run(main()) == [(False, False), (True, False), (True, True), (True, True)]
    err = capsys.readouterr().err.splitlines()
    assert err == ["talaria serve: stopping: calls in flight get up to 30 s to finish "
                   "(signal again to end them now)",
                   "talaria serve: ending the calls still in flight now"]


def test_an_instance_under_serve_keeps_quiet(capsys: pytest.CaptureFixture[str]) -> None:
    signals = ShutdownSignals("talaria instance a", 30.0, announce=False)
    signals.signalled()
    signals.signalled()
    assert signals.stop.is_set() and signals.hurry.is_set()
    assert capsys.readouterr().err == ""
