"""Round scheduler (baseline), quanta, staging, and session-prefill admitting a continuation
that arrives after its model's slot closed. Virtual clock + FakeEngine: times are exact."""

from __future__ import annotations

import asyncio

import pytest
from fake_engine import FakeEngine
from instance_helpers import call, late_continuation, run_call, run_session

from talaria.clock import run_virtual
from talaria.instance.instance import Instance
from talaria.policies.config import PolicyConfig, preset


def _late_continuation(policy: PolicyConfig):  # type: ignore[no-untyped-def]
    """late_continuation, and its engine (``policy``'s "empty" rule closes a's slot at once)."""
    engine = FakeEngine(["a", "b"], step_s=0.1, switch_host_s=2.0)
    return engine, late_continuation(policy, engine)


def test_baseline_continuation_after_slot_close_waits_for_next_slot() -> None:
    engine, ((s1, s2, b1), inst) = _late_continuation(preset("baseline", slot_close="empty"))
    assert s2[0].done == pytest.approx(2.5)
    assert s2[1].sent == pytest.approx(3.0)
    assert s1.done == pytest.approx(7.0)
    assert b1.first == pytest.approx(9.1)  # switch to b after a's in-flight calls finished
    assert s2[1].first == pytest.approx(11.6)  # b's slot, then the switch back to a
    assert engine.log.index(("activate", "b")) < engine.log.index(("add", "s2-1"))
    assert inst.counters["sp_admitted"] == 0
    assert inst.counters["switches"] == 3


def test_session_prefill_admits_the_late_continuation_in_the_current_slot() -> None:
    policy = preset("baseline", session_prefill=True, slot_close="empty")
    engine, ((s1, s2, b1), inst) = _late_continuation(policy)
    assert s2[1].first == pytest.approx(3.1)  # admitted at once, beside s1's decode
    assert s2[1].done < s1.done
    assert b1.first == pytest.approx(9.1)  # it cost b nothing: s1 was still running
    assert engine.log.index(("add", "s2-1")) < engine.log.index(("activate", "b"))
    assert inst.counters["sp_admitted"] == 1
    assert inst.counters["switches"] == 2


def _stream_vs_waiting(sp_budget_s: float):  # type: ignore[no-untyped-def]
    """Session s of model a returns every 0.1 s for 40 calls; one call of b waits. SP holds
    the idle slot for each return (``sp_hold``), so only its budget ends the slot."""
    policy = preset(
        "baseline", session_prefill=True, soft_reservations=True, sp_budget_s=sp_budget_s,
        sp_hold=True,
    )
    engine = FakeEngine(["a", "b"], step_s=0.1, switch_host_s=2.0)

    async def main():  # type: ignore[no-untyped-def]
        inst = Instance("i", engine, policy)
        await inst.start()
        s = asyncio.ensure_future(run_session(inst, "s", "a", 40, gap=0.1))
        b1 = asyncio.ensure_future(run_call(inst, call("b1", "sb", "b", 100, 5)))
        out = await s, await b1
        await inst.stop()
        return out, inst

    return run_virtual(main())


def test_session_prefill_budget_bounds_the_wait_of_other_models() -> None:
    budget = 3.0
    (s, b1), inst = _stream_vs_waiting(budget)
    assert inst.counters["sp_admitted"] >= 3  # SP did keep the slot for the session
    # b waits at most: switch to a, a's first call, the SP budget plus one admitted
    # continuation's overshoot of its estimate, the switch to b, one step.
    bound = 2.0 + 0.5 + budget + 0.6 + 2.0 + 0.1
    assert b1.first <= bound
    (s_unbounded, b1_unbounded), _ = _stream_vs_waiting(1000.0)
    assert b1_unbounded.first > 2 * bound  # without the bound b starves behind the session


def test_quantum_closes_the_slot_when_other_models_wait() -> None:
    engine = FakeEngine(["a", "b"], step_s=0.1, switch_host_s=2.0)
    policy = preset("baseline", slot_quantum_s=1.0, max_running_calls=1)

    async def main():  # type: ignore[no-untyped-def]
        inst = Instance("i", engine, policy)
        await inst.start()
        a = [
            asyncio.ensure_future(run_call(inst, call(f"a{i}", f"s{i}", "a", 50))) for i in range(5)
        ]
        b = asyncio.ensure_future(run_call(inst, call("b0", "sb", "b", 50)))
        out = [await t for t in a], await b
        await inst.stop()
        return out

    a, b = run_virtual(main())
    assert [t.first for t in a[:2]] == pytest.approx([2.1, 2.6])
    assert b.first == pytest.approx(5.1)  # a's slot closed at 3.0 (quantum), b switched in
    assert a[2].first == pytest.approx(7.6)


