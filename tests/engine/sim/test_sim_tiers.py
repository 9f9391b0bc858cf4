"""The simulated engine's host KV tiers (Talaria's restore pipelined over layer groups or
before the forward pass, write-through LMCache with its store cost, plain or layer-wise,
HiCache's overlapped loads and flush on a switch), token-level suspend and resume, and an
explicit KV capacity."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.interface import EngineRequest, StepResult
from engine.sampling_params import SamplingParams
from engine.sim.cost_model import CostModel
from engine.sim.engine import SimEngine, SimEngineConfig
from engine.sim.kv_tier import KV_TIERS
from engine.sim.model_spec import ModelSpec
from substrate.devices import server_preset

GLM, MISTRAL = "glm-4.5-air", "mistral-large-2407"
BS = 64


def make(**cfg: object) -> SimEngine:
    config = SimEngineConfig(block_size=BS, staging=False, max_fused_decode_steps=1, **cfg)
    return SimEngine([GLM, MISTRAL], config, clock=lambda: 0.0)


def cost(model: str = GLM) -> CostModel:
    return CostModel(server_preset("h200x8"), ModelSpec.load(model), 8)


def prompt(n: int) -> list[int]:
    return [(i * 13) % 9000 + 1 for i in range(n)]


def run(engine: SimEngine, rid: str, tokens: list[int], out: int = 2, model: str = GLM,
        session: str = "s") -> list[StepResult]:
    engine.add_request(EngineRequest(rid, tokens, SamplingParams(max_tokens=out), model=model,
                                     session_id=session))
    steps = []
    while engine.has_unfinished():
        steps.append(engine.step())
    return steps


def _switch_away_and_back(engine: SimEngine) -> tuple[list[StepResult], list[int]]:
    engine.activate(GLM)
    first = prompt(4000)
    run(engine, "c1", first)
    engine.activate(MISTRAL)
    engine.activate(GLM)
    return run(engine, "c2", first + prompt(500)), first


def test_lmcache_writes_through_as_it_computes_and_pays_for_the_store() -> None:
    lmcache = make(kv_tier="lmcache")
    lmcache.activate(GLM)
    steps = run(lmcache, "c1", prompt(4000))
    blocks = 4000 // BS
    assert lmcache.host_kv.bytes_of(GLM) == blocks * BS * cost().kv_bytes_per_token_per_gpu()
    # LMCache's rates were measured on one GPU; here every GPU stores at once
    store_s = (blocks * BS * cost().kv_bytes_per_token_per_gpu()
               / cost().host_copy_rate(KV_TIERS["lmcache"].store_bytes_per_s))
    assert steps[0].seconds == pytest.approx(cost().chunks_step_seconds([(4000, 0)]) + store_s)
    # it survives sleep and wake: the returning call restores at LMCache's retrieve rate
    asleep = make(kv_tier="lmcache", switch="sleep_wake", stable_substrate=False)
    restored, _ = _switch_away_and_back(asleep)
    kept = (4000 // BS) * BS
    assert restored[0].num_prefill_tokens == 4500 - kept
    retrieve_s = (kept * cost().kv_bytes_per_token_per_gpu()
                  / cost().host_copy_rate(KV_TIERS["lmcache"].restore_bytes_per_s))
    assert restored[0].seconds > cost().chunks_step_seconds([(4500 - kept, kept)]) + retrieve_s


def test_hicache_loads_overlap_compute_and_a_switch_flushes_the_tier() -> None:
    hicache = make(kv_tier="hicache")
    steps, _ = _switch_away_and_back(hicache)
    assert steps[0].num_prefill_tokens == 4500  # flushed on release: nothing to restore
    assert hicache.host_kv.bytes_of(GLM) > 0  # the new call's blocks were written through
    # the tier's step price: the larger of compute and load, not their sum
    tier = hicache.host_tier
    assert tier.step_seconds(cost(), 0.5, 0.1) == 0.5
    assert tier.step_seconds(cost(), 0.001, 0.3) == 0.3


def test_talaria_restores_inside_the_forward_pass_pipelined_over_layer_groups() -> None:
    """Four groups: copy group g+1 while group g computes, so the step costs the longer
    stage plus a quarter of the shorter one; restored before the forward, the sum."""
    layered = make(kv_tier="offload").host_tier
    assert layered.step_seconds(cost(), 1.0, 0.4) == pytest.approx(1.0 + 0.4 / 4)
    assert layered.step_seconds(cost(), 0.2, 1.0) == pytest.approx(1.0 + 0.2 / 4)
    assert layered.step_seconds(cost(), 1.0, 0.0) == 1.0
    serial = make(kv_tier="offload_serial").host_tier
    assert serial.step_seconds(cost(), 1.0, 0.4) == pytest.approx(1.4)
    # a device whose copies take the cores the step computes on overlaps nothing
    cpu = cost()
    cpu = CostModel(replace(cpu.server, device=replace(cpu.device, copies_overlap_compute=False)),
                    cpu.model, 8)
    assert layered.step_seconds(cpu, 1.0, 0.4) == pytest.approx(1.4)
    assert make(kv_tier="hicache").host_tier.step_seconds(cpu, 1.0, 0.4) == pytest.approx(1.4)
    # the returning call's first step, end to end
    firsts = {}
    for name in ("offload", "offload_serial"):
        engine = make(kv_tier=name)
        engine.activate(GLM)
        first = prompt(4000)
        run(engine, "c1", first)
        engine.offload_kv(["s"])
        engine.activate(MISTRAL)
        engine.activate(GLM)
        steps = run(engine, "c2", first + prompt(500))
        kept = (len(first) // BS) * BS
        assert steps[0].num_prefill_tokens == 4500 - kept
        firsts[name] = steps[0].seconds
    restore_s = cost().kv_restore_seconds(kept)
    compute_s = cost().chunks_step_seconds([(4500 - kept, kept)])
    assert firsts["offload"] == pytest.approx(
        max(restore_s + compute_s / 4, compute_s + restore_s / 4))
    assert firsts["offload_serial"] == pytest.approx(compute_s + restore_s)


def test_layerwise_lmcache_stores_alongside_the_compute() -> None:
    plain = make(kv_tier="lmcache").host_tier
    layered = make(kv_tier="lmcache_layerwise").host_tier
    assert plain.with_store(cost(), 1.0, 0.3) == pytest.approx(1.3)
    assert layered.with_store(cost(), 1.0, 0.3) == 1.0
    assert layered.with_store(cost(), 0.1, 0.3) == 0.3
    assert layered.step_seconds(cost(), 0.5, 0.2) == 0.5  # retrieved layer by layer too


def test_suspend_parks_calls_in_flight_and_activation_resumes_them() -> None:
    engine = make()
    engine.activate(GLM)
    engine.add_request(EngineRequest("long", prompt(3000), SamplingParams(max_tokens=50),
                                     model=GLM, session_id="s"))
    for _ in range(6):
        engine.step()
    computed = engine.scheduler.requests["long"].num_computed_tokens
    report = engine.suspend()
    assert report.seconds == pytest.approx(cost().kv_offload_seconds(computed))
    assert engine.has_unfinished() and engine.scheduler.num_running == 0
    engine.activate(MISTRAL)  # allowed: nothing of GLM is unfinished in the scheduler
    engine.abort("nope")
    back = engine.activate(GLM)
    assert back.seconds == pytest.approx(cost().switch_seconds_host()
                                         + cost().kv_restore_seconds(computed))
    events = []
    while engine.has_unfinished():
        events += engine.step().events
    assert events[-1].finished and events[-1].num_output_tokens == 50
    assert engine.stats().extra["swapped_in_tokens"] == computed


def test_a_suspended_call_can_be_aborted() -> None:
    engine = make()
    engine.activate(GLM)
    engine.add_request(EngineRequest("x", prompt(500), SamplingParams(max_tokens=20), model=GLM))
    engine.step()
    engine.suspend()
    engine.abort("x")
    result = engine.step()
    assert [e.request_id for e in result.events] == ["x"] and result.events[0].finished
    assert not engine.has_unfinished()


def test_explicit_kv_capacity() -> None:
    engine = make(kv_tokens=BS * 10)
    assert engine.kv_capacity_blocks(GLM) == engine.kv_capacity_blocks(MISTRAL) == 10
    with pytest.raises(ValueError, match="kv_tokens"):
        SimEngineConfig(kv_tokens=1)
