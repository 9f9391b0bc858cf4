"""Session-prefill is a cost-benefit decision, not a reflex."""

from __future__ import annotations

import asyncio

import pytest
from fake_engine import FakeEngine
from instance_helpers import call, run_call, run_session

from talaria.clock import run_virtual
from talaria.instance.instance import Instance
from talaria.policies.config import PolicyConfig, preset
from talaria.policies.session_prefill import SPCandidate, decide

POLICY = preset("talaria", d2d_staging=False, sp_hold=True)


def _scenario(
    engine: FakeEngine,
    *,
    b_calls: int,
    session_calls: int,
    b_at: float,
    margin: float = 1.0,
    vanish: bool = False,
    policy: PolicyConfig = POLICY,
):  # type: ignore[no-untyped-def]
    """Session s of model a (hint: back in 0.5 s); ``b_calls`` calls of b arrive at b_at.
    ``vanish``: s sends one call announcing a return in 0.5 s, then never comes back."""

    async def main():  # type: ignore[no-untyped-def]
        inst = Instance("i", engine, policy.with_(sp_idle_margin_s=margin))
        await inst.start()
        if vanish:
            s = asyncio.ensure_future(run_call(inst, call("s-0", "s", "a", 100, 5, gap=0.5)))
        else:
            s = asyncio.ensure_future(run_session(inst, "s", "a", session_calls, gap=0.5))

        async def b(i: int):  # type: ignore[no-untyped-def]
            await asyncio.sleep(b_at)
            return await run_call(inst, call(f"b{i}", f"sb{i}", "b", 100, 5, last=True))

        bs = [asyncio.ensure_future(b(i)) for i in range(b_calls)]
        out = await s, [await t for t in bs]
        await inst.stop()
        return out, inst

    return run_virtual(main())


def test_free_switches_and_waiting_calls_do_not_hold_the_slot() -> None:
    engine = FakeEngine(["a", "b"], step_s=0.1, switch_host_s=0.0, switch_staged_s=0.0)
    (s, bs), inst = _scenario(engine, b_calls=4, session_calls=2, b_at=0.2)
    assert inst.counters["sp_holds"] == 0
    assert s[0].done == pytest.approx(0.5)
    assert [b.first for b in bs] == pytest.approx([0.6] * 4)  # b switched in at once
    assert engine.log.index(("activate", "b")) < engine.log.index(("add", "s-1"))
    # and the session lost nothing: b's slot was over when it came back
    assert s[1].first == pytest.approx(1.1)


def test_expensive_switch_and_imminent_continuation_hold_the_slot() -> None:
    engine = FakeEngine(["a", "b"], step_s=0.1, switch_host_s=30.0, switch_staged_s=30.0)
    (s, bs), inst = _scenario(engine, b_calls=1, session_calls=2, b_at=30.2)
    assert inst.counters["sp_holds"] >= 1 and inst.counters["sp_admitted"] == 1
    assert s[0].done == pytest.approx(30.5)
    assert s[1].first == pytest.approx(31.1)  # served in a's slot: no 60 s round trip
    assert bs[0].first == pytest.approx(31.5 + 30.0 + 0.1)
    assert engine.log.index(("add", "s-1")) < engine.log.index(("activate", "b"))


def test_talaria_does_not_idle_its_slot_for_a_reserved_continuation() -> None:
    engine = FakeEngine(["a", "b"], step_s=0.1, switch_host_s=30.0, switch_staged_s=30.0)
    (s, bs), inst = _scenario(engine, b_calls=1, session_calls=2, b_at=30.2,
                              policy=preset("talaria", d2d_staging=False))
    assert inst.counters["sp_holds"] == 0
    assert bs[0].first == pytest.approx(30.5 + 30.0 + 0.1)  # b switched in as a drained
    assert engine.log.index(("activate", "b")) < engine.log.index(("add", "s-1"))


@pytest.mark.parametrize("margin", [1.0, 0.25])
def test_hold_never_outlasts_predicted_arrival_plus_margin(margin: float) -> None:
    engine = FakeEngine(["a", "b"], step_s=0.1, switch_host_s=30.0, switch_staged_s=30.0)
    (s, bs), inst = _scenario(
        engine, b_calls=1, session_calls=1, b_at=30.2, margin=margin, vanish=True
    )
    assert inst.counters["sp_holds"] >= 1
    switch_at = 30.5 + 0.5 + margin
    assert bs[0].first == pytest.approx(switch_at + 30.0 + 0.1)


def _cand(arrival: float, service: float = 1.0, rebuild: float = 0.0) -> SPCandidate:
    return SPCandidate("s", arrival=arrival, service_s=service, rebuild_s=rebuild, queued=False)


def test_decide_weighs_saving_against_delay_times_waiting_calls() -> None:
    common = dict(now=0.0, drain_end=0.0, round_wait_s=1.0, horizon_s=10.0, budget_left_s=10.0)
    # saves 1 + 5 (switch back) = 6 s; costs (0.5 idle + 1 service) * waiting calls
    assert decide(_cand(0.5), waiting_other_calls=2, switch_back_s=5.0, **common).take
    assert not decide(_cand(0.5), waiting_other_calls=4, switch_back_s=5.0, **common).take
    # free switch: saving 1 s does not pay for 1.5 s of delay for one waiting call
    assert not decide(_cand(0.5), waiting_other_calls=1, switch_back_s=0.0, **common).take
    # KV rebuild counts as saving
    assert decide(_cand(0.5, rebuild=2.0), waiting_other_calls=1, switch_back_s=0.0, **common).take
    # riding along with in-flight work costs nothing
    ride = dict(common, drain_end=5.0)
    d = decide(_cand(0.0), waiting_other_calls=9, switch_back_s=0.0, **ride)
    assert d.take and d.extra_delay_s == 0.0


def test_decide_respects_horizon_and_budget() -> None:
    common = dict(
        now=0.0, drain_end=0.0, round_wait_s=100.0, switch_back_s=100.0, waiting_other_calls=1
    )
    assert not decide(_cand(11.0), horizon_s=10.0, budget_left_s=100.0, **common).take
    assert not decide(_cand(2.0), horizon_s=10.0, budget_left_s=2.5, **common).take
    assert decide(_cand(2.0), horizon_s=10.0, budget_left_s=3.0, **common).take
    nobody = dict(common, waiting_other_calls=0)
    assert not decide(_cand(0.0), horizon_s=10.0, budget_left_s=3.0, **nobody).take
