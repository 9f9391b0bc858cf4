"""A call mid-answer that the engine holds without a step (preempted for KV, waiting for blocks)
gets an empty event every few seconds (``talaria.instance.heartbeats``): the router's stall
deadline and a client's idle timeout see it alive, and it ends whole. Without heartbeats the
router cut such a call after its stall deadline, its client getting an error mid-answer."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
from aiohttp.test_utils import TestServer
from fake_engine import FakeEngine
from instance_helpers import call
from structlog.testing import capture_logs

from engine.interface import StepResult
from router.core import RouterCore
from router.instances.deadlines import Deadlines
from router.instances.http import HttpInstanceClient
from router.instances.inprocess import InProcessClient
from talaria.clock import run_virtual
from talaria.instance.instance import Instance
from talaria.policies.config import PolicyConfig
from talaria.protocol import CallEvent
from talaria.serving.instance_server import InstanceServerSettings, create_instance_app

HOLD_STEPS = 300  # 30 s at the engine's 0.1 s steps


@dataclass
class HoldingEngine(FakeEngine):
    """Holds request ``held`` for ``HOLD_STEPS`` steps once it has written 3 tokens: no event
    for it, as for a request the engine preempted, while the others step on."""

    held: str = "c0"
    steps_held: int = 0

    def step(self) -> StepResult:
        req = self._reqs.get(self.held)
        if req is not None and req.out == 3 and self.steps_held < HOLD_STEPS:
            self.steps_held += 1
            return self.step_without(self.held)
        return super().step()


def _engine() -> HoldingEngine:
    return HoldingEngine(["m"], num_blocks=400, step_s=0.1)


def _timed_events(heartbeat_s: float, step_events: bool = True, limit_s: float = 600.0,
                  ) -> tuple[list[tuple[float, CallEvent]], int]:
    """The held call's events with their loop times, and the heartbeats the instance sent."""
    engine = _engine()

    async def main():  # type: ignore[no-untyped-def]
        policy = PolicyConfig(call_heartbeat_s=heartbeat_s, engine_op_timeout_s=limit_s)
        inst = Instance("i", engine, policy)
        await inst.start()
        held = call("c0", "s0", "m", 40, max_tokens=8)
        held.step_events = step_events
        handle = inst.submit(held)
        other = inst.submit(call("c1", "s1", "m", 40, max_tokens=HOLD_STEPS + 100))
        loop = asyncio.get_running_loop()
        timed = [(loop.time(), e) async for e in handle]
        await other.collect()
        await inst.stop()
        return timed, inst.counters.get("heartbeats", 0)

    return run_virtual(main())


def _longest_gap(timed: list[tuple[float, CallEvent]]) -> float:
    times = [t for t, _ in timed]
    return max(b - a for a, b in zip(times, times[1:], strict=False))


def test_a_held_call_gets_heartbeats_and_ends_whole() -> None:
    timed, sent = _timed_events(heartbeat_s=5.0)
    events = [e for _, e in timed]
    tokens = [t for e in events for t in e.token_ids]
    assert len(tokens) == 8 and events[-1].finish_reason == "length"
    beats = [e for e in events if not e.token_ids and not e.finished]
    assert len(beats) == sent >= 3  # a 30 s hold, a sweep every 5 s
    assert all(e.usage is None and e.instance_id == "i" for e in beats)
    assert _longest_gap(timed) <= 2 * 5.0 + 0.2  # at most two periods without an event
    first_token = next(i for i, e in enumerate(events) if e.token_ids)
    assert all(e.token_ids for e in events[: first_token + 1])  # none before the first token


def test_without_heartbeats_the_held_call_is_silent_for_the_whole_hold() -> None:
    timed, sent = _timed_events(heartbeat_s=0.0)
    assert sent == 0 and all(e.token_ids or e.finished for _, e in timed)
    assert _longest_gap(timed) >= HOLD_STEPS * 0.1


def test_a_call_held_past_the_limit_gets_no_more_heartbeats() -> None:
    """Held 30 s, sweeps every 5 s, a 12 s limit (the instance's engine_op_timeout_s): the
    sweeps that find it held 5 and 10 s since the first one that saw it held beat, the later
    ones do not, so it is silent longer than two periods (unlimited, it never is)."""
    with capture_logs() as logs:
        timed, sent = _timed_events(heartbeat_s=5.0, limit_s=12.0)
    assert sent == 2
    assert _longest_gap(timed) > 2 * 5.0 + 0.2
    warned = [e for e in logs if e["event"] == "call_held_past_limit"]
    assert len(warned) == 1 and warned[0]["call_id"] == "c0" and 12.0 <= warned[0]["held_s"] < 17.0


