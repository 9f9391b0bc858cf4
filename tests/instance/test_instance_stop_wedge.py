"""Instance.stop and the watchdog: only an operation wedged now is left behind by a stop."""

from __future__ import annotations

import asyncio
import threading
import time

from fake_engine import FakeEngine

from engine.sampling_params import SamplingParams
from talaria.clock import run_live
from talaria.instance.instance import Instance
from talaria.policies.config import preset
from talaria.protocol import CallRequest


class OnceSlowEngine(FakeEngine):
    """A live engine whose first step blocks until ``hold`` is set (past the timeout), and
    whose later steps take 20 ms each."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.simulated = False
        self.hold = threading.Event()
        self.steps = 0

    def step(self):  # type: ignore[no-untyped-def]
        self.steps += 1
        if self.steps == 1:
            self.hold.wait(5.0)
        else:
            time.sleep(0.02)
        return super().step()


def test_a_stop_after_a_slow_operation_that_returned_still_drains() -> None:
    """The watchdog went off at an operation that has since returned: a later stop with
    ``drain`` serves the running call to its end and closes the executor; the step in
    flight then is not the wedged one, and is waited for."""
    engine = OnceSlowEngine(["a"], initial_model="a")

    async def main() -> tuple[list[object], bool]:
        inst = Instance("i", engine, preset("baseline", engine_op_timeout_s=0.2))
        await inst.start()
        handle = inst.submit(CallRequest("c", "s", "a", list(range(10)),
                                         SamplingParams(max_tokens=30)))
        await asyncio.wait_for(inst.hung.wait(), timeout=5.0)
        engine.hold.set()
        while engine.steps < 3 or inst.executor.busy is None:
            await asyncio.sleep(0.005)
        await asyncio.wait_for(inst.stop(drain=True), timeout=5.0)
        events = []
        while not handle.queue.empty():
            events.append(handle.queue.get_nowait())
        return events, inst.executor._pool is None

    events, closed = run_live(main())
    assert events and getattr(events[-1], "finish_reason", None) == "length"
    assert closed


def test_a_stop_that_leaves_a_wedged_operation_behind_ends_every_call() -> None:
    """A stop that returns without waiting for a wedged step ends the calls the cancelled
    loop still had (running and queued), with an error: none waits for an event that no
    loop will ever send."""
    engine = OnceSlowEngine(["a"], initial_model="a")

    async def main() -> list[list[object]]:
        inst = Instance("i", engine, preset("baseline", engine_op_timeout_s=0.3))
        await inst.start()
        handles = [inst.submit(CallRequest("c", "s", "a", list(range(10)),
                                           SamplingParams(max_tokens=2)))]
        while inst.executor.busy is None:
            await asyncio.sleep(0.01)
        handles.append(inst.submit(CallRequest("d", "t", "a", list(range(10)),
                                               SamplingParams(max_tokens=2))))
        await asyncio.wait_for(inst.stop(drain=True), timeout=3.0)
        assert inst.hung.is_set()
        ended = []
        for handle in handles:
            events = []
            while not handle.queue.empty():
                events.append(handle.queue.get_nowait())
            ended.append(events)
        engine.hold.set()  # let the thread go, so the test leaves nothing behind
        return ended

    ended = run_live(main())
    assert [[getattr(e, "finish_reason", None) for e in events][-1:] for events in ended] == [
        ["error"], ["error"]]
