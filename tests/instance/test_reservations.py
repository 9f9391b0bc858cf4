"""Soft reservations: protect a session's KV until expiry; under memory pressure offload
(host KV on) before the blocks are given up."""

from __future__ import annotations

import asyncio

import pytest
from fake_engine import FakeEngine
from instance_helpers import call, run_call

from talaria.clock import run_virtual
from talaria.instance.calls import CallHandle, PendingCall
from talaria.instance.instance import Instance
from talaria.instance.intake import Room
from talaria.policies.config import preset


def test_reservation_protects_kv_until_expiry_then_releases_it() -> None:
    engine = FakeEngine(["a"], num_blocks=20, block_size=16, step_s=0.1, switch_host_s=2.0)
    policy = preset("talaria", reservation_ttl_s=10.0)

    async def main():  # type: ignore[no-untyped-def]
        inst = Instance("i", engine, policy)
        await inst.start()
        await run_call(inst, call("s-0", "s", "a", 100, 5, gap=5.0))  # ends 2.5, reserved
        assert engine.pinned("s")
        reserved = inst.state()
        await run_call(inst, call("u-0", "u", "a", 100, 5, last=True))  # cached, not pinned
        # v needs room: the engine evicts the unreserved u, not the older reserved s
        await run_call(inst, call("v-0", "v", "a", 120, 5, last=True))
        protected = engine.pinned("s"), list(engine.evicted), engine.session_kv_tokens("s")
        await asyncio.sleep(12.6 - asyncio.get_running_loop().time())
        after = inst.state()
        await inst.stop()
        return reserved, protected, after, inst

    reserved, (pinned, evicted, kv), after, inst = run_virtual(main())
    res = reserved.sessions["s"]
    assert res.reserved_until == pytest.approx(12.5)
    assert res.expected_return == pytest.approx(7.5)
    assert res.device_tokens == 105
    assert reserved.reserved_kv_blocks == 7
    assert pinned and evicted == ["u"] and kv == (105, 0)  # no pressure: not demoted
    assert not engine.pinned("s")
    assert inst.counters["reservations_expired"] == 1
    assert after.sessions["s"].reserved_until is None
    assert after.reserved_kv_blocks == 0


@pytest.mark.parametrize("host_kv", [True, False])
def test_memory_pressure_offloads_a_reservation_before_dropping_it(host_kv: bool) -> None:
    engine = FakeEngine(["a"], num_blocks=20, block_size=16, step_s=0.1, switch_host_s=2.0)
    policy = preset("talaria", host_kv=host_kv)

    async def main():  # type: ignore[no-untyped-def]
        inst = Instance("i", engine, policy)
        await inst.start()
        await run_call(inst, call("s-0", "s", "a", 100, 5, gap=5.0))
        assert engine.pinned("s")
        # w needs 15 of 20 blocks while s's reservation pins 7: s must yield
        await run_call(inst, call("w-0", "w", "a", 230, 10, last=True))
        back = await run_call(inst, call("s-1", "s", "a", 125, 5))
        await inst.stop()
        return back, inst

    back, inst = run_virtual(main())
    assert inst.counters["reservations_yielded"] == 1
    assert "s" in engine.evicted
    unpin = engine.log.index(("unpin", "s"))
    assert unpin < engine.log.index(("add", "w-0"))
    usage = back.last.usage
    assert usage is not None
    if host_kv:
        assert engine.log.index(("offload", "s")) < unpin
        assert usage.restored_tokens == 105 and usage.cached_tokens == 105
    else:
        assert ("offload", "s") not in engine.log
        assert usage.restored_tokens == 0 and usage.cached_tokens == 0


def test_no_reservation_for_a_last_call_or_when_disabled() -> None:
    async def main(policy_name: str, last: bool) -> int:
        engine = FakeEngine(["a"], step_s=0.1)
        inst = Instance("i", engine, preset(policy_name))
        await inst.start()
        await run_call(inst, call("x", "s", "a", 50, 3, last=last))
        pins = engine.pins
        await inst.stop()
        return pins

    assert run_virtual(main("talaria", last=False)) == 1
    assert run_virtual(main("talaria", last=True)) == 0
    assert run_virtual(main("-reservations", last=False)) == 0  # reservations off


