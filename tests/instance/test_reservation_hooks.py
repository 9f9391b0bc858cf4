"""A reservation's device pin never leaks, whatever the book's change hook does.

With host KV on, every reservation made or ended tells the engine to hold or release the
session's host KV (``hold_host_kv``); on a tensor-parallel engine that is a collective, and
a broken TP group makes it raise. The error surfaces as an engine fault (counted, the calls in
the engine fail, the loop goes on), and the reservation's device pin is released all the same:
on admission, expiry, a yield, a drop and at shutdown. A hook that fails as a reservation is
made leaves it in the book, pinned, to be released as any other.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from fake_engine import FakeEngine
from instance_helpers import call, run_call

from talaria.clock import run_virtual
from talaria.instance.instance import Instance
from talaria.policies.config import preset


@dataclass
class BrokenHoldEngine(FakeEngine):
    """``hold_host_kv`` raises, once ``broken``, for the direction in ``broken_on`` (True:
    holding, False: releasing), as a collective over a broken TP group would."""

    broken: bool = False
    broken_on: bool = False
    holds: int = 0

    def hold_host_kv(self, session_id: str, held: bool = True) -> None:
        self.holds += 1
        if self.broken and held == self.broken_on:
            raise RuntimeError(f"TP group broken: hold_host_kv({session_id!r}, {held})")


def engine(**kw: object) -> BrokenHoldEngine:
    return BrokenHoldEngine(["a"], num_blocks=20, block_size=16, step_s=0.1, **kw)  # type: ignore[arg-type]


def instance(eng: BrokenHoldEngine) -> Instance:
    return Instance("i", eng, preset("talaria", host_kv=True, reservation_ttl_s=10.0))


async def reserve(inst: Instance, eng: BrokenHoldEngine) -> None:
    """s's call ends at 2.5 and reserves until 12.5 (7 blocks pinned); then the hook breaks."""
    await inst.start()
    await run_call(inst, call("s-0", "s", "a", 100, 5, gap=5.0))
    assert eng.pinned("s") and eng.holds == 1 and "s" in inst.loop.sessions.reservations
    eng.broken = True


def assert_released(inst: Instance, eng: BrokenHoldEngine) -> None:
    assert not eng.pinned("s")
    assert "s" not in inst.loop.sessions.reservations


def test_expiry_releases_the_pin_when_the_hook_raises() -> None:
    eng = engine()

    async def main() -> Instance:
        inst = instance(eng)
        await reserve(inst, eng)
        await asyncio.sleep(12.6 - asyncio.get_running_loop().time())
        assert_released(inst, eng)
        eng.broken = False
        after = await run_call(inst, call("u-0", "u", "a", 40, 2, last=True))
        assert after.last.finish_reason == "length"
        await inst.stop()
        return inst

    inst = run_virtual(main())
    assert inst.counters["engine_faults"] == 1 and inst.healthy


def test_admission_releases_the_pin_when_the_hook_raises() -> None:
    eng = engine()

    async def main() -> tuple[Instance, str | None]:
        inst = instance(eng)
        await reserve(inst, eng)
        back = await run_call(inst, call("s-1", "s", "a", 125, 5))
        assert_released(inst, eng)
        await inst.stop()
        return inst, back.last.error

    inst, error = run_virtual(main())
    assert ("unpin", "s") in eng.log  # before its call ran: the fault took the call out
    assert error is not None and "engine fault" in error and "TP group broken" in error
    assert inst.counters["engine_faults"] == 1 and inst.healthy


def test_a_yield_releases_the_pin_when_the_hook_raises() -> None:
    eng = engine()

    async def main() -> tuple[Instance, str | None]:
        inst = instance(eng)
        await reserve(inst, eng)
        # w needs 15 of 20 blocks while s's reservation pins 7: s yields (offloaded first)
        w = await run_call(inst, call("w-0", "w", "a", 230, 10, last=True))
        assert_released(inst, eng)
        await inst.stop()
        return inst, w.last.finish_reason

    inst, reason = run_virtual(main())
    assert eng.log.index(("offload", "s")) < eng.log.index(("unpin", "s"))
    assert eng.log.index(("unpin", "s")) < eng.log.index(("add", "w-0"))
    assert reason == "length"  # w was waiting, not in the engine: the fault did not fail it
    assert inst.counters["engine_faults"] == 1 and inst.healthy


