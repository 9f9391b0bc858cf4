"""Placement policies on hand-built instance states."""

from __future__ import annotations

from dataclasses import replace

import pytest
from router_fakes import model_state

from router.instances.placement import (
    CacheAware,
    LoadOnly,
    PlacementCall,
    PlacementContext,
    Talaria,
    make_policy,
)
from router.sessions.prefix_chain import ChainSample
from router.sessions.table import SessionBranch
from talaria.protocol import InstanceState, Residency, SessionKV
from talaria.protocol.text import block_hashes

BS = 16


def call(session: str = "s1", prompt_len: int = 4096, model: str = "m", prefix_seed: int = 0) -> PlacementCall:
    tokens = [(prefix_seed + i) % 500 for i in range(prompt_len)]
    return PlacementCall(model, session, prompt_len, block_hashes(tokens, BS), BS, expected_output=64)


def two_instances() -> dict[str, InstanceState]:
    """a: model m active, holds session s1's KV, a little busy; b: m only in host, idle."""
    a = InstanceState(
        instance_id="a",
        active_model="m",
        models={
            "m": model_state("m", Residency.ACTIVE, queued_tokens=2000, running_tokens=3000, running_calls=1,
                             prefill_tokens_per_s=10_000.0),
            "x": model_state("x", Residency.HOST, switch_host_s=4.0),
        },
        sessions={"s1": SessionKV("s1", "m", device_tokens=4000)},
    )
    b = InstanceState(
        instance_id="b",
        active_model="x",
        models={
            "m": model_state("m", Residency.HOST, wait_s=1.0, switch_host_s=4.0, prefill_tokens_per_s=10_000.0),
            "x": model_state("x", Residency.ACTIVE),
        },
    )
    return {"a": a, "b": b}


def test_talaria_prefers_active_model_with_session_kv() -> None:
    states = two_instances()
    policy = Talaria()
    assert policy.choose(call(), None, states, {"a", "b"}) == ["a", "b"]
    est_a = policy.estimate("a", call(), None, states)
    est_b = policy.estimate("b", call(), None, states)
    assert est_a.switch_s == 0.0 and est_a.wait_s == 0.0
    assert est_a.local_tokens == 4000
    assert est_a.rebuild_s == pytest.approx(96 / 10_000)
    assert est_b.switch_s == 4.0 and est_b.wait_s == 1.0
    assert est_b.rebuild_s == pytest.approx(4096 / 10_000)


def test_load_only_picks_least_loaded_despite_cache() -> None:
    states = two_instances()
    assert LoadOnly().choose(call(), None, states, {"a", "b"}) == ["b", "a"]


def test_load_only_counts_router_side_outstanding_work() -> None:
    ctx = PlacementContext()
    policy = LoadOnly(ctx)
    empty = {"a": InstanceState("a"), "b": InstanceState("b")}
    assert policy.choose(call(), None, empty, {"a", "b"})[0] == "a"
    ctx.add("a", 100, 1000)
    assert policy.choose(call(), None, empty, {"a", "b"})[0] == "b"
    ctx.remove("a", 1000)
    assert policy.choose(call(), None, empty, {"a", "b"})[0] == "a"


def test_cache_aware_picks_longest_prefix_from_router_index() -> None:
    ctx = PlacementContext()
    policy = CacheAware(ctx)
    states = {"a": InstanceState("a"), "b": InstanceState("b"), "c": InstanceState("c")}
    c = call(prompt_len=1024)
    ctx.prefix_index.insert("b", "m", c.block_hashes[:10])
    ctx.prefix_index.insert("c", "m", c.block_hashes[:40])
    ctx.prefix_index.insert("a", "m", c.block_hashes[5:60])  # not a prefix: matches nothing
    assert policy.choose(c, None, states, {"a", "b", "c"}) == ["c", "b", "a"]
    other_model = PlacementCall("z", "s", 1024, c.block_hashes, BS)
    assert policy.choose(other_model, None, states, {"a", "b", "c"}) == ["a", "b", "c"]