def test_gap_is_learned_per_session() -> None:
    engine = FakeEngine(["a"], step_s=0.1, switch_host_s=0.0)

    async def main():  # type: ignore[no-untyped-def]
        inst = Instance("i", engine, preset("talaria", default_gap_s=7.0))
        await inst.start()
        await run_call(inst, call("s-0", "s", "a", 50, 3))
        first = inst.state().sessions["s"].expected_return - asyncio.get_running_loop().time()
        await asyncio.sleep(3.0)
        await run_call(inst, call("s-1", "s", "a", 60, 3))
        second = inst.state().sessions["s"].expected_return - asyncio.get_running_loop().time()
        await inst.stop()
        return first, second

    first, second = run_virtual(main())
    assert first == pytest.approx(7.0)  # the prior
    assert second == pytest.approx(3.0)  # the session's own measured gap


@pytest.mark.parametrize("room", [True, False])
def test_a_yield_offloads_only_into_free_host_room(room: bool) -> None:
    """A yielding session is needed after every call waiting here; copying it into a full
    host store would evict KV needed sooner, so without free room the yield only unpins
    (without KV demotion, an option off in every preset, which would have copied it when its
    call ended)."""
    # h (55 tokens) and x (25) reach host on the switches: 8,000 bytes used; s needs 10,500
    capacity = 100_000 if room else 15_000
    engine = FakeEngine(
        ["a", "b"], num_blocks=20, block_size=16, step_s=0.1, host_kv_capacity_bytes=capacity
    )

    async def main():  # type: ignore[no-untyped-def]
        inst = Instance("i", engine, preset("talaria"))
        await inst.start()
        await run_call(inst, call("h-0", "h", "a", 50, 5, last=True))
        await run_call(inst, call("x-0", "x", "b", 20, 5, last=True))  # switch: h offloaded
        await run_call(inst, call("s-0", "s", "a", 100, 5, gap=5.0))  # switch back, reserved
        assert engine.pinned("s")
        await run_call(inst, call("w-0", "w", "a", 230, 10, last=True))  # s must yield
        back = await run_call(inst, call("s-1", "s", "a", 125, 5))
        await inst.stop()
        return back, inst

    back, inst = run_virtual(main())
    assert inst.counters["reservations_yielded"] == 1
    assert "s" in engine.evicted
    assert not engine.pinned("s")
    usage = back.last.usage
    assert usage is not None
    if room:
        assert ("offload", "s") in engine.log
        assert inst.counters["reservations_yielded_dropped"] == 0
        assert usage.restored_tokens == 105
    else:
        assert ("offload", "s") not in engine.log
        assert inst.counters["reservations_yielded_dropped"] == 1
        assert usage.restored_tokens == 0


@pytest.mark.parametrize("demotion", [True, False])
def test_demotion_copies_kv_to_host_as_a_call_ends_under_pressure(demotion: bool) -> None:
    """When s-0 ends, w-0 is queued and needs 15 blocks where 13 are free: the KV region is
    under pressure, so with KV demotion s's KV goes to host at once, before w-0 makes s's
    reservation yield. Without, the copy waits for the yield (and needs free room then:
    ``test_a_yield_offloads_only_into_free_host_room``)."""
    engine = FakeEngine(["a"], num_blocks=20, block_size=16, step_s=0.1)

    async def main():  # type: ignore[no-untyped-def]
        inst = Instance("i", engine, preset("talaria", kv_demotion=demotion))
        await inst.start()

        async def late_w():  # type: ignore[no-untyped-def]
            await asyncio.sleep(0.15)  # while s-0 runs
            return await run_call(inst, call("w-0", "w", "a", 230, 10, last=True))

        await asyncio.gather(run_call(inst, call("s-0", "s", "a", 100, 5, gap=5.0)), late_w())
        back = await run_call(inst, call("s-1", "s", "a", 125, 5))
        await inst.stop()
        return back, inst

    back, inst = run_virtual(main())
    usage = back.last.usage
    assert usage is not None
    assert inst.counters["reservations_yielded"] == 1
    assert usage.restored_tokens == 105
    first_offload = engine.log.index(("offload", "s"))
    if demotion:
        assert inst.counters["kv_demotions"] == 1  # s-0; at s-1's end nothing is queued
        assert first_offload < engine.log.index(("unpin", "s"))  # before the yield's unpin
        assert [e for e in engine.log if e == ("offload", "s")] == [("offload", "s")] * 2
    else:
        assert "kv_demotions" not in inst.counters
        assert [e for e in engine.log if e == ("offload", "s")] == [("offload", "s")]


