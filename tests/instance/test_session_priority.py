"""Talaria's session-level priority: the session-length prior, the ``remaining`` order, the
model it picks next, and when a slot yields to a session of another model that outranks its
own (decision functions on hand-built cases, then one instance on the fake engine)."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import pytest
from fake_engine import FakeEngine
from instance_helpers import Timed, call, run_call

from talaria.clock import run_virtual
from talaria.instance.instance import Instance
from talaria.policies.config import PolicyConfig, preset
from talaria.policies.model_choice import holds_slot, outranking_model
from talaria.policies.priority import (
    Service,
    first_model,
    model_key,
    next_model,
    priority_key,
)
from talaria.policies.reservations import Reservation
from talaria.policies.round_scheduler import RoundScheduler
from talaria.policies.session_length import SWE_AGENT_CALLS, SessionLengthPrior, swe_agent_prior
from talaria.protocol import CallRequest


def test_expected_remaining_calls_of_a_uniform_prior() -> None:
    # N uniform on [0, 100]: E[N - k | N > k] = (100 - k) / 2
    prior = SessionLengthPrior((0.0, 100.0))
    assert prior.expected_remaining(0) == pytest.approx(50.0)
    assert prior.expected_remaining(40) == pytest.approx(30.0)
    assert prior.expected_remaining(99) == pytest.approx(1.0)  # never below one call
    assert prior.expected_remaining(500) == pytest.approx(1.0)
    # two segments of equal mass: [0, 10] and [10, 30]; beyond 10 only the second counts
    two = SessionLengthPrior((0.0, 10.0, 30.0))
    assert two.expected_remaining(0) == pytest.approx((5.0 + 20.0) / 2)
    assert two.expected_remaining(20) == pytest.approx(5.0)
    with pytest.raises(ValueError, match="nondecreasing"):
        SessionLengthPrior((5.0, 3.0))
    with pytest.raises(ValueError, match="calls_done"):
        prior.expected_remaining(-1)


def test_agent_sessions_near_their_end_have_fewer_calls_left() -> None:
    prior = swe_agent_prior()
    assert prior.quantiles == SWE_AGENT_CALLS and len(SWE_AGENT_CALLS) == 101
    fresh, midway, late = (prior.expected_remaining(k) for k in (0, 40, 100))
    assert fresh == pytest.approx(42.4, abs=0.1)
    assert fresh > midway > late


def test_fewest_expected_remaining_calls_first_with_a_starvation_guard() -> None:
    ratio = 8.0
    services = {
        "fresh": Service(0.0, 300.0, 0.0, calls=0),  # never served: ranked by the prior
        "midway": Service(40.0, 10.0, 1.0, calls=40),
        "late": Service(90.0, 20.0, 2.0, calls=100),
        "early": Service(5.0, 1.0, 3.0, calls=3),
        "starved": Service(3.0, 30.0, 4.0, calls=2),  # waited 10x its service
        "starved_longer": Service(4.0, 40.0, 5.0, calls=1),
    }

    def order_queue(names: list[str], of: dict[str, Service]) -> list[str]:
        return sorted(names, key=lambda n: priority_key("remaining", of[n], ratio))

    order = order_queue(list(services), services)
    assert order == ["starved_longer", "starved", "late", "midway", "early", "fresh"]
    # equal progress: the earlier session first
    twins = {"b": Service(1.0, 0.0, 5.0, calls=3), "a": Service(1.0, 0.0, 2.0, calls=3)}
    assert order_queue(["b", "a"], twins) == ["a", "b"]


def test_the_next_model_is_the_one_of_the_first_session() -> None:
    services = {"q1": Service(10.0, 0.0, 0.0, calls=30), "g1": Service(1.0, 0.0, 0.0, calls=1),
                "m1": Service(50.0, 0.0, 0.0, calls=60)}
    rounds = RoundScheduler(["q", "g", "m"])
    waiting = {"q": ["q1"], "g": ["g1"], "m": ["m1"]}
    assert next_model(rounds, "q", waiting, "priority", services.__getitem__, 8.0,
                      "remaining") == "m"
    assert next_model(rounds, "q", waiting, "round", services.__getitem__, 8.0) == "g"
    with pytest.raises(ValueError, match="ranks sessions"):
        next_model(rounds, "q", waiting, "priority", services.__getitem__, 8.0, "fifo")
    with pytest.raises(ValueError, match="ranks sessions"):
        PolicyConfig(session_priority=False, priority_switch=False, model_order="priority")
    with pytest.raises(ValueError, match="contradicts"):
        PolicyConfig(queue_order="las")  # session priority is on by default
    with pytest.raises(ValueError, match="contradicts"):
        PolicyConfig(model_order="las")
    with pytest.raises(ValueError, match="needs sessions ranked"):
        PolicyConfig(session_priority=False)
    talaria = preset("talaria")
    assert (talaria.admission_order, talaria.model_choice) == ("remaining", "priority")
    base = preset("baseline")
    assert (base.admission_order, base.model_choice) == ("fifo", "round")


def test_equal_first_sessions_go_to_the_model_with_the_most_calls_waiting() -> None:
    # a burst: every session fresh and arrived together, so every model's best key is equal
    fresh = Service(0.0, 0.0, 0.0, calls=0)
    rounds = RoundScheduler(["g", "q", "m"])  # round order puts g first
    waiting = {"g": ["g1", "g2"], "q": ["q1", "q2", "q3", "q4"], "m": ["m1"]}

    def service(name: str) -> Service:
        return fresh

    # the tie goes to the model whose slot advances the most sessions, whatever the order
    assert next_model(rounds, None, waiting, "priority", service, 8.0, "remaining") == "q"
    for order in (["q", "g", "m"], ["m", "g", "q"], ["m", "q", "g"]):
        assert next_model(RoundScheduler(order), None, waiting, "priority", service, 8.0,
                          "remaining") == "q"
    # a slot serves all of its model's sessions: a lone session near its end (100 calls made,
    # ~9.4 expected left) comes before four fresh ones (~42.4 each: 10.6 a session served),
    # a lone one midway (40 made, ~24.7 left) does not
    near_end = {"m1": Service(5.0, 0.0, 0.0, calls=100)}
    assert next_model(rounds, None, waiting, "priority", lambda n: near_end.get(n, fresh), 8.0,
                      "remaining") == "m"
    midway = {"m1": Service(5.0, 0.0, 0.0, calls=40)}
    assert next_model(rounds, None, waiting, "priority", lambda n: midway.get(n, fresh), 8.0,
                      "remaining") == "q"
    # a starved session comes first whatever its model's count
    starved = {"m1": Service(5.0, 300.0, 0.0, calls=3)}
    assert next_model(rounds, None, waiting, "priority", lambda n: starved.get(n, fresh), 8.0,
                      "remaining") == "m"
    # Autellix's las keeps round order among equals (its definition is the peer's)
    assert next_model(rounds, None, waiting, "las", service, 8.0) == "g"
    # the rule itself: rank (the best key over the sessions served), then the most calls
    # waiting, then the best key, then the mapping's order
    assert first_model("remaining", {"a": (1.0, 5.0), "b": (1.0, 5.0)}, {"a": 1, "b": 2}) == "b"
    assert first_model("remaining", {"a": (1.0, 4.0), "b": (1.0, 5.0)}, {"a": 2, "b": 2}) == "a"
    assert first_model("remaining", {"a": (1.0, 4.0), "b": (1.0, 5.0)}, {"a": 1, "b": 9}) == "b"
    assert first_model("remaining", {"a": (1.0, 5.0), "b": (1.0, 5.0)}, {}) == "a"
    # under another order the key alone ranks: the count only breaks ties
    assert first_model("las", {"a": (1.0, 4.0), "b": (1.0, 5.0)}, {"a": 1, "b": 9}) == "a"
    with pytest.raises(ValueError):
        first_model("remaining", {}, {})


def test_a_model_ranks_by_its_best_session_over_the_sessions_its_slot_serves() -> None:
    # not starved: expected remaining calls per session served; the arrival tie-break goes
    assert model_key("remaining", (1.0, 40.0, 3.0), 4) == (1.0, 10.0)
    assert model_key("remaining", (1.0, 40.0, 3.0), 0) == (1.0, 40.0)
    # starved: the longest wait first, however many sessions the model has
    assert model_key("remaining", (0.0, -300.0, 3.0), 9) == (0.0, -300.0)
    # two models whose best sessions differ only in when they arrived rank equal
    assert model_key("remaining", (1.0, 40.0, 0.001), 2) == model_key("remaining",
                                                                      (1.0, 40.0, 0.0), 2)
    # the peers' orders are theirs: untouched
    assert model_key("las", (1.0, 7.0), 5) == (1.0, 7.0)
    assert model_key("program_fcfs", (1.0, 0.5), 5) == (1.0, 0.5)


def test_a_served_session_is_starved_only_once_it_has_waited_the_floor_too() -> None:
    # one short call (2 s of service), then a wait: 4x its service is not enough alone
    short = Service(2.0, 30.0, 0.0, calls=1)
    assert priority_key("remaining", short, 4.0)[0] == 0.0  # no floor: starved at 8 s
    assert priority_key("remaining", short, 4.0, min_wait_s=240.0)[0] == 1.0
    waited = Service(2.0, 240.0, 0.0, calls=1)
    assert priority_key("remaining", waited, 4.0, min_wait_s=240.0)[0] == 0.0
    # a long-served session still needs its ratio's worth beyond the floor
    long = Service(100.0, 300.0, 0.0, calls=20)
    assert priority_key("remaining", long, 4.0, min_wait_s=240.0)[0] == 1.0
    assert priority_key("remaining", Service(100.0, 400.0, 0.0, calls=20), 4.0,
                        min_wait_s=240.0)[0] == 0.0
    # a fresh session is never promoted; Autellix's guard ignores the floor
    assert priority_key("remaining", Service(0.0, 1e6, 0.0), 4.0, min_wait_s=240.0)[0] == 1.0
    assert priority_key("las", short, 8.0, min_wait_s=240.0)[0] == 0.0


def test_a_slot_yields_only_to_an_outranking_session_once_it_paid_for_its_switch() -> None:
    kw = dict(switch_in_s=1.0, switch_to_s={"b": 0.5, "c": 2.0}, min_slot_factor=10.0)
    first, second, third = (1.0, 5.0), (1.0, 10.0), (1.0, 20.0)
    # b's session comes before every session of the active model: yield after 10 x 1.5 s
    assert outranking_model(second, {"b": first}, slot_age_s=15.0, **kw).model == "b"
    assert outranking_model(second, {"b": first}, slot_age_s=14.9, **kw).model is None
    # the best waiting session decides the target, and its switch the minimum slot
    assert outranking_model(third, {"b": second, "c": first}, slot_age_s=29.0,
                            **kw).model is None
    assert outranking_model(third, {"b": second, "c": first}, slot_age_s=30.0,
                            **kw).model == "c"
    # the active model's own session (queued, running or returning soon) comes first: keep
    assert outranking_model(first, {"b": second}, slot_age_s=100.0, **kw).model is None
    assert outranking_model(first, {"b": first}, slot_age_s=100.0, **kw).model is None
    # the active model has nothing left: any waiting session outranks it
    assert outranking_model(None, {"b": third}, slot_age_s=15.0, **kw).model == "b"
    assert outranking_model(None, {}, slot_age_s=100.0, **kw).model is None
    # two models' best sessions tie: the one with more sessions waiting is the target
    tied = {"b": first, "c": first}
    assert outranking_model(third, tied, slot_age_s=30.0, **kw).model == "b"
    assert outranking_model(third, tied, slot_age_s=30.0, waiting_sessions={"b": 1, "c": 3},
                            **kw).model == "c"
    # ranks count over the sessions each slot serves: b's one better session does not
    # outrank an active model serving four (5 < 10, but 5 > 10 / 4) ...
    assert outranking_model(second, {"b": first}, slot_age_s=100.0, active_sessions=4,
                            **kw).model is None
    # ... and three waiting sessions of b outrank the active model's lone better one
    assert outranking_model(first, {"b": second}, slot_age_s=100.0, active_sessions=1,
                            waiting_sessions={"b": 3}, **kw).model == "b"


def test_a_returning_session_holds_the_slot_only_when_due_before_the_switch_is_over() -> None:
    now, margin = 100.0, 1.0
    # due within the switch (2 s): switching away would not even be over when it is back
    assert holds_slot(101.5, now, switch_s=2.0, overdue_margin_s=margin)
    assert holds_slot(102.0, now, switch_s=2.0, overdue_margin_s=margin)
    # due after the switch: the outranking session, waiting now, goes first
    assert not holds_slot(102.1, now, switch_s=2.0, overdue_margin_s=margin)
    # a staged (near-free) switch: only a session due at once holds the slot
    assert not holds_slot(100.5, now, switch_s=0.05, overdue_margin_s=margin)
    # late, but within the margin: still expected; beyond it: overdue, no longer holds
    assert holds_slot(99.5, now, switch_s=2.0, overdue_margin_s=margin)
    assert not holds_slot(99.0, now, switch_s=2.0, overdue_margin_s=margin)


def test_the_starvation_guard_in_force_is_the_queue_orders_own() -> None:
    talaria = preset("talaria")
    assert talaria.admission_order == "remaining"
    assert talaria.starvation_ratio == talaria.remaining_starvation_ratio == 4.0
    assert talaria.starvation_min_wait_s == talaria.slot_quantum_s
    assert preset("talaria", starvation_floor_s=120.0).starvation_min_wait_s == 120.0
    with pytest.raises(ValueError, match="starvation_floor_s"):
        preset("talaria", starvation_floor_s=-1.0)
    autellix = preset("baseline", queue_order="las", model_order="las")
    assert autellix.starvation_ratio == autellix.las_starvation_ratio == 8.0
    assert autellix.starvation_min_wait_s == 0.0
    with pytest.raises(ValueError, match="remaining_starvation_ratio"):
        preset("talaria", remaining_starvation_ratio=0.0)


def _priority_policy(**overrides: object) -> PolicyConfig:
    fields: dict[str, object] = dict(
        queue_order="remaining", model_order="priority", priority_switch=True,
        slot_close="drained", slot_quantum_s=1000.0, min_slot_factor=0.0,
        remaining_starvation_ratio=1000.0, soft_reservations=False)
    return preset("baseline", **{**fields, **overrides})


def _advanced_session_returns(policy: PolicyConfig) -> tuple[Timed, Timed]:
    """Session s (model a) has made two calls and counts as near its end (90 calls made:
    ~12 expected left, under the ~21 a session of the two fresh ones of b's slot); then
    sessions t and u of model b (none made) arrive, and while t's call runs, u's long call and
    s's third call queue. Whether b's slot yields to s decides which of the two goes first."""

    async def main() -> tuple[Timed, Timed]:
        inst = Instance("i", FakeEngine(["a", "b"], step_s=0.1), policy)
        await inst.start()
        try:
            await run_call(inst, call("s#0", "s", "a", 50, max_tokens=2))
            await run_call(inst, call("s#1", "s", "a", 60, max_tokens=2))
            inst.loop.sessions.gaps.sessions["s"].calls = 90
            t_task = asyncio.create_task(run_call(inst, call("t#0", "t", "b", 50, max_tokens=3)))
            await asyncio.sleep(0.15)
            u_task = asyncio.create_task(run_call(inst, call("u#0", "u", "b", 50,
                                                             max_tokens=40)))
            s_third = await run_call(inst, call("s#2", "s", "a", 70, max_tokens=2))
            await t_task
            return s_third, await u_task
        finally:
            await inst.stop()

    return run_virtual(main())


def test_an_instance_switches_back_to_the_session_that_comes_first() -> None:
    s_third, u_call = _advanced_session_returns(_priority_policy())
    # s (near its end) outranks b's two fresh sessions: b's slot closes once t's running call
    # ends, and s's call is served before u's long one is admitted
    assert s_third.done is not None and u_call.first is not None
    assert s_third.done < u_call.first
    # without the priority switch, b's slot stays open until b drains: u's call first
    s_plain, u_plain = _advanced_session_returns(
        _priority_policy(priority_switch=False))
    assert s_plain.done is not None and u_plain.done is not None
    assert u_plain.done < s_plain.first


def test_under_kv_pressure_the_session_that_comes_last_yields_first() -> None:
    async def main() -> tuple[list[str], list[str]]:
        orders = []
        for policy in (preset("talaria"), preset("+sp")):
            inst = Instance("i", FakeEngine(["a"]), policy)
            sessions = inst.loop.sessions
            # "near_end" has made 90 calls and returns last; "fresh" 1 call, back first
            for sid, calls, back in (("near_end", 90, 30.0), ("fresh", 1, 5.0)):
                sessions.gaps.on_arrival(sid, "a", 10, 0.0)
                sessions.gaps.sessions[sid].calls = calls
                sessions.gaps.sessions[sid].attained_s = 10.0
                sessions.reservations.add(Reservation(sid, "a", 0.0, back, 60.0, 4, True))
            orders.append([r.session_id for r in inst.loop.intake.yield_order("a", "other")])
        return orders[0], orders[1]

    by_priority, by_return = run_virtual(main())
    assert by_priority == ["fresh", "near_end"]  # fewest calls left stays on the device
    assert by_return == ["near_end", "fresh"]  # without session priority: latest return first


@dataclass
class _Waiting:
    call: CallRequest
    arrived: float
    continuation: bool = True


@pytest.mark.parametrize("order", ["remaining", "las", "program_fcfs", "lpm", "fifo"])
def test_a_waiting_calls_key_is_its_sessions_priority_key(order: str) -> None:
    """``SessionKeeper.waiting_key`` (which under ``remaining`` reads session histories
    directly) ranks each waiting call as ``priority_key`` of its session's ``service`` does,
    starved or not, unknown sessions included; ``best_waiting_key`` is their minimum."""
    rng = random.Random(7)
    policy = (preset("talaria") if order == "remaining"
              else preset("baseline", queue_order=order))
    assert policy.admission_order == order
    sessions = Instance("i", FakeEngine(["a"]), policy).sessions
    for n in range(40):
        sid = f"s{n}"
        sessions.gaps.on_arrival(sid, "a", 100, rng.uniform(0.0, 50.0))
        for _ in range(rng.randrange(0, 80)):
            sessions.gaps.on_end(sid, 100, 10, 60.0, None, False)
        sessions.gaps.on_service(sid, rng.choice([0.0, rng.uniform(0.0, 400.0)]),
                                 rng.choice([0.0, rng.uniform(0.0, 100.0)]))
    now = 1000.0
    waiting = [_Waiting(call(f"c{i}", f"s{rng.randrange(0, 50)}", "a", 8), rng.uniform(0.0, now))
               for i in range(200)]  # s40..s49 have no history here
    key = sessions.waiting_key(now)
    expected = [priority_key(order, sessions.service(c.call.session_id, now - c.arrived),
                             policy.starvation_ratio, min_wait_s=policy.starvation_min_wait_s)
                for c in waiting]
    assert [key(c) for c in waiting] == expected
    assert sessions.best_waiting_key(waiting, now) == min(expected)
    assert sessions.best_waiting_key([], now) is None
    if order == "remaining":  # both branches ran: some starved, some ranked by the prior
        assert {k[0] for k in expected} == {0.0, 1.0}
    kinds = set()
    for size in (1, 2, 3, 5, 8, 13):  # subsets with and without a starved call, repeats too
        for _ in range(60):
            picked = [rng.randrange(len(waiting)) for _ in range(size)]
            best = min(expected[i] for i in picked)
            assert sessions.best_waiting_key([waiting[i] for i in picked], now) == best
            kinds.add(best[:1])
    if order == "remaining":
        assert kinds == {(0.0,), (1.0,)}


def test_the_best_waiting_key_breaks_equal_waits_and_equal_ranks_by_first_arrival() -> None:
    """Under ``remaining``: two starved calls that have waited as long rank by their
    sessions' first arrival, as do two unstarved sessions with as many calls made."""
    sessions = Instance("i", FakeEngine(["a"]), preset("talaria")).sessions
    for sid, first in (("late", 30.0), ("early", 10.0)):
        sessions.gaps.on_arrival(sid, "a", 100, first)
        sessions.gaps.on_end(sid, 100, 10, first + 1.0, None, False)
        sessions.gaps.on_service(sid, 0.0, 1.0)
    ratio = sessions.policy.starvation_ratio
    floor = sessions.policy.starvation_min_wait_s
    starved_at = max(ratio * 1.0, floor) + 100.0
    both = [_Waiting(call("c1", "late", "a", 8), 0.0), _Waiting(call("c2", "early", "a", 8), 0.0)]
    for calls in (both, both[::-1]):
        assert sessions.best_waiting_key(calls, starved_at) == (0.0, -starved_at, 10.0)
        key = sessions.best_waiting_key(calls, 0.0)
        assert key == (1.0, swe_agent_prior().expected_remaining(1), 10.0)