def test_one_model_with_work_keeps_its_slot_without_switching() -> None:
    engine = FakeEngine(["a", "b"], step_s=0.1, switch_host_s=2.0)
    policy = preset("baseline", slot_quantum_s=1.0, max_running_calls=1)

    async def main():  # type: ignore[no-untyped-def]
        inst = Instance("i", engine, policy)
        await inst.start()
        calls = [run_call(inst, call(f"a{i}", f"s{i}", "a", 50)) for i in range(5)]
        out = await asyncio.gather(*calls)
        await inst.stop()
        return out, inst

    a, inst = run_virtual(main())
    assert a[-1].done == pytest.approx(2.0 + 5 * 0.5)
    assert inst.counters["switches"] == 1
    assert [e for e in engine.log if e[0] == "activate"] == [("activate", "a")]


@pytest.mark.parametrize("staging", [False, True])
def test_staging_makes_the_next_switch_device_to_device(staging: bool) -> None:
    engine = FakeEngine(["a", "b"], step_s=0.1, switch_host_s=2.0, switch_staged_s=0.2)
    policy = preset("baseline", d2d_staging=staging)

    async def main():  # type: ignore[no-untyped-def]
        inst = Instance("i", engine, policy)
        await inst.start()
        a = asyncio.ensure_future(run_call(inst, call("a0", "sa", "a", 50)))
        b = asyncio.ensure_future(run_call(inst, call("b0", "sb", "b", 50)))
        out = await a, await b
        state = inst.state()
        await inst.stop()
        return out, state

    (a, b), state = run_virtual(main())
    if staging:
        assert engine.log[:2] == [("activate", "a"), ("stage", "b")]
        assert b.first == pytest.approx(2.0 + 0.5 + 0.2 + 0.1)
        assert state.models["b"].switch_staged_s == pytest.approx(0.2)
    else:
        assert not any(kind == "stage" for kind, _ in engine.log)
        assert b.first == pytest.approx(2.0 + 0.5 + 2.0 + 0.1)
        assert state.models["b"].switch_host_s == pytest.approx(2.0)


def test_the_reports_waits_are_each_models_round_estimate() -> None:
    """The state report prices every queue once (``Estimator.waits_s``); each model's wait
    there is what ``Estimator.wait_s`` says for it alone, while a's slot runs and b's and c's
    calls queue behind it (every model's rates learned first)."""

    async def main() -> list[tuple[dict[str, float], dict[str, float], dict[str, float]]]:
        inst = Instance("i", FakeEngine(["a", "b", "c"], step_s=0.1, switch_host_s=2.0),
                        preset("baseline", slot_quantum_s=3.0))
        await inst.start()
        seen = []
        try:
            for model in "bca":  # each model's rates learned: its queue has a price
                await run_call(inst, call(f"warm-{model}", f"w{model}", model, 40, 4))
            tasks = [asyncio.create_task(run_call(inst, call("a0", "sa", "a", 40, 30)))]
            await asyncio.sleep(0.35)
            for i, model in enumerate("bcbca"):
                tasks.append(asyncio.create_task(
                    run_call(inst, call(f"{model}{i}", f"s{model}{i}", model, 50 + 40 * i, 8))))
            for _ in range(6):
                await asyncio.sleep(0.8)
                state = inst.state()
                est = inst.loop.est
                seen.append((est.waits_s(), {m: est.wait_s(m) for m in "abc"},
                             {m: s.wait_s for m, s in state.models.items()}))
            await asyncio.gather(*tasks)
        finally:
            await inst.stop()
        return seen

    seen = run_virtual(main())
    for together, alone, reported in seen:
        assert together == pytest.approx(alone, rel=1e-12)
        assert reported == pytest.approx(alone, rel=1e-12)
    assert any(w["c"] > w["b"] > 0 for w, _, _ in seen)  # c waits for b's slot too
