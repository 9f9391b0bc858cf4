"""The control plane's switches that the peers are built from: the slot-closing rule,
admission and model order (program FCFS, least attained service), Continuum's TTL rule, the
per-call time split, and the shared device of the ideal bound."""

from __future__ import annotations

import asyncio
import math

import pytest
from fake_engine import FakeEngine
from instance_helpers import Timed, call, late_continuation, run_call

from engine.interface import EngineRequest
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.sim.engine import SimEngine, SimEngineConfig
from talaria.clock import run_virtual
from talaria.instance.instance import Instance
from talaria.instance.time_split import DEVICE_WAIT, IDLE, SWITCH, TimeSplit, serving
from talaria.policies.config import PolicyConfig, preset
from talaria.policies.priority import Service, next_model, priority_key
from talaria.policies.round_scheduler import RoundScheduler, slot_closes
from talaria.policies.ttl import MIN_SAMPLES, continuum_ttl
from talaria.protocol import CallRequest
from workloads.bounds.shared_device import DeviceSchedule, SharedDevice, claim


@pytest.mark.parametrize(("rule", "continuation_first", "b_first"), [
    ("empty", 11.6, 9.1),  # a's slot closed as its queue emptied: the continuation waits
    ("drained", 3.1, 9.1),  # open while s1 runs: admitted at once; b after a drains
    ("quantum", 3.1, 24.1),  # open until its quantum (opened at 2.0 + 20 s), then b
])
def test_slot_closing_rule(rule: str, continuation_first: float, b_first: float) -> None:
    (s1, s2, b1), _ = late_continuation(
        preset("baseline", slot_close=rule, slot_quantum_s=20.0))
    assert s1.done == pytest.approx(7.0)
    assert s2[1].first == pytest.approx(continuation_first)
    assert b1.first == pytest.approx(b_first)


def test_slot_closes_only_when_another_model_waits() -> None:
    assert slot_closes("empty", queue_empty=True, in_flight=True, others_waiting=True)
    assert not slot_closes("drained", queue_empty=True, in_flight=True, others_waiting=True)
    assert slot_closes("drained", queue_empty=True, in_flight=False, others_waiting=True)
    assert not slot_closes("quantum", queue_empty=True, in_flight=False, others_waiting=True)
    for rule in ("empty", "drained", "quantum"):
        assert not slot_closes(rule, queue_empty=True, in_flight=False, others_waiting=False)
    with pytest.raises(ValueError, match="rule"):
        slot_closes("never", queue_empty=True, in_flight=False, others_waiting=True)


def test_a_preempting_policy_needs_an_engine_that_can_suspend() -> None:
    with pytest.raises(ValueError, match="cannot suspend"):
        Instance("i", FakeEngine(["a"]), PolicyConfig(preempt=True))


def test_admission_and_model_order() -> None:
    services = {"new": Service(0.0, 1.0, 5.0), "old": Service(30.0, 2.0, 0.0),
                "pinned": Service(10.0, 0.0, 9.0, pinned=True),
                "starved": Service(2.0, 20.0, 3.0)}
    calls = list(services)

    def service(name: str) -> Service:
        return services[name]

    def order_queue(order: str) -> list[str]:  # as the intake sorts a queue (stable)
        return sorted(calls, key=lambda c: priority_key(order, service(c), 8.0))

    assert order_queue("fifo") == calls
    assert order_queue("program_fcfs") == ["pinned", "old", "starved", "new"]
    # least attained service first, but a session that waited 8x its service goes first
    assert order_queue("las") == ["starved", "new", "pinned", "old"]
    rounds = RoundScheduler(["a", "b", "c"])
    waiting = {"a": ["old"], "b": [], "c": ["new"]}
    assert next_model(rounds, "b", waiting, "round", service, 8.0) == "c"
    assert next_model(rounds, "c", waiting, "round", service, 8.0) == "a"
    assert next_model(rounds, "c", waiting, "las", service, 8.0) == "c"
    assert next_model(rounds, "a", {"a": [], "b": [], "c": []}, "las", service, 8.0) is None


def test_continuum_ttl_rule() -> None:
    # cold start: exponential gaps of mean 1 s -> tau = ln(benefit)
    assert continuum_ttl([], reload_s=5.0, queue_delay_s=2.0) == pytest.approx(math.log(7.0))
    assert continuum_ttl([], reload_s=0.5, queue_delay_s=0.2) == 0.0  # not worth a pin
    gaps = [0.05] * 50 + [9.0] * 10
    assert len(gaps) >= MIN_SAMPLES
    assert continuum_ttl(gaps, reload_s=3.0, queue_delay_s=1.0) == 0.05
    assert continuum_ttl(gaps, reload_s=60.0, queue_delay_s=0.0) == 9.0  # worth the long gaps
    assert continuum_ttl(gaps, reload_s=0.0, queue_delay_s=0.0) == 0.0
    with pytest.raises(ValueError, match="eta"):
        continuum_ttl(gaps, 1.0, 1.0, eta=2.0)


