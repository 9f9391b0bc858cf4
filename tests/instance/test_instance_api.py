"""Instance API: abort frees, Overloaded beyond the queue bound, bad input, stop, state()."""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest
from fake_engine import FakeEngine
from instance_helpers import call, run_call

from engine.interface import Residency
from talaria.clock import run_live, run_virtual
from talaria.instance.instance import Instance
from talaria.policies.config import preset
from talaria.protocol import InstanceState, InstanceUnavailable, Overloaded, to_json


def _engine(**kw) -> FakeEngine:  # type: ignore[no-untyped-def]
    return FakeEngine(["a", "b"], num_blocks=20, step_s=0.1, switch_host_s=2.0, **kw)


def test_abort_queued_call_never_reaches_the_engine() -> None:
    engine = _engine()

    async def main():  # type: ignore[no-untyped-def]
        inst = Instance("i", engine, preset("baseline", max_running_calls=1))
        await inst.start()
        first = inst.submit(call("c0", "s0", "a", 50))
        handle = inst.submit(call("c1", "s1", "a", 50))
        await asyncio.sleep(2.05)
        assert inst.abort("c1")
        events = await handle.collect()
        await first.collect()
        assert not inst.abort("c1")  # already finished
        await inst.stop()
        return events

    events = run_virtual(main())
    assert len(events) == 1 and events[0].finished and events[0].finish_reason == "abort"
    assert ("add", "c1") not in engine.log


def test_abort_running_call_frees_its_blocks() -> None:
    engine = _engine()

    async def main():  # type: ignore[no-untyped-def]
        inst = Instance("i", engine, preset("baseline"))
        await inst.start()
        handle = inst.submit(call("c0", "s0", "a", 100, max_tokens=100))
        await asyncio.sleep(3.0)
        busy = inst.state()
        inst.abort("c0")
        events = await handle.collect()
        await asyncio.sleep(0.5)
        idle = inst.state()
        await inst.stop()
        return busy, events, idle

    busy, events, idle = run_virtual(main())
    assert busy.free_kv_blocks < busy.total_kv_blocks
    assert events[-1].finish_reason == "abort" and 0 < len(events) < 100
    assert engine.aborted == ["c0"]
    assert idle.free_kv_blocks == idle.total_kv_blocks == 20
    assert idle.models["a"].running_calls == 0


def test_a_call_reusing_an_aborted_calls_id_gets_its_own_answer() -> None:
    """The first call's abort event stays in the engine until its next step (nothing else
    runs meanwhile); it must not end the second call with the same id, whose request would
    then stay in the engine and refuse every switch (model b's call)."""
    engine = _engine()

    async def main():  # type: ignore[no-untyped-def]
        inst = Instance("i", engine, preset("talaria"))
        await inst.start()
        first = inst.submit(call("x", "s1", "a", 40, max_tokens=50))
        assert not (await anext(first)).finished
        first.abort()
        ended = [e async for e in first]
        await asyncio.sleep(1.0)
        second = await inst.submit(call("x", "s2", "a", 40, max_tokens=3)).collect()
        other = await inst.submit(call("y", "s3", "b", 40, max_tokens=3)).collect()
        await asyncio.sleep(0.5)
        idle = inst.state()
        await inst.stop()
        return ended, second, other, idle

    ended, second, other, idle = run_virtual(main())
    assert ended[-1].finish_reason == "abort"
    assert second[-1].finish_reason == "length"
    assert sum(len(e.token_ids) for e in second) == 3
    assert other[-1].finish_reason == "length", other[-1].error
    assert engine.aborted == ["x"]
    assert idle.healthy and idle.models["a"].running_calls == 0