def test_cache_aware_ties_broken_by_load() -> None:
    ctx = PlacementContext()
    states = two_instances()
    states["a"].sessions.clear()
    assert CacheAware(ctx).choose(call(), None, states, {"a", "b"}) == ["b", "a"]


def test_unhealthy_and_incapable_instances_are_left_out() -> None:
    states = two_instances()
    states["c"] = InstanceState("c", models={"x": model_state("x")})  # cannot serve m
    states["d"] = InstanceState("d", models={"m": model_state("m", Residency.ABSENT)})
    for name in ("load", "cache_aware", "talaria"):
        policy = make_policy(name)
        assert policy.choose(call(), None, states, {"b", "c", "d"}) == ["b"]
        assert policy.choose(call(), None, states, set()) == []


def test_unknown_policy_name() -> None:
    with pytest.raises(ValueError, match="unknown placement policy 'nope'"):
        make_policy("nope")


def test_host_kv_restore_is_cheaper_than_prefill() -> None:
    states = {
        "a": InstanceState("a", models={"m": model_state(
            "m", Residency.STAGED, switch_staged_s=0.2, kv_bytes_per_token=1000,
            kv_restore_bytes_per_s=1e9, prefill_tokens_per_s=1000.0)},
            sessions={"s1": SessionKV("s1", "m", host_tokens=4000)}),
        "b": InstanceState("b", models={"m": model_state(
            "m", Residency.STAGED, switch_staged_s=0.2, prefill_tokens_per_s=1000.0)}),
    }
    policy = Talaria()
    est = policy.estimate("a", call(), None, states)
    assert est.switch_s == 0.2
    assert est.rebuild_s == pytest.approx(4000 * 1000 / 1e9 + 96 / 1000)
    assert policy.choose(call(), None, states, {"a", "b"}) == ["a", "b"]


def test_a_session_stays_with_its_kv_and_new_sessions_go_to_the_least_loaded() -> None:
    record = SessionBranch("s1", "m")
    states = {
        "a": InstanceState("a", models={"m": model_state("m", prefill_tokens_per_s=10_000.0)},
                           sessions={"s1": SessionKV("s1", "m", device_tokens=4000)}),
        "b": InstanceState("b", models={"m": model_state("m", prefill_tokens_per_s=10_000.0)}),
    }
    policy = Talaria()
    assert policy.choose(call(), record, states, {"a", "b"})[0] == "a"
    # a's queue grows past a fresh prefill's cost on b: the session still stays with its KV
    # (its later calls would follow it), though the estimate says b is quicker for this call
    states["a"].models["m"].queued_tokens = 8000
    assert policy.estimate("a", call(), record, states).total_s > \
        policy.estimate("b", call(), record, states).total_s
    assert policy.choose(call(), record, states, {"a", "b"})[0] == "a"
    # its KV's instance unhealthy: it goes elsewhere
    assert policy.choose(call(), record, states, {"b"}) == ["b"]
    # a new session (no KV anywhere) goes to the least loaded instance, whatever the model's
    # residency; at equal load the estimate prefers the active model
    other = SessionBranch("s2", "m")
    states["a"].models["m"].queued_tokens = 0
    states["b"].models["m"].residency = Residency.HOST
    policy.ctx.add("a", 100, 5000)
    assert policy.choose(call(), other, states, {"a", "b"})[0] == "b"
    policy.ctx.remove("a", 5000)
    assert policy.choose(call(), other, states, {"a", "b"})[0] == "a"