def test_a_consumer_of_ends_only_gets_no_heartbeat() -> None:
    timed, sent = _timed_events(heartbeat_s=5.0, step_events=False)
    assert sent == 0
    assert [len(e.token_ids) for _, e in timed] == [1, 7]  # its first token, then the rest


def _through_router(heartbeat_s: float, limit_s: float = 600.0) -> list[CallEvent]:
    engine = _engine()

    async def main():  # type: ignore[no-untyped-def]
        policy = PolicyConfig(call_heartbeat_s=heartbeat_s, engine_op_timeout_s=limit_s)
        inst = Instance("i", engine, policy)
        await inst.start()
        core = RouterCore({"i": InProcessClient("i", inst)}, "load", refresh_after_call=False,
                          deadlines=Deadlines(first_token_s=300.0, stall_s=12.0))
        other = asyncio.ensure_future(
            inst.submit(call("c1", "s1", "m", 40, max_tokens=HOLD_STEPS + 100)).collect())
        events = [e async for e in core.submit(call("c0", "s0", "m", 40, max_tokens=8))]
        await other
        await core.close()
        await inst.stop()
        return events

    return run_virtual(main())


def test_the_router_keeps_a_held_call_that_sends_heartbeats() -> None:
    events = _through_router(heartbeat_s=5.0)
    assert events[-1].finish_reason == "length" and events[-1].error is None
    assert sum(len(e.token_ids) for e in events) == 8


@pytest.mark.parametrize("limit_s", [None, 12.0], ids=["no-heartbeats", "held-past-the-limit"])
def test_the_router_cuts_a_held_call_without_heartbeats(limit_s: float | None) -> None:
    events = (_through_router(heartbeat_s=0.0) if limit_s is None
              else _through_router(heartbeat_s=5.0, limit_s=limit_s))
    assert events[-1].finish_reason == "error" and "event after the last" in (events[-1].error or "")


async def test_heartbeats_cross_the_instance_http_api() -> None:
    """Over HTTP (wall clock: 0.01 s steps, a 3 s hold, a heartbeat every 0.4 s) the router,
    whose stall deadline is 1.5 s, keeps the held call and gets every token."""
    engine = HoldingEngine(["m"], num_blocks=400, step_s=0.01)
    instance = Instance("i", engine, PolicyConfig(call_heartbeat_s=0.4))
    server = TestServer(create_instance_app(instance, InstanceServerSettings()))
    await server.start_server()
    client = HttpInstanceClient("i", str(server.make_url("/")))
    core = RouterCore({"i": client}, "load", refresh_after_call=False,
                      deadlines=Deadlines(first_token_s=300.0, stall_s=1.5))
    other = instance.submit(call("c1", "s1", "m", 40, max_tokens=HOLD_STEPS + 100))
    try:
        events = [e async for e in core.submit(call("c0", "s0", "m", 40, max_tokens=8))]
        assert events[-1].finish_reason == "length" and events[-1].error is None
        assert sum(len(e.token_ids) for e in events) == 8
        assert any(not e.token_ids and not e.finished for e in events)
        await other.collect()
    finally:
        await core.close()
        await client.close()
        await instance.stop(drain=False)
        await server.close()


def test_a_late_sweep_past_the_limit_still_logs_the_held_call_once() -> None:
    """Sweeps come from the loop's turns, so one can come late: the first sweep that finds a
    call held past the limit logs it, however far past (the check read the period before)."""
    from types import SimpleNamespace

    from talaria.instance.heartbeats import Heartbeats

    put: list[object] = []
    pending = SimpleNamespace(out_tokens=3, handle=SimpleNamespace(holds_steps=False,
                                                                    put=put.append))
    beats = Heartbeats("i", period_s=5.0, limit_s=12.0, counters={})
    with capture_logs() as logs:
        for now in (0.0, 5.0, 10.0, 30.0, 35.0):
            beats.sweep(now, {"c0": pending}, stepped=True)  # type: ignore[dict-item]
    warned = [e for e in logs if e["event"] == "call_held_past_limit"]
    assert [e["held_s"] for e in warned] == [30.0]
    assert len(put) == 2  # at 5 and 10 s held; none once past the limit