def test_leaving_the_stream_early_aborts_the_call() -> None:
    engine = _engine()

    async def main():  # type: ignore[no-untyped-def]
        inst = Instance("i", engine, preset("baseline"))
        await inst.start()
        stream = inst.stream(call("c0", "s0", "a", 50, max_tokens=100))
        got = 0
        async for _event in stream:
            got += 1
            if got == 3:
                break
        await stream.aclose()
        async with inst.submit(call("c1", "s1", "a", 50, max_tokens=100)) as handle:
            await handle.__anext__()
        await asyncio.sleep(0.3)
        await inst.stop()

    run_virtual(main())
    assert engine.aborted == ["c0", "c1"]


def test_overloaded_beyond_queue_bound_and_bad_input() -> None:
    engine = _engine()

    async def main():  # type: ignore[no-untyped-def]
        inst = Instance("i", engine, preset("baseline", max_queue_calls=2))
        with pytest.raises(InstanceUnavailable):
            inst.submit(call("c0", "s", "a", 10))  # not started
        await inst.start()
        inst.submit(call("c0", "s0", "a", 10))
        inst.submit(call("c1", "s1", "b", 10))
        with pytest.raises(Overloaded, match="max_queue_calls=2") as err:
            inst.submit(call("c2", "s2", "a", 10))
        assert err.value.retry_after_s >= 1.0
        with pytest.raises(ValueError, match="already in flight"):
            inst.submit(call("c0", "s0", "a", 10))
        await asyncio.sleep(1.0)
        with pytest.raises(ValueError, match="model 'zzz' is not served"):
            inst.submit(call("c3", "s3", "zzz", 10))
        with pytest.raises(ValueError, match="empty prompt"):
            inst.submit(call("c4", "s4", "a", 0))
        await inst.stop(drain=True)
        with pytest.raises(InstanceUnavailable):
            inst.submit(call("c5", "s5", "a", 10))

    run_virtual(main())


def test_stop_without_drain_aborts_everything() -> None:
    engine = _engine()

    async def main():  # type: ignore[no-untyped-def]
        inst = Instance("i", engine, preset("talaria"))
        await inst.start()
        running = inst.submit(call("c0", "s0", "a", 50, max_tokens=100))
        queued = inst.submit(call("c1", "s1", "b", 50))
        await asyncio.sleep(2.5)
        await inst.stop(drain=False)
        return await running.collect(), await queued.collect()

    running, queued = run_virtual(main())
    assert running[-1].finish_reason == "abort"
    assert queued == [queued[0]] and queued[0].finish_reason == "abort"
    assert not any(engine.pinned(s) for s in ("s0", "s1"))


def test_an_engine_that_fails_every_step_makes_the_instance_unhealthy() -> None:
    class Broken(FakeEngine):
        def step(self):  # type: ignore[no-untyped-def]
            raise RuntimeError("device lost")

    engine = Broken(["a"], step_s=0.1)

    async def main():  # type: ignore[no-untyped-def]
        inst = Instance("i", engine, preset("baseline", max_engine_faults=3))
        await inst.start()
        seen = []
        for i in range(3):  # each call fails alone; the third fault in a row ends the loop
            seen.append((inst.state().healthy, await inst.submit(call(f"c{i}", "s0", "a", 10)).collect()))
        return seen, inst

    seen, inst = run_virtual(main())
    assert [healthy for healthy, _ in seen] == [True, True, True]
    for _, events in seen:
        assert events[-1].finish_reason == "error" and "device lost" in (events[-1].error or "")
    assert not inst.state().healthy


