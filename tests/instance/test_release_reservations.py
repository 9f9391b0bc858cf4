"""An instance told over the state poll that a session went elsewhere releases that session's
soft reservation (its KV unpinned, counted as released) and keeps the rest of what it knows
of the session, unlike a forget; a call of the session still here keeps it current; the ask
with a release is parsed strictly, and an ask without one is read as before."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from aiohttp.test_utils import TestServer
from fake_engine import FakeEngine
from instance_helpers import call

from router.instances.http import HttpInstanceClient
from talaria.instance.instance import Instance
from talaria.policies.config import PolicyConfig
from talaria.protocol.state_delta import MAX_FORGET, StateAsk
from talaria.serving.instance_server import InstanceServerSettings, create_instance_app


async def _drain(instance: Instance, session: str, n: int) -> None:
    events = [e async for e in instance.stream(call(f"c{n}", session, "m", 40))]
    assert events[-1].finished and events[-1].error is None


async def test_a_release_over_the_poll_drops_the_reservation_alone() -> None:
    engine = FakeEngine(["m"], num_blocks=256, step_s=0.005)
    instance = Instance("i", engine, PolicyConfig(reservation_ttl_s=600.0, default_gap_s=30.0))
    server = TestServer(create_instance_app(instance, InstanceServerSettings()))
    await server.start_server()
    client = HttpInstanceClient("i", str(server.make_url("/")))
    try:
        await _drain(instance, "gone", 1)
        await _drain(instance, "stays", 2)
        assert {r.session_id for r in instance.sessions.reservations.all()} == {"gone", "stays"}
        assert engine.pinned("gone")
        client.release_reservations(["gone"])
        await client.state()  # carries the release; the loop applies it
        for _ in range(100):
            if instance.counters["reservations_released"]:
                break
            await client.state()
        assert {r.session_id for r in instance.sessions.reservations.all()} == {"stays"}
        assert instance.counters["reservations_released"] == 1
        assert not engine.pinned("gone") and engine.pinned("stays")
        assert instance.sessions.gaps.get("gone") is not None  # not forgotten
        assert instance.counters["sessions_dropped"] == 0
        await client.state()
        assert instance.counters["reservations_released"] == 1  # sent once
    finally:
        await client.close()
        await instance.stop(drain=False)
        await server.close()


def test_the_state_ask_reads_a_release_strictly() -> None:
    ask = StateAsk.from_dict({"epoch": "e", "since": 3, "forget": ["a"], "release": ["b"]})
    assert (ask.forget, ask.release) == (["a"], ["b"])
    assert StateAsk.from_dict(orjson.loads(b'{"epoch": null, "since": null, "forget": []}')).release == []
    with pytest.raises(ValueError, match="release"):
        StateAsk.from_dict({"release": "b"})
    with pytest.raises(ValueError, match="release"):
        StateAsk.from_dict({"release": ["x"] * (MAX_FORGET + 1)})
    with pytest.raises(ValueError):
        StateAsk.from_dict({"release": ["bad\nid"]})


async def test_hard_pins_last_their_ttl_whatever_a_release_says() -> None:
    """Continuum's pins: its own scheduler keeps a program's KV for the TTL, told nothing of a
    router's moves, so the row that models it does not release them either."""
    engine = FakeEngine(["m"], num_blocks=256, step_s=0.005)
    instance = Instance("i", engine, PolicyConfig(reservation_ttl_s=600.0, default_gap_s=30.0,
                                                  hard_pins=True))
    await instance.start()
    try:
        await _drain(instance, "moved", 1)
        instance.release_reservations(["moved"])
        for _ in range(20):  # the loop's turns apply what it was told
            instance.loop.wake.set()
            await asyncio.sleep(0.01)
        assert {r.session_id for r in instance.sessions.reservations.all()} == {"moved"}
        assert engine.pinned("moved") and instance.counters["reservations_released"] == 0
        assert not instance.loop.to_release  # taken, and kept out
    finally:
        await instance.stop(drain=False)


async def test_only_what_the_instance_holds_wakes_its_loop() -> None:
    """A forget of a session unknown here, or a release of one holding no reservation here,
    leaves the loop asleep: a turn at another moment is another schedule (the simulated
    replay's Continuum rows moved by up to 28% with such wakes)."""
    engine = FakeEngine(["m"], num_blocks=256, step_s=0.005)
    instance = Instance("i", engine, PolicyConfig(reservation_ttl_s=600.0, default_gap_s=30.0))
    await instance.start()
    try:
        await _drain(instance, "here", 1)
        instance.loop.wake.clear()
        instance.forget_sessions(["elsewhere"])
        instance.release_reservations(["elsewhere"])
        assert not instance.loop.wake.is_set()
        assert not instance.loop.to_forget and not instance.loop.to_release
        instance.release_reservations(["here"])
        assert instance.loop.wake.is_set() and instance.loop.to_release == {"here"}
        instance.forget_sessions(["here"])
        assert instance.loop.to_forget == {"here"}
    finally:
        await instance.stop(drain=False)