def test_time_split_charges_each_call_by_what_the_instance_did() -> None:
    split = TimeSplit(0.0, record=True)
    split.arrive("a1", "a", 0.0)
    split.arrive("b1", "b", 0.0)
    split.state(0.0, SWITCH)
    split.state(2.0, serving("a", True))  # a1 queued in a's open slot, b1 waits for b's
    split.admit("a1", 3.0)
    split.device_wait(4.0, True)
    split.device_wait(4.5, False)
    split.state(5.0, serving("a", False))
    split.finish("a1", 6.0)
    split.state(6.0, SWITCH)
    split.state(7.0, serving("b", True))
    split.admit("b1", 7.0)
    split.finish("b1", 9.0)
    assert split.done["a1"] == pytest.approx(
        {"switch": 2.0, "queue": 1.0, "service": 2.5, "slot_wait": 0.5})
    assert split.done["b1"] == pytest.approx(
        {"switch": 3.0, "queue": 0.0, "service": 2.0, "slot_wait": 4.0})
    assert IDLE != DEVICE_WAIT


def test_a_live_time_split_keeps_nothing_per_finished_call() -> None:
    split = TimeSplit(0.0)
    for k in range(100):
        split.arrive(f"c{k}", "a", float(k))
        split.admit(f"c{k}", float(k))
        split.finish(f"c{k}", k + 0.5)
    assert split.done == {} and not split._calls


def _device_starts(schedule: DeviceSchedule) -> dict[str, float]:
    """a1 runs 0-1 s; b1 asks at 0.1; a2 asks at 0.5 and then, continuing its call, once more
    when its first step ends. When does each step start?"""
    starts: dict[str, float] = {}

    async def step(device: SharedDevice, model: str, name: str, at: float, seconds: float,
                   continuing: bool = False) -> None:
        loop = asyncio.get_running_loop()
        if at > loop.time():
            await asyncio.sleep(at - loop.time())
        await device.acquire(model, 0.0, continuing)
        starts[name] = loop.time()
        await asyncio.sleep(seconds)
        device.release(model)

    async def a2() -> None:
        await step(device, "a", "a2", 0.5, 1.0)
        await step(device, "a", "a2+", 0.0, 1.0, continuing=True)

    async def main() -> dict[str, float]:
        nonlocal device
        device = SharedDevice(["a", "b"], schedule, asyncio.get_running_loop().time)
        await asyncio.gather(step(device, "a", "a1", 0.0, 1.0), step(device, "b", "b1", 0.1, 1.0),
                             a2())
        return starts

    device: SharedDevice
    return run_virtual(main())


def test_shared_device_time_shares_models_step_by_step() -> None:
    # b1 waits since 0.1, so a2 may not join a's turn: b1 goes when a1 ends, then a2
    assert _device_starts(DeviceSchedule()) == pytest.approx(
        {"a1": 0.0, "b1": 1.0, "a2": 2.0, "a2+": 3.0})


@pytest.mark.parametrize(("preempt", "want"), [
    (True, {"a1": 0.0, "a2": 0.5, "b1": 1.5, "a2+": 2.5}),  # at the quantum, a2 waits
    (False, {"a1": 0.0, "a2": 0.5, "a2+": 1.5, "b1": 2.5}),  # a2's call in flight finishes
])
def test_shared_device_slots_keep_a_model_for_its_quantum(preempt: bool,
                                                          want: dict[str, float]) -> None:
    schedule = DeviceSchedule("slots", "drained", quantum_s=1.5, preempt=preempt)
    assert _device_starts(schedule) == pytest.approx(want)


def test_device_claims() -> None:
    assert claim("las", [(3.0, 1.0), (1.0, None)], 2.0) == (1.0, True)
    assert claim("mas", [(3.0, 1.0), (1.0, None)], 2.0) == (-4.0, True)
    assert claim("fair", [(3.0, 2.0)], 2.0) == (0.0, False)
    assert DeviceSchedule.from_dict(DeviceSchedule().to_dict()) == DeviceSchedule()
    with pytest.raises(ValueError, match="order"):
        DeviceSchedule("random")