def test_state_reports_residency_pressure_rates_and_sessions() -> None:
    engine = _engine()

    async def main():  # type: ignore[no-untyped-def]
        # the "empty" rule closes a's slot once b waits, with a's call still in flight
        inst = Instance("i", engine, preset("talaria", slot_close="empty"))
        await inst.start()
        a = asyncio.ensure_future(run_call(inst, call("c0", "s0", "a", 100, max_tokens=10)))
        await asyncio.sleep(2.35)
        inst.submit(call("c1", "s1", "b", 40, max_tokens=5))
        await asyncio.sleep(0.1)  # the loop stages b before its next step
        busy = inst.state()
        await a
        await asyncio.sleep(0.2)
        await inst.stop()
        return busy

    st = run_virtual(main())
    assert st.instance_id == "i" and st.healthy and st.now == pytest.approx(2.45)
    assert st.active_model == "a"
    a, b = st.models["a"], st.models["b"]
    assert a.residency == Residency.ACTIVE and b.residency == Residency.STAGED
    assert a.running_calls == 1 and a.running_tokens > 0 and a.queued_calls == 0
    assert b.queued_calls == 1 and b.queued_tokens == 40
    # b waits for a's call to drain (6 more steps) and a D2D switch (not yet measured: 0);
    # a's slot has closed (b waits), so a new call of a waits for b's slot and a switch back
    assert b.wait_s == pytest.approx(0.6)
    assert a.wait_s == pytest.approx(0.6 + 2.0)
    assert a.switch_host_s == pytest.approx(2.0) and a.decode_step_s == pytest.approx(0.1)
    assert a.prefill_tokens_per_s > 0
    assert st.total_kv_blocks == 20 and 0 <= st.free_kv_blocks < 20
    back = InstanceState.from_dict(orjson.loads(to_json(st)))
    assert back == st


def test_live_loop_runs_engine_ops_off_the_loop_and_state_stays_readable() -> None:
    class SlowLive(FakeEngine):
        def step(self):  # type: ignore[no-untyped-def]
            time.sleep(0.005)  # a real blocking op: it runs on the executor's worker thread
            return super().step()

    engine = SlowLive(["a", "b"], num_blocks=50, simulated=False)

    async def main():  # type: ignore[no-untyped-def]
        inst = Instance("live", engine, preset("talaria"))
        await inst.start()
        calls = [
            asyncio.ensure_future(run_call(inst, call(f"c{i}", f"s{i}", "ab"[i % 2], 20)))
            for i in range(4)
        ]
        states = []
        while not all(c.done() for c in calls):
            states.append(inst.state())  # never touches the engine: no EngineBusy
            await asyncio.sleep(0.001)
        out = [c.result() for c in calls]
        await inst.stop()
        return out, states, inst

    out, states, inst = run_live(main())
    assert all(t.last.finish_reason == "length" and len(t.events) == 5 for t in out)
    assert states and inst.counters["switches"] >= 2


def test_a_call_the_engine_rejects_fails_alone() -> None:
    class Picky(FakeEngine):
        def add_request(self, request):  # type: ignore[no-untyped-def]
            if len(request.prompt_token_ids) > 64:
                raise ValueError("prompt longer than max_model_len=64")
            super().add_request(request)

    engine = Picky(["a"], step_s=0.1)

    async def main():  # type: ignore[no-untyped-def]
        inst = Instance("i", engine, preset("baseline"))
        await inst.start()
        bad = asyncio.ensure_future(run_call(inst, call("bad", "s0", "a", 100)))
        good = asyncio.ensure_future(run_call(inst, call("good", "s1", "a", 10)))
        out = await bad, await good
        healthy = inst.state().healthy
        await inst.stop()
        return out, healthy

    (bad, good), healthy = run_virtual(main())
    assert bad.last.finish_reason == "error" and "max_model_len" in (bad.last.error or "")
    assert good.last.finish_reason == "length" and healthy


def test_a_queued_call_whose_client_left_is_dropped_at_admission() -> None:
    engine = _engine()

    async def main():  # type: ignore[no-untyped-def]
        inst = Instance("i", engine, preset("baseline", max_running_calls=1))
        await inst.start()
        first = inst.submit(call("c0", "s0", "a", 50, max_tokens=5))
        queued = inst.submit(call("c1", "s1", "a", 50))
        queued.client_gone = lambda: True  # its server noticed the client is gone
        await first.collect()
        events = await queued.collect()
        await inst.stop()
        return events, inst

    events, inst = run_virtual(main())
    assert [e.finish_reason for e in events] == ["abort"]
    assert ("add", "c1") not in engine.log  # never prefilled
    assert inst.counters["departed"] == 1