def test_a_drop_releases_the_pin_and_forgets_when_the_hook_raises() -> None:
    eng = engine()

    async def main() -> Instance:
        inst = instance(eng)
        await reserve(inst, eng)
        inst.forget_sessions(["s"])
        await asyncio.sleep(0.5)
        assert_released(inst, eng)
        await inst.stop()
        return inst

    inst = run_virtual(main())
    assert ("forget", "s") in eng.log and inst.loop.sessions.model_of("s") is None
    assert inst.counters["engine_faults"] == 1 and inst.healthy


def test_shutdown_releases_the_pin_when_the_hook_raises() -> None:
    eng = engine()

    async def main() -> Instance:
        inst = instance(eng)
        await reserve(inst, eng)
        await inst.stop()
        return inst

    inst = run_virtual(main())
    assert_released(inst, eng)
    assert inst.counters["engine_faults"] == 0  # at shutdown the failure is only logged


def test_a_hook_failing_as_the_reservation_is_made_leaves_it_pinned_in_the_book() -> None:
    """The reservation stands (it is counted, its pin is the book's to release) and ends as
    any other: here at its expiry, the hook working again."""
    eng = engine(broken=True, broken_on=True)

    async def main() -> tuple[Instance, bool, bool]:
        inst = instance(eng)
        await inst.start()
        first = await run_call(inst, call("s-0", "s", "a", 100, 5, gap=5.0))
        assert first.last.finish_reason == "length"  # it ended before the hook ran
        booked = "s" in inst.loop.sessions.reservations
        pinned = eng.pinned("s")
        eng.broken = False
        await asyncio.sleep(12.6 - asyncio.get_running_loop().time())
        assert_released(inst, eng)
        await inst.stop()
        return inst, booked, pinned

    inst, booked, pinned = run_virtual(main())
    assert booked and pinned
    assert inst.counters["reservations"] == 1 and inst.counters["reservations_expired"] == 1
    assert inst.counters["engine_faults"] == 1 and inst.healthy


async def reserve_two(inst: Instance, eng: BrokenHoldEngine) -> None:
    """s's and t's calls end with reservations (7 and 4 blocks pinned); then the hook breaks."""
    await inst.start()
    await run_call(inst, call("s-0", "s", "a", 100, 5, gap=5.0))
    await run_call(inst, call("t-0", "t", "a", 60, 3, gap=5.0))
    assert eng.pinned("s") and eng.pinned("t")
    eng.broken = True


def test_a_batch_of_drops_is_done_whole_when_the_hook_raises_for_each() -> None:
    eng = engine()

    async def main() -> Instance:
        inst = instance(eng)
        await reserve_two(inst, eng)
        inst.forget_sessions(["s", "t"])
        await asyncio.sleep(0.5)
        await inst.stop()
        return inst

    inst = run_virtual(main())
    for session in ("s", "t"):  # before, the first error left t pinned and remembered
        assert not eng.pinned(session) and ("forget", session) in eng.log
        assert inst.loop.sessions.model_of(session) is None
    assert inst.counters["sessions_dropped"] == 2
    assert inst.counters["engine_faults"] == 1 and inst.healthy


def test_a_batch_of_releases_is_done_whole_when_the_hook_raises_for_each() -> None:
    eng = engine()

    async def main() -> Instance:
        inst = instance(eng)
        await reserve_two(inst, eng)
        inst.release_reservations(["s", "t"])
        await asyncio.sleep(0.5)
        assert not inst.loop.sessions.reservations.all()
        await inst.stop()
        return inst

    inst = run_virtual(main())
    assert not eng.pinned("s") and not eng.pinned("t")
    assert inst.counters["reservations_released"] == 2
    assert inst.counters["engine_faults"] == 1 and inst.healthy