def test_demotion_waits_for_pressure() -> None:
    """Nothing queued when a call ends: its session's KV stays on the device only."""
    engine = FakeEngine(["a"], num_blocks=20, block_size=16, step_s=0.1)

    async def main():  # type: ignore[no-untyped-def]
        inst = Instance("i", engine, preset("talaria", kv_demotion=True))
        await inst.start()
        await run_call(inst, call("s-0", "s", "a", 100, 5, gap=5.0))
        await inst.stop()
        return inst

    inst = run_virtual(main())
    assert ("offload", "s") not in engine.log and "kv_demotions" not in inst.counters


def test_no_demotion_for_a_last_call_or_without_host_kv() -> None:
    async def main(last: bool, host_kv: bool) -> bool:
        engine = FakeEngine(["a"], num_blocks=20, block_size=16, step_s=0.1)
        inst = Instance("i", engine, preset("talaria", host_kv=host_kv, kv_demotion=True))
        await inst.start()

        async def late_w():  # type: ignore[no-untyped-def]
            await asyncio.sleep(0.15)  # queued when x ends: pressure
            await run_call(inst, call("w-0", "w", "a", 230, 10, last=True))

        await asyncio.gather(run_call(inst, call("x", "s", "a", 100, 5, last=last)), late_w())
        await inst.stop()
        return inst.counters.get("kv_demotions", 0) > 0

    assert run_virtual(main(last=False, host_kv=True))
    assert not run_virtual(main(last=True, host_kv=True))
    assert not run_virtual(main(last=False, host_kv=False))


def _switch_in_b(policy: str, calls_of_b: int, **overrides: object
                 ) -> tuple[FakeEngine, dict[str, int]]:
    """Calls of model b (10 blocks each, all queued at once) switch an instance in from a;
    b's KV region holds 20 blocks, 40 with the staging region lent to it."""
    engine = FakeEngine(["a", "b"], num_blocks=20, block_size=16, step_s=0.1,
                        lendable_blocks=20, initial_model="a")

    async def main():  # type: ignore[no-untyped-def]
        inst = Instance("i", engine, preset(policy, **overrides))
        await inst.start()
        await asyncio.gather(*(run_call(inst, call(f"b{i}", f"s{i}", "b", 150, 10, last=True))
                               for i in range(calls_of_b)))
        await run_call(inst, call("a0", "t", "a", 20, 2, last=True))
        await inst.stop()
        assert inst.state().staging_lends == inst.counters.get("staging_lends", 0)
        return inst.counters

    return engine, run_virtual(main())


def test_a_switch_under_kv_pressure_lends_the_staging_region() -> None:
    """Three calls of b need 30 blocks where its KV region holds 20: b's slot borrows the
    staging region (40 blocks), and nothing is staged while it is lent; the switch back to
    a gives it back."""
    engine, counters = _switch_in_b("talaria", 3)
    assert ("activate_lent", "b") in engine.log and counters["staging_lends"] == 1
    lent_at = engine.log.index(("activate_lent", "b"))
    back_at = engine.log.index(("activate", "a"), lent_at)
    assert not [e for e in engine.log[lent_at:back_at] if e[0] == "stage"]
    assert not engine.lent  # a's slot has its own KV region only


@pytest.mark.parametrize(("policy", "calls_of_b"), [("talaria", 2), ("-lending", 3),
                                                    ("-staging", 3)])
def test_no_lending_without_pressure_or_without_the_mechanism(policy: str,
                                                              calls_of_b: int) -> None:
    """Two calls of b fit its 20 blocks: no pressure. Without lending (or without a staging
    region to lend) three calls queue for the KV region instead."""
    engine, counters = _switch_in_b(policy, calls_of_b)
    assert ("activate", "b") in engine.log and ("activate_lent", "b") not in engine.log
    assert "staging_lends" not in counters