def test_host_kv_holds_a_session_only_where_its_model_is_active() -> None:
    """KV in host memory of a model switched out there, or staged there for the next slot,
    does not hold the session: it goes where load says (an instance with its model active),
    and stays while its model is active where its KV is, or staged while the slot is its own
    side call's model's."""
    record = SessionBranch("s1", "m")
    states = {
        "a": InstanceState("a", models={"m": model_state("m", Residency.HOST),
                                        "x": model_state("x", Residency.ACTIVE)},
                           sessions={"s1": SessionKV("s1", "m", host_tokens=4000)}),
        "b": InstanceState("b", models={"m": model_state("m", Residency.ACTIVE)}),
    }
    policy = Talaria()
    policy.ctx.add("a", 0, 100)  # a a little busier: load decides
    assert policy.estimate("a", call(), record, states).local_tokens == 4000
    assert not policy.estimate("a", call(), record, states).resident
    assert policy.choose(call(), record, states, {"a", "b"}) == ["b", "a"]
    states["a"].models["m"].residency = Residency.STAGED
    assert policy.choose(call(), record, states, {"a", "b"}) == ["b", "a"]
    # staged for the session's own side call, which holds the slot (x active on a): it stays
    side = replace(call(), siblings=(("a", "x"),))
    assert policy.choose(side, record, states, {"a", "b"}) == ["a", "b"]
    # a side call that ran elsewhere, or of a model not holding the slot, holds nothing
    for siblings in ((("b", "x"),), (("a", "m"),)):
        assert policy.choose(replace(call(), siblings=siblings), record, states,
                             {"a", "b"}) == ["b", "a"]
    states["a"].models["m"].residency = Residency.ACTIVE
    assert policy.choose(call(), record, states, {"a", "b"}) == ["a", "b"]


def test_kv_memory_stall_adds_pressure() -> None:
    full = InstanceState("a", models={"m": model_state("m", running_calls=2, running_tokens=1000,
                                                            decode_step_s=0.01)},
                         total_kv_blocks=1000, free_kv_blocks=100, reserved_kv_blocks=80, block_size=BS)
    roomy = InstanceState("a", models={"m": model_state("m", running_calls=2, running_tokens=1000,
                                                             decode_step_s=0.01)},
                          total_kv_blocks=1000, free_kv_blocks=900, block_size=BS)
    policy = Talaria()
    stalled = policy.estimate("a", call(), None, {"a": full}).queue_s
    free = policy.estimate("a", call(), None, {"a": roomy}).queue_s
    assert free == 0.0
    assert stalled == pytest.approx(500 * 0.01)


def test_prefix_index_counts_only_when_model_active() -> None:
    ctx = PlacementContext()
    c = call()
    ctx.prefix_index.insert("a", "m", c.block_hashes)
    policy = Talaria(ctx)
    active = {"a": InstanceState("a", models={"m": model_state("m")})}
    switched = {"a": InstanceState("a", models={"m": model_state("m", Residency.HOST)})}
    assert policy.estimate("a", c, None, active).local_tokens == 4095
    assert policy.estimate("a", c, None, switched).local_tokens == 0


def test_reported_session_kv_counts_only_as_far_as_the_prompt_extends_it() -> None:
    states = {"a": InstanceState("a", models={"m": model_state("m")},
                                 sessions={"s1": SessionKV("s1", "m", device_tokens=4000, host_tokens=4000)})}
    record = SessionBranch("s1", "m")
    c = call()
    diverged = c.block_hashes[:10] + [12345] * 200  # diverged after block 10
    record.kv = ChainSample.of(diverged, marks=(9,))  # where its prompt ended: sampled
    policy = Talaria()
    assert policy.local_tokens("a", c, record, states) == (160, 0)
    record.kv = ChainSample.of(diverged)  # unsampled: the nearest sample below counts
    assert 0 < policy.local_tokens("a", c, record, states)[0] <= 160
    record.kv = ChainSample.of(c.block_hashes)  # the new prompt extends the session's KV
    assert policy.local_tokens("a", c, record, states) == (4000, 0)
    assert policy.local_tokens("a", c, None, states) == (4000, 0)
