"""Each peer's distinguishing mechanism changes its result on a small trace built to show it:
sleep/wake switching and dropped KV (vllm_sleep), a host KV tier that survives switches
(LMCache), a host tier for evictions within a slot that a switch flushes (HiCache), hard
TTL pins under KV pressure (Continuum), least-attained-service model order (Autellix), and
token-level preemption (Aegaeon)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.sim.engine import SimEngine
from workloads.benchmark.report import PolicyStats, summarize
from workloads.replay.cluster import ClusterSpec
from workloads.replay.driver import ReplayResult, run_sim
from workloads.replay.systems import PEERS, SYSTEMS, SystemConfig
from workloads.traces.trace import Call, Session

QWEN, GLM, MISTRAL = "qwen3-235b-a22b", "glm-4.5-air", "mistral-large-2407"
DRAINED = {"slot_close": "drained", "slot_quantum_s": 5.0}


def _session(sid: str, model: str, shapes: list[tuple[int, int, float | None]],
             arrival: float = 0.0) -> Session:
    return Session(sid, model, tuple(Call(p, o, g) for p, o, g in shapes), arrival_s=arrival)


def _run(system: SystemConfig, trace: list[Session], spec: ClusterSpec) -> tuple[ReplayResult, PolicyStats]:
    result = run_sim(trace, system, spec)
    assert result.failed_calls == 0
    return result, summarize(result)


def _mean(result: ReplayResult, prefix: str) -> float:
    scts = [s.sct_s for s in result.sessions if s.session_id.startswith(prefix)]
    return sum(scts) / len(scts)


TWO_MODELS = ClusterSpec(models=(GLM, MISTRAL))
# One session per model, calls interleaving: every call needs a switch.
INTERLEAVED = [
    _session("g", GLM, [(8000, 50, 1.0), (9000, 50, 1.0), (10000, 50, None)]),
    _session("m", MISTRAL, [(8000, 50, 1.0), (9000, 50, 1.0), (10000, 50, None)]),
]


def test_vllm_sleep_pays_sleep_and_wake_and_drops_kv() -> None:
    slow, slow_st = _run(PEERS["vllm_sleep"].with_setting(**DRAINED), INTERLEAVED, TWO_MODELS)
    fast_system = replace(PEERS["vllm_sleep"], sleep_wake_efficiency=1.0)  # a plain copy's rate
    fast, fast_st = _run(fast_system.with_setting(**DRAINED), INTERLEAVED, TWO_MODELS)
    assert slow_st.switches == fast_st.switches > 0
    assert slow_st.sct_mean_s > fast_st.sct_mean_s + 1.0  # the link efficiency is what differs
    assert slow_st.tokens_recomputed > 0 and slow_st.tokens_restored == 0  # KV dropped on sleep


def test_lmcache_keeps_kv_across_sleep() -> None:
    _, plain = _run(PEERS["vllm_sleep"].with_setting(**DRAINED), INTERLEAVED, TWO_MODELS)
    _, lmcache = _run(PEERS["vllm_sleep_lmcache"].with_setting(**DRAINED), INTERLEAVED, TWO_MODELS)
    assert lmcache.tokens_restored == plain.tokens_recomputed > 0
    assert lmcache.tokens_recomputed == 0
    assert lmcache.sct_mean_s < plain.sct_mean_s


def test_hicache_serves_evictions_within_a_slot_but_a_switch_flushes_it() -> None:
    # One model, a KV region for three sessions' prefixes: sessions evict each other's KV.
    spec = ClusterSpec(models=(GLM,), kv_tokens=24_576)
    trace = [_session(f"s{i}", GLM, [(7000 + 600 * k, 40, 2.0 if k < 3 else None)
                                     for k in range(4)], arrival=0.7 * i) for i in range(4)]
    _, plain = _run(PEERS["vllm_sleep"].with_setting(**DRAINED), trace, spec)
    _, hicache = _run(PEERS["sglang_hicache"].with_setting(**DRAINED), trace, spec)
    assert plain.tokens_recomputed > 0 and plain.tokens_restored == 0
    assert hicache.tokens_restored > 0 and hicache.tokens_recomputed < plain.tokens_recomputed
    assert hicache.sct_mean_s < plain.sct_mean_s
    # Across switches (no eviction within a slot) its host tier is gone: it recomputes.
    _, switched = _run(PEERS["sglang_hicache"].with_setting(**DRAINED), INTERLEAVED, TWO_MODELS)
    assert switched.tokens_restored == 0 and switched.tokens_recomputed > 0


def test_continuum_pins_keep_kv_through_tool_calls_under_pressure() -> None:
    # Long prefixes (expensive to rebuild), short tool gaps, KV for about two of three.
    spec = ClusterSpec(models=(MISTRAL,), kv_tokens=80_000)
    trace = [_session(f"c{i}", MISTRAL, [(30_000 + 600 * k, 30, 0.5 if k < 11 else None)
                                         for k in range(12)], arrival=1.5 * i) for i in range(3)]
    _, plain = _run(PEERS["vllm_sleep"].with_setting(**DRAINED), trace, spec)
    pinned, continuum = _run(PEERS["continuum_ttl"].with_setting(**DRAINED), trace, spec)
    assert continuum.counters["reservations"] > 0
    # under the engine's own admission a decode that finds no block still preempts (and
    # recomputes) a call, pins or not: the pins save more than half here
    assert continuum.tokens_recomputed < plain.tokens_recomputed * 0.5
    assert continuum.sct_mean_s < plain.sct_mean_s * 0.7
    # A call handed to the engine, preempted by a running call's decode, then left waiting
    # there once the calls in flight ended and pinned their KV, makes pins yield (the
    # deadlock guard: nothing runs); before, they held until their TTL (mean SCT 76.5 s
    # against 49.4, no pin ever yielded).
    assert continuum.counters["reservations_yielded"] > 0
    # Pins that yield to every call needing room (soft reservations) keep nearly nothing:
    # a call queued behind a pinned session's own call asks for room once that pin is
    # released, not on the blocks the release shows free (641k tokens against 282k).
    soft = PEERS["continuum_ttl"].with_setting(**DRAINED).with_policy(hard_pins=False)
    _, soft_st = _run(soft, trace, spec)
    assert soft_st.tokens_recomputed > continuum.tokens_recomputed * 1.5


def test_autellix_serves_the_least_served_model_next() -> None:
    spec = ClusterSpec(models=(QWEN, GLM, MISTRAL))
    long_calls = [(6000 + 400 * k, 200, 0.2 if k < 9 else None) for k in range(10)]
    trace = [_session("qlong", QWEN, long_calls), _session("glong", GLM, long_calls)]
    trace += [_session(f"short{i}", MISTRAL, [(3000, 20, 0.3), (3400, 20, None)],
                       arrival=3.0 + i) for i in range(3)]
    setting = {"slot_close": "quantum", "slot_quantum_s": 5.0}
    _, rounds = _run(PEERS["vllm_sleep"].with_setting(**setting), trace, spec)
    _, las = _run(PEERS["autellix"].with_setting(**setting), trace, spec)
    assert las.sct_mean_s < rounds.sct_mean_s - 1.0
    assert las.switches < rounds.switches


def test_aegaeon_preempts_a_long_call_for_another_model() -> None:
    trace = [_session("long", GLM, [(6000, 3000, None)])]
    trace += [_session(f"short{i}", MISTRAL, [(3000, 20, 0.3), (3400, 20, None)],
                       arrival=2.0 + i) for i in range(3)]
    setting = {"slot_close": "quantum", "slot_quantum_s": 2.0}
    preempting, st = _run(PEERS["aegaeon"].with_setting(**setting), trace, TWO_MODELS)
    draining, _ = _run(PEERS["aegaeon"].with_setting(**setting).with_policy(preempt=False),
                       trace, TWO_MODELS)
    assert st.counters["preemptions"] > 0
    assert _mean(preempting, "short") < _mean(draining, "short") / 2
    assert _mean(preempting, "long") > _mean(draining, "long")  # it waited for the others
    long_call = next(s for s in preempting.sessions if s.session_id == "long").calls[0]
    assert long_call.output_tokens == 3000  # resumed where it was suspended
    assert long_call.split is not None and long_call.split["slot_wait"] > 0
    assert pytest.approx(sum(long_call.split.values())) == long_call.done_s - long_call.sent_s


def test_talaria_stages_every_shard_only_where_host_kv_keeps_what_the_kv_region_gives_up() -> None:
    """With host KV the staging region fits the largest shard (Qwen3-235B switches D2D);
    without it the region fits the second largest, and the KV region keeps the difference."""
    models = list(ClusterSpec().models)
    engines = {name: SimEngine(models, SYSTEMS[name].engine_config())
               for name in ("talaria", "-host_kv", "+staging", "+host_kv")}
    largest = models[0]
    assert engines["talaria"].can_stage(largest) and engines["+host_kv"].can_stage(largest)
    assert not engines["-host_kv"].can_stage(largest)
    assert not engines["+staging"].can_stage(largest)
    assert all(e.can_stage(m) for e in engines.values() for m in models[1:])
    assert (engines["-host_kv"].kv_capacity_blocks(largest)
            > engines["talaria"].kv_capacity_blocks(largest))