def test_engine_admission_does_not_count_a_sessions_own_pinned_prefix_again() -> None:
    """Continuum's row (the engine's own admission, hard pins): session s's 60 blocks stay
    pinned after its call; its next call (61 blocks, 60 of them its pinned prefix) needs one
    new block, which the 40 free blocks hold, as vLLM V1's ``allocate_slots`` counts it
    (blocks beyond the computed prefix, plus computed blocks nobody references). It is
    admitted at once, not after r's 5 s call in flight."""
    from workloads.replay.systems import PEERS

    policy = PEERS["continuum_ttl"].policy.with_(reservation_ttl="fixed",
                                                 reservation_ttl_s=1000.0)
    assert policy.admission == "engine" and policy.hard_pins

    async def main() -> tuple[float, float | None, float | None]:
        inst = Instance("i", FakeEngine(["a"], num_blocks=100, block_size=16,
                                        initial_model="a"), policy)
        await inst.start()
        try:
            await run_call(inst, call("s#0", "s", "a", 60 * 16 - 1, max_tokens=1, gap=1.0))
            res = inst.loop.sessions.reservations.get("s")
            assert res is not None and res.pinned and res.blocks == 60
            r = asyncio.create_task(run_call(inst, call("r#0", "r", "a", 16, max_tokens=50)))
            await asyncio.sleep(0.5)
            s1 = await run_call(inst, call("s#1", "s", "a", 61 * 16, max_tokens=1))
            return s1.sent, s1.first, (await r).done
        finally:
            await inst.stop()

    sent, first, r_done = run_virtual(main())
    assert first is not None and r_done is not None
    assert first < r_done
    assert first - sent <= 0.2  # one loop turn and a step


@pytest.mark.parametrize("hard", [True, False])
def test_a_hard_pin_holds_while_a_call_runs_and_a_soft_one_yields(hard: bool) -> None:
    """Continuum's pins under the engine's own admission: session s's 60 blocks stay pinned
    after its call; another session's 50-block call finds 39 blocks free beside r's call in
    flight. A hard pin holds while r runs (Continuum's deadlock guard yields it only when
    nothing runs), so x starts once r has ended; a soft one yields at once."""
    from workloads.replay.systems import PEERS

    policy = PEERS["continuum_ttl"].policy.with_(reservation_ttl="fixed",
                                                 reservation_ttl_s=1000.0, hard_pins=hard)

    async def main() -> tuple[float, float | None, float | None, int]:
        inst = Instance("i", FakeEngine(["a"], num_blocks=100, block_size=16,
                                        initial_model="a"), policy)
        await inst.start()
        try:
            await run_call(inst, call("s#0", "s", "a", 60 * 16 - 1, max_tokens=1, gap=100.0))
            r = asyncio.create_task(run_call(inst, call("r#0", "r", "a", 16, max_tokens=50)))
            await asyncio.sleep(0.5)
            x = await run_call(inst, call("x#0", "x", "a", 50 * 16, max_tokens=1))
            return x.sent, x.first, (await r).done, inst.counters["reservations_yielded"]
        finally:
            await inst.stop()

    sent, first, r_done, yielded = run_virtual(main())
    assert first is not None and r_done is not None
    assert yielded == 1
    if hard:
        assert first >= r_done
    else:
        assert first - sent <= 0.2


SIM_MODEL, SIM_BLOCK = "mistral-large-2407", 64


def _sim_call(call_id: str, session: str, prompt: list[int], max_tokens: int,
              gap: float | None = None) -> CallRequest:
    return CallRequest(call_id, session, SIM_MODEL, prompt, SamplingParams(
        max_tokens=max_tokens, ignore_eos=True), expected_gap_s=gap)


def _sim_engine(handed: dict[str, EngineRequest]) -> SimEngine:
    """The simulated engine with 100 blocks of 64 tokens, its model active, on the running
    loop's clock; ``handed`` gets each request it is given."""
    engine = SimEngine([SIM_MODEL], SimEngineConfig(kv_tokens=100 * SIM_BLOCK, host_kv_bytes=0,
                                                    staging=False),
                       clock=asyncio.get_running_loop().time)
    engine.activate(SIM_MODEL)
    add = engine.add_request

    def record(request: EngineRequest) -> None:
        handed[request.request_id] = request
        add(request)
    engine.add_request = record  # type: ignore[method-assign]
    return engine