def test_the_session_table_is_bounded_here_and_in_the_engine() -> None:
    engine = _engine()

    async def main():  # type: ignore[no-untyped-def]
        # No reservations: a reserved session is never forgotten (it is coming back).
        policy = preset("baseline", soft_reservations=False, max_sessions=3, state_refresh_s=0.05)
        inst = Instance("i", engine, policy)
        await inst.start()
        for i in range(8):
            await inst.submit(call(f"c{i}", f"s{i}", "a", 20, max_tokens=3)).collect()
        await inst.submit(call("last", "s-last", "a", 20, max_tokens=3)).collect()
        await inst.stop()
        return inst

    inst = run_virtual(main())
    kept = set(inst.sessions.gaps.sessions)
    assert len(kept) <= 3 and "s-last" in kept
    forgotten = {sid for kind, sid in engine.log if kind == "forget"}
    assert {f"s{i}" for i in range(5)} <= forgotten  # the least recently seen went first
    assert not forgotten & {"s-last"}


def test_a_call_too_big_for_the_kv_region_fails_alone_and_the_next_one_runs() -> None:
    """20 blocks of 16 tokens: a 400-token call can never fit; the call queued behind it
    must not wait for an unrelated wake-up."""
    engine = _engine()

    async def main():  # type: ignore[no-untyped-def]
        inst = Instance("i", engine, preset("baseline"))
        await inst.start()
        big = inst.submit(call("big", "s0", "a", 400, max_tokens=4))
        small = inst.submit(call("small", "s1", "a", 20, max_tokens=4))
        events = await asyncio.wait_for(small.collect(), timeout=60.0)
        failed = await big.collect()
        await inst.stop()
        return failed, events

    failed, events = run_virtual(main())
    assert failed[-1].finish_reason == "error" and "KV blocks" in (failed[-1].error or "")
    assert events[-1].finished and events[-1].finish_reason == "length"


def test_a_call_without_step_events_gets_the_same_tokens_and_times_in_two_events() -> None:
    """``step_events=False``: the first event with tokens goes at once, the steps after it
    are held and come with the last event: same tokens in order, same first-token and
    finish times, same usage (the first event's too); an abort mid-call still delivers the held tokens."""

    async def main(step_events: bool, abort_at: float | None = None):  # type: ignore[no-untyped-def]
        inst = Instance("i", _engine(), preset("baseline"))
        await inst.start()
        req = call("c0", "s0", "a", 40, max_tokens=30)
        req.step_events = step_events
        task = asyncio.ensure_future(run_call(inst, req))
        if abort_at is not None:
            await asyncio.sleep(abort_at)
            inst.abort("c0")
        timed = await task
        await inst.stop()
        return timed

    every, ends = run_virtual(main(True)), run_virtual(main(False))
    assert len(every.events) > 3 and len(ends.events) == 2
    tokens = [t for e in every.events for t in e.token_ids]
    assert [t for e in ends.events for t in e.token_ids] == tokens and len(tokens) == 30
    assert ends.events[0].token_ids == every.events[0].token_ids
    assert ends.events[0].usage == every.events[0].usage and every.events[0].usage is not None
    assert (ends.first, ends.done) == (every.first, every.done)
    assert ends.last.usage == every.last.usage and ends.last.finish_reason == "length"
    aborted_every, aborted = run_virtual(main(True, 3.05)), run_virtual(main(False, 3.05))
    assert aborted.last.finish_reason == "abort" and len(aborted.events) == 2
    assert 0 < len(aborted.last.token_ids) < 30
    assert ([t for e in aborted.events for t in e.token_ids]
            == [t for e in aborted_every.events for t in e.token_ids])
