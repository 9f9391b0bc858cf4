"""EngineExecutor: sim ops run inline and advance virtual time; live ops run on one thread."""

from __future__ import annotations

import asyncio
import threading

import pytest
from fake_engine import FakeEngine

from engine.interface import EngineRequest
from engine.sampling_params import SamplingParams
from talaria.clock import run_live, run_virtual
from talaria.instance.executor import EngineBusy, EngineExecutor
from talaria.protocol import CallRequest


class ThreadRecordingEngine(FakeEngine):
    def __post_init__(self) -> None:
        super().__post_init__()
        self.threads: list[int] = []

    def step(self):  # type: ignore[no-untyped-def]
        self.threads.append(threading.get_ident())
        return super().step()

    def activate(self, model: str):  # type: ignore[no-untyped-def]
        self.threads.append(threading.get_ident())
        return super().activate(model)


def _request(rid: str) -> EngineRequest:
    return EngineRequest(
        rid, list(range(10)), SamplingParams(max_tokens=2), model="a", session_id="s"
    )


def test_sim_ops_run_inline_and_advance_virtual_time_by_their_seconds() -> None:
    engine = ThreadRecordingEngine(["a", "b"], step_s=0.25, switch_host_s=3.0, stage_s=7.0)

    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        ex = EngineExecutor(engine)
        times = [loop.time()]
        await ex.activate("a")
        times.append(loop.time())
        ex.add_request(_request("r1"))
        await ex.step()
        times.append(loop.time())
        await ex.stage("b")  # a background copy: started, not waited for
        times.append(loop.time())
        ex.close()
        return times

    times = run_virtual(main())
    assert times == [0.0, 3.0, 3.25, 3.25]
    assert set(engine.threads) == {threading.get_ident()}  # no run_in_executor in sim


def test_live_ops_run_on_one_worker_thread() -> None:
    engine = ThreadRecordingEngine(["a"], simulated=False)

    inits: list[int] = []

    async def main() -> None:
        ex = EngineExecutor(engine, thread_init=lambda: inits.append(threading.get_ident()))
        await ex.activate("a")
        ex.add_request(_request("r1"))
        await ex.step()
        await ex.step()
        ex.close()

    run_live(main())
    assert len(set(engine.threads)) == 1
    assert engine.threads[0] != threading.get_ident()
    assert inits == engine.threads[:1]  # initialised once, on that thread


def test_engine_calls_are_refused_while_an_op_is_in_flight() -> None:
    engine = FakeEngine(["a"], step_s=1.0, initial_model="a")

    async def main() -> None:
        ex = EngineExecutor(engine)
        ex.add_request(_request("r1"))
        task = asyncio.ensure_future(ex.step())
        await asyncio.sleep(0.5)
        assert ex.busy == "step"
        with pytest.raises(EngineBusy, match="add_request.*step"):
            ex.add_request(_request("r2"))
        await task
        assert ex.busy is None
        ex.add_request(_request("r2"))

    run_virtual(main())


def test_reports_reach_listeners() -> None:
    engine = FakeEngine(["a", "b"], switch_host_s=2.0)
    seen: list[tuple[str, str | None]] = []

    async def main() -> None:
        ex = EngineExecutor(engine)
        ex.on_report.append(lambda kind, result, model: seen.append((kind, model)))
        await ex.activate("b")
        await ex.offload_kv(None)
        await ex.step()

    run_virtual(main())
    assert seen == [("activate", "b"), ("offload_kv", "b"), ("step", "b")]


class SlowStepEngine(FakeEngine):
    """A live engine whose step takes ``hold`` to be set (it blocks its thread)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.simulated = False
        self.hold = threading.Event()

    def step(self):  # type: ignore[no-untyped-def]
        self.hold.wait(5.0)
        return super().step()


def test_a_live_op_keeps_the_engine_busy_until_its_thread_is_done_even_if_cancelled() -> None:
    engine = SlowStepEngine(["a"], initial_model="a")

    async def main() -> tuple[str | None, str | None, str | None]:
        ex = EngineExecutor(engine)
        task = asyncio.ensure_future(ex.step())
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.sleep(0.05)
        during = ex.busy  # cancelled, but the engine thread still runs the step
        with pytest.raises(EngineBusy):
            ex.stats()
        engine.hold.set()
        for _ in range(100):
            if ex.busy is None:
                break
            await asyncio.sleep(0.01)
        after = ex.busy
        ex.close()
        return during, after, ex.busy

    during, after, _ = run_live(main())
    assert during == "step" and after is None


def test_the_watchdog_marks_an_instance_with_a_wedged_engine_unhealthy() -> None:
    from talaria.instance.instance import Instance
    from talaria.policies.config import preset
    from talaria.protocol import InstanceUnavailable

    engine = SlowStepEngine(["a"], initial_model="a")

    async def main() -> tuple[bool, bool]:
        inst = Instance("i", engine, preset("baseline", engine_op_timeout_s=0.2))
        await inst.start()
        inst.submit(CallRequest("c", "s", "a", list(range(10)), SamplingParams(max_tokens=2)))
        await asyncio.wait_for(inst.hung.wait(), timeout=5.0)
        with pytest.raises(InstanceUnavailable):
            inst.submit(CallRequest("d", "t", "a", [1, 2], SamplingParams(max_tokens=2)))
        healthy = inst.healthy
        engine.hold.set()  # let the thread go, so the test can stop the instance
        await inst.stop(drain=False)
        return inst.hung.is_set(), healthy

    hung, healthy = run_live(main())
    assert hung and not healthy


def test_a_stop_does_not_wait_for_an_engine_operation_wedged_past_the_timeout() -> None:
    """Stopping while a live step never returns: the watchdog still watches, and the stop
    returns once the operation is past ``engine_op_timeout_s`` (hung set, the loop
    cancelled) instead of waiting for a thread nothing can interrupt."""
    from talaria.instance.instance import Instance
    from talaria.policies.config import preset

    engine = SlowStepEngine(["a"], initial_model="a")

    async def main() -> tuple[bool, float]:
        inst = Instance("i", engine, preset("baseline", engine_op_timeout_s=0.3))
        await inst.start()
        inst.submit(CallRequest("c", "s", "a", list(range(10)), SamplingParams(max_tokens=2)))
        while inst.executor.busy is None:
            await asyncio.sleep(0.01)
        loop = asyncio.get_running_loop()
        began = loop.time()
        await asyncio.wait_for(inst.stop(drain=False), timeout=3.0)
        took = loop.time() - began
        hung = inst.hung.is_set()
        engine.hold.set()  # let the thread go, so the test leaves nothing behind
        return hung, took

    hung, took = run_live(main())
    assert hung and took < 3.0