def test_engine_admission_counts_a_released_pin_as_taken() -> None:
    """Continuum's row on the simulated engine (100 blocks of 64 tokens, the vLLM-style
    scheduler): s's 60 blocks stay pinned after its call; s's next call needs one block
    beyond them and is handed to the engine, which releases the pin, so the engine reports
    those 60 blocks free until s's prefill takes them back. x (50 blocks), queued behind s
    in the same admission pass, must not be handed on them: beside r, 37 blocks are left.
    Handed, x would wait in the engine, where no pin yields to it while r runs, instead of
    in the instance's queue; with chunked prefill it would start there and be preempted."""
    from workloads.replay.systems import PEERS

    bs = SIM_BLOCK
    policy = PEERS["continuum_ttl"].policy.with_(reservation_ttl="fixed",
                                                 reservation_ttl_s=1000.0)

    def req(call_id: str, session: str, prompt: list[int], max_tokens: int) -> CallRequest:
        return _sim_call(call_id, session, prompt, max_tokens, gap=1.0)

    def tokens(n: int, start: int) -> list[int]:
        return [start + i for i in range(n)]

    async def main() -> tuple[Timed, dict[str, float]]:
        loop = asyncio.get_running_loop()
        handed: dict[str, float] = {}
        engine = _sim_engine({})
        add = engine.add_request

        def when(request: EngineRequest) -> None:
            handed[request.request_id] = loop.time()
            add(request)
        engine.add_request = when  # type: ignore[method-assign]
        inst = Instance("i", engine, policy)
        await inst.start()
        try:
            prompt = tokens(60 * bs, 1)
            s0 = await run_call(inst, req("s#0", "s", prompt, 1))
            res = inst.loop.sessions.reservations.get("s")
            assert res is not None and res.pinned and res.blocks == 60
            r = asyncio.create_task(run_call(inst, req("r#0", "r", tokens(bs, 20_000), 3000)))
            await asyncio.sleep(0.5)
            prompt += s0.last.token_ids + tokens(bs - 1, 25_000)
            s1 = asyncio.create_task(run_call(inst, req("s#1", "s", prompt, 3)))
            x = asyncio.create_task(run_call(inst, req("x#0", "x", tokens(50 * bs, 10_000), 1)))
            s1_t = await s1
            await x
            await r
            return s1_t, handed
        finally:
            await inst.stop()

    s1, handed = run_virtual(main())
    assert s1.done is not None and handed["s#1"] - s1.sent <= 0.2
    assert handed["x#0"] > s1.done


@pytest.mark.parametrize(("order", "victim"), [("admitted", "old#1"), ("program", "new#0")])
def test_continuums_engine_preempts_the_session_that_arrived_last(order: str,
                                                                  victim: str) -> None:
    """The simulated engine (100 blocks of 64 tokens) with two calls decoding 2000 tokens each
    past what it holds: old's second call, admitted after new's first, is preempted under
    vLLM V1's FCFS (the latest admitted); Continuum's scheduler preempts by program order,
    the call of the session that arrived last (``engine_preempt="program"``). Each call
    carries its session's first arrival to the engine."""
    from workloads.replay.systems import PEERS

    bs = SIM_BLOCK
    policy = PEERS["continuum_ttl"].policy.with_(soft_reservations=False, engine_preempt=order)
    assert PEERS["continuum_ttl"].policy.engine_preempt == "program"
    req = _sim_call

    async def main() -> tuple[list[str], dict[str, float]]:
        handed: dict[str, EngineRequest] = {}
        engine = _sim_engine(handed)
        inst = Instance("i", engine, policy)
        await inst.start()
        scheduler = engine.scheduler
        assert scheduler is not None
        victims: list[str] = []
        preempt = scheduler._preempt

        def recorded(request: Request) -> None:
            victims.append(request.request_id)
            preempt(request)
        scheduler._preempt = recorded  # type: ignore[method-assign]
        try:
            old = list(range(1, 40 * bs + 1))
            old0 = await run_call(inst, req("old#0", "old", old, 1))
            await asyncio.sleep(0.5)
            new0 = asyncio.create_task(run_call(inst, req(
                "new#0", "new", list(range(20_000, 20_000 + 30 * bs)), 2000)))
            await asyncio.sleep(0.5)
            old1 = asyncio.create_task(run_call(inst, req(
                "old#1", "old", old + old0.last.token_ids + [7] * 63, 2000)))
            await new0
            await old1
            return victims, {rid: r.priority for rid, r in handed.items()}
        finally:
            await inst.stop()

    victims, priorities = run_virtual(main())
    assert victims and victims[0] == victim
    if order == "program":
        assert priorities["old#1"] == priorities["old#0"] < priorities["new#0"]
    else:
        assert set(priorities.values()) == {0.0}
