"""An admission loop that stops awaiting (a decision that reopens the same state at one
instant) still lets the rest of the event loop run: the instance's server keeps answering,
the spin is counted, and the instance stops when asked. Without the guard the test's own
coroutine never ran again (the spin is capped here so that it fails instead of hanging)."""

from __future__ import annotations

import asyncio

import pytest
from fake_engine import FakeEngine

from talaria.clock import run_virtual
from talaria.instance.instance import Instance
from talaria.instance.loop import AdmissionLoop
from talaria.instance.yield_guard import MAX_TURNS_WITHOUT_YIELD, YieldGuard
from talaria.policies.config import preset


class _Spun(BaseException):
    """Out of the loop, past its fault handling: it spun far beyond the guard's limit."""


def test_a_loop_that_never_awaits_still_lets_others_run(monkeypatch: pytest.MonkeyPatch) -> None:
    turns = [0]

    async def spin(self: AdmissionLoop) -> None:  # decides, and awaits nothing
        turns[0] += 1
        if turns[0] > 50 * MAX_TURNS_WITHOUT_YIELD:
            raise _Spun(f"{turns[0]} turns without the event loop getting one")

    monkeypatch.setattr(AdmissionLoop, "_between_slots", spin)

    async def main() -> tuple[Instance, int]:
        inst = Instance("i", FakeEngine(["a"], step_s=0.1), preset("talaria"))
        await inst.start()
        for _ in range(3):
            await asyncio.sleep(0)  # each returns once the spinning loop yields
        answered = inst.state().instance_id == "i"
        seen = turns[0]
        await inst.stop()
        assert answered
        return inst, seen

    inst, seen = run_virtual(main())
    assert inst.counters["forced_yields"] >= 3 and seen >= 3 * MAX_TURNS_WITHOUT_YIELD - 3


async def test_turns_that_suspend_never_reach_the_limit() -> None:
    guard = YieldGuard(max_turns=2)
    for _ in range(10):
        assert not guard.must_yield()
        await asyncio.sleep(0)  # the event loop runs: the probe resets the count
    assert not guard.must_yield()
    assert not guard.must_yield()  # one turn with the probe pending
    assert guard.must_yield()  # the second: yield