def _pressure_after_b_opens(policy: str) -> tuple[FakeEngine, dict[str, int]]:
    """b is active and its slot opens for one call (10 of its 20 blocks: no pressure); three
    more calls of b (30 blocks) arrive while it runs."""
    engine = FakeEngine(["a", "b"], num_blocks=20, block_size=16, step_s=0.1,
                        lendable_blocks=20, initial_model="b")

    async def late(i: int):  # type: ignore[no-untyped-def]
        await asyncio.sleep(0.25)
        await run_call(inst, call(f"b{i}", f"s{i}", "b", 150, 10, last=True))

    inst = Instance("i", engine, preset(policy))

    async def main():  # type: ignore[no-untyped-def]
        await inst.start()
        await asyncio.gather(run_call(inst, call("b0", "s0", "b", 150, 10, last=True)),
                             *(late(i) for i in (1, 2, 3)))
        await inst.stop()
        return inst.counters

    return engine, run_virtual(main())


def test_pressure_inside_an_open_slot_lends_the_region_once_its_calls_drain() -> None:
    """The queued calls need more than b's KV region: the slot admits nothing more until b0
    ends, then b's KV cache borrows the staging region (no switch, no weight copy) and the
    three calls run in it at once."""
    engine, counters = _pressure_after_b_opens("talaria")
    lend_at = engine.log.index(("lend", "b"))
    assert counters["staging_lends"] == 1 and counters["slot_lends"] == 1
    adds = [i for i, e in enumerate(engine.log) if e[0] == "add"]
    assert engine.log[adds[0]] == ("add", "b0") and adds[0] < lend_at < adds[1]
    assert sorted(engine.log[i][1] for i in adds[1:]) == ["b1", "b2", "b3"]
    assert engine.lent and not [e for e in engine.log[lend_at:] if e[0] == "stage"]


def test_no_lending_inside_a_slot_without_the_mechanism() -> None:
    engine, counters = _pressure_after_b_opens("-lending")
    assert ("lend", "b") not in engine.log and "slot_lends" not in counters
    assert not engine.lent


def _one_large_call_of_b(policy: str, prompt_len: int, initial_model: str,
                         small_first: bool = False) -> tuple[FakeEngine, Instance, list]:
    """One call of b whose prompt and answer need ``prompt_len // 16 + 1`` blocks, where b's
    KV region holds 20 (40 with the staging region lent); ``small_first``: a call of b (10
    blocks) is in flight when it arrives."""
    engine = FakeEngine(["a", "b"], num_blocks=20, block_size=16, step_s=0.1,
                        lendable_blocks=20, initial_model=initial_model)
    inst = Instance("i", engine, preset(policy))

    async def large():  # type: ignore[no-untyped-def]
        await asyncio.sleep(0.25 if small_first else 0.0)
        return await run_call(inst, call("big", "s1", "b", prompt_len, 10, last=True))

    async def main():  # type: ignore[no-untyped-def]
        await inst.start()
        small = [run_call(inst, call("b0", "s0", "b", 150, 10, last=True))] if small_first else []
        done = await asyncio.gather(large(), *small)
        await inst.stop()
        return done

    return engine, inst, run_virtual(main())


@pytest.mark.parametrize(("initial_model", "small_first"), [("a", False), ("b", True)])
def test_a_call_beyond_the_kv_region_runs_in_the_lent_region(initial_model: str,
                                                              small_first: bool) -> None:
    """26 blocks for one call, 20 in b's KV region: the instance reports what the lent region
    holds (40 blocks; until this change 20, so its API and the router refused the call) and
    serves the call there, lent at the switch to b, or inside b's open slot once the call in
    flight ends."""
    engine, inst, done = _one_large_call_of_b("talaria", 400, initial_model, small_first)
    assert inst.kv_capacity_tokens == {"a": 40 * 16, "b": 40 * 16}
    assert done[0].last.finish_reason == "length" and done[0].last.error is None
    assert len([e for e in done[0].events if e.token_ids]) == 10
    assert engine.lent and inst.counters["staging_lends"] == 1
    lend = ("lend", "b") if small_first else ("activate_lent", "b")
    assert engine.log.index(lend) < engine.log.index(("add", "big"))
    if small_first:
        assert inst.counters["slot_lends"] == 1
        assert engine.log.index(("add", "b0")) < engine.log.index(lend)


@pytest.mark.parametrize(("policy", "prompt_len", "most"), [("talaria", 700, 40),
                                                            ("-lending", 400, 20)])
def test_a_call_beyond_what_one_call_can_hold_fails_naming_it(policy: str, prompt_len: int,
                                                              most: int) -> None:
    """Beyond the lent region (45 blocks of 40), or beyond the KV region where the policy
    does not lend: the call fails at once with what it needs and what the instance has."""
    engine, inst, done = _one_large_call_of_b(policy, prompt_len, "a")
    need = (prompt_len + 10 + 15) // 16
    assert inst.kv_capacity_tokens["b"] == most * 16
    assert done[0].last.finish_reason == "error"
    assert done[0].last.error == f"call needs {need} KV blocks; the instance has {most}"
    assert ("add", "big") not in engine.log


def test_a_call_that_fits_only_the_lent_region_waits_for_it_where_it_is_not_lent() -> None:
    """Where admission meets such a call before the region is lent (session-prefill admits a
    closed slot's continuations while its calls drain), it waits for the lending instead of
    failing; beyond the lent region it fails."""
    engine = FakeEngine(["a", "b"], num_blocks=20, block_size=16, step_s=0.1,
                        lendable_blocks=20, initial_model="b")
    inst = Instance("i", engine, preset("talaria"))

    def pending(call_id: str, blocks: int) -> PendingCall:
        req = call(call_id, "s", "b", blocks * 16 - 10, 10, last=True)
        made = PendingCall(req, CallHandle(req, lambda _: None), arrived=0.0, continuation=True)
        made.need_blocks = blocks
        return made

    async def main():  # type: ignore[no-untyped-def]
        await inst.start()
        rooms = [await inst.loop.intake._make_room(pending(f"c{n}", n)) for n in (26, 40)]
        inst.calls.add(last := pending("c41", 41))
        rooms.append(await inst.loop.intake._make_room(last))
        await inst.stop()
        return rooms, "c41" in inst.calls

    assert run_virtual(main()) == ([Room.WAIT, Room.WAIT, Room.FAILED], False)
    assert not engine.lent


@pytest.mark.parametrize(("max_tokens", "lends"), [(300, True), (100, False)])
def test_a_call_whose_answer_may_outgrow_the_kv_region_runs_only_where_it_is_lent(
        max_tokens: int, lends: bool) -> None:
    """A 40-token prompt allowed 300 tokens of answer is expected to hold 19 blocks (the
    prior's 256-token answer) but may come to hold 22, more than b's 20: admission counts
    all 22, so b's slot lends the region before the call runs (the engines refuse a request
    that may outgrow the KV cache they have). Allowed 100 (9 blocks), nothing is lent."""
    engine = FakeEngine(["a", "b"], num_blocks=20, block_size=16, step_s=0.1,
                        lendable_blocks=20, initial_model="a")
    inst = Instance("i", engine, preset("talaria"))

    async def main():  # type: ignore[no-untyped-def]
        await inst.start()
        done = await run_call(inst, call("c", "s", "b", 40, max_tokens, last=True))
        await inst.stop()
        return done

    done = run_virtual(main())
    assert done.last.finish_reason == "length" and done.last.error is None
    assert (("activate_lent", "b") in engine.log) is lends
    assert (("activate", "b") in engine.log) is not lends


def test_an_expired_reservation_frees_its_blocks_in_the_report_of_an_idle_instance() -> None:
    """A reservation that expires while nothing runs gives its pinned blocks back: the state
    report (and the router's free-KV gauge) says so at once, not at the next call's step."""
    engine = FakeEngine(["a"], num_blocks=20, block_size=16, step_s=0.1, switch_host_s=2.0)
    policy = preset("talaria", reservation_ttl_s=10.0)

    async def main():  # type: ignore[no-untyped-def]
        inst = Instance("i", engine, policy)
        await inst.start()
        await run_call(inst, call("s-0", "s", "a", 100, 5, gap=5.0))  # ends 2.5, reserved
        reserved = inst.state()
        await asyncio.sleep(13.0 - asyncio.get_running_loop().time())  # expired at 12.5
        after = inst.state()
        await inst.stop()
        return reserved, after

    reserved, after = run_virtual(main())
    assert reserved.reserved_kv_blocks == 7 and reserved.free_kv_blocks == 13
    assert after.reserved_kv_blocks == 0
    assert after.free_kv_blocks == engine.stats().num_free_blocks == 20
