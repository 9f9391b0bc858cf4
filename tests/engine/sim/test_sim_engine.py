"""The simulated engine: modelled seconds, prefix reuse, host KV restore, switches, capacity."""

from __future__ import annotations

import pytest

from engine.interface import (
    EngineRequest,
    FinishReason,
    MultiModelEngineProtocol,
    Residency,
    StepResult,
    TokenEvent,
)
from engine.sampling_params import SamplingParams
from engine.served_models import ModelNotActiveError
from engine.sim.engine import DecodeLine, SimEngine, SimEngineConfig
from engine.sim.model_spec import ModelSpec
from engine.sim.switching import SleepWakeRates
from engine.sim.tokens import token_ids
from tests.engine.sim.sim_helpers import (
    BS,
    GLM,
    MISTRAL,
    QWEN,
    Clock,
    cost,
    drain,
    make,
    output,
    req,
    tokens,
)


def test_implements_the_multi_model_protocol() -> None:
    engine = make()
    assert isinstance(engine, MultiModelEngineProtocol)
    assert engine.simulated is True
    assert engine.model_names == [QWEN, GLM]
    assert engine.active_model is None


def test_prefill_and_decode_cost_what_the_cost_model_says() -> None:
    engine = make(max_fused_decode_steps=8)
    engine.activate(QWEN)
    engine.add_request(req("a", tokens(10_000), max_tokens=4))
    steps, events = drain(engine)
    c = cost()
    # chunked prefill: 8192 then 1808 tokens (the second chunk samples the first token);
    # then the remaining 3 tokens are one fused decode step of three sub-steps.
    expected = [
        c.chunks_step_seconds([(8192, 0)]),
        c.chunks_step_seconds([(1808, 8192)]),
        sum(c.decode_step_seconds(1, 10_000 + j) for j in range(3)),
    ]
    assert [s.seconds for s in steps] == pytest.approx(expected, rel=1e-12)
    assert [s.num_prefill_tokens for s in steps] == [8192, 1808, 0]
    assert [s.num_decode_tokens for s in steps] == [0, 0, 3]
    assert [s.num_steps for s in steps] == [1, 1, 3]
    evs = events["a"]
    assert [len(ev.new_token_ids) for ev in evs] == [1, 3]
    last = evs[-1]
    assert last.finished and last.finish_reason == FinishReason.LENGTH
    assert (last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens) == (
        10_000, 4, 0)


def test_fusing_decode_steps_changes_neither_time_nor_tokens() -> None:
    runs = []
    for fused in (1, 8):
        engine = make(max_fused_decode_steps=fused)
        engine.activate(QWEN)
        for i, n in enumerate((3000, 5000, 7000)):
            engine.add_request(req(f"r{i}", tokens(n, 100 * i), max_tokens=11 + 7 * i))
        steps, events = drain(engine)
        runs.append((steps, {rid: output(evs) for rid, evs in events.items()}))
    (plain, out1), (fused_steps, out8) = runs
    assert out1 == out8
    assert [len(out1[r]) for r in ("r0", "r1", "r2")] == [11, 18, 25]
    assert sum(s.seconds for s in fused_steps) == pytest.approx(
        sum(s.seconds for s in plain), rel=1e-12)
    assert sum(s.num_steps for s in fused_steps) == len(plain)
    assert len(fused_steps) < len(plain)


def test_decode_line_is_exact_across_the_compute_memory_crossing() -> None:
    c = cost(MISTRAL)  # dense: at 256 sequences compute-bound at short context
    line = DecodeLine.of(c, 256)
    parts = [c.step_cost([], 256, ctx) for ctx in (0, 2_000_000)]
    assert not parts[0].memory_bound and parts[1].memory_bound
    # find the crossing context, then price a window of steps around it
    lo, hi = 0, 2_000_000
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if not c.step_cost([], 256, mid).memory_bound else (lo, mid)
    start, n = lo - 256 * 20, 50
    expected = sum(c.decode_step_seconds(256, start + 256 * j) for j in range(n))
    assert line.seconds(start, n) == pytest.approx(expected, rel=1e-12)
    assert line.seconds(start) == pytest.approx(c.decode_step_seconds(256, start), rel=1e-12)


def test_continuation_reuses_the_device_prefix_and_pays_only_the_suffix() -> None:
    engine = make()
    engine.activate(QWEN)
    prompt = tokens(5000)
    engine.add_request(req("c1", prompt, max_tokens=10, session="s"))
    _, ev1 = drain(engine)
    out = output(ev1["c1"])
    # 5009 tokens computed (the last sampled token has no KV): 78 full blocks on device
    assert engine.session_kv_tokens("s") == (78 * BS, 0)
    prompt2 = prompt + out + tokens(2000, 50_000)
    engine.add_request(req("c2", prompt2, max_tokens=2, session="s"))
    first = engine.step()
    cached = 78 * BS
    assert first.seconds == pytest.approx(
        cost().chunks_step_seconds([(len(prompt2) - cached, cached)]), rel=1e-12)
    assert first.num_prefill_tokens == len(prompt2) - cached
    _, ev2 = drain(engine)
    last = ev2["c2"][-1]
    assert last.num_cached_tokens == cached and last.num_restored_tokens == 0
    assert engine.stats().cached_tokens_total == cached


def _offload_switch_and_return(engine: SimEngine) -> tuple[StepResult, TokenEvent, list[int]]:
    engine.activate(QWEN)
    prompt = tokens(6000)
    engine.add_request(req("c1", prompt, max_tokens=5, session="s"))
    _, ev1 = drain(engine)
    prompt2 = prompt + output(ev1["c1"]) + tokens(1000, 70_000)
    engine.offload_kv(None)
    engine.activate(GLM)
    assert engine.session_kv_tokens("s")[0] == 0  # device KV of the outgoing model is gone
    engine.activate(QWEN)
    engine.add_request(req("c2", prompt2, max_tokens=1, session="s"))
    first = engine.step()
    _, ev2 = drain(engine)
    events = first.events + [e for evs in ev2.values() for e in evs]
    return first, events[-1], prompt2


def test_offloaded_kv_is_restored_from_host_after_a_switch() -> None:
    engine = make(host_kv_bytes=10**12)
    first, last, prompt2 = _offload_switch_and_return(engine)
    restored = 6004 // BS * BS  # 6004 computed tokens -> 93 full blocks
    assert last.num_restored_tokens == restored and last.num_cached_tokens == restored
    c = cost()
    compute_s = c.chunks_step_seconds([(len(prompt2) - restored, restored)])
    restore_s = c.kv_restore_seconds(restored)
    # copied inside the forward pass, four layer groups pipelined with the compute
    assert first.seconds == pytest.approx(
        max(compute_s + restore_s / 4, restore_s + compute_s / 4), rel=1e-12)
    assert engine.session_kv_tokens("s")[1] == restored
    stats = engine.stats()
    assert stats.restored_tokens_total == restored
    assert stats.extra["host_kv_used_bytes"] == 93 * BS * c.kv_bytes_per_token_per_gpu()
    assert engine.session_kv_tokens("s")[0] > 0
    engine.forget_session("s")
    assert engine.session_kv_tokens("s") == (0, 0)


def test_offload_reports_bytes_and_seconds_once_per_block() -> None:
    engine = make(host_kv_bytes=10**12)
    engine.activate(QWEN)
    engine.add_request(req("c1", tokens(3000), max_tokens=2, session="s"))
    drain(engine)
    c = cost()
    report = engine.offload_kv(["s"])
    blocks = 3001 // BS
    assert report.kind == "kv_offload"
    assert report.bytes == blocks * BS * c.kv_bytes_per_token_per_gpu()
    assert report.seconds == pytest.approx(c.kv_offload_seconds(blocks * BS), rel=1e-12)
    assert engine.offload_kv(["s"]).bytes == 0  # already on host: nothing copied
    assert engine.offload_kv(["other"]).bytes == 0


def test_without_host_kv_a_returning_session_recomputes() -> None:
    engine = make(host_kv_bytes=0)
    first, last, prompt2 = _offload_switch_and_return(engine)
    assert last.num_restored_tokens == 0 and last.num_cached_tokens == 0
    assert first.num_prefill_tokens == len(prompt2)  # 7005 tokens: one chunk, from scratch
    assert first.seconds == pytest.approx(
        cost().chunks_step_seconds([(len(prompt2), 0)]), rel=1e-12)
    assert engine.session_kv_tokens("s")[1] == 0  # nothing on host; c2's KV is on device


def test_sleep_wake_switch_sleeps_the_outgoing_model_and_wakes_the_incoming_one() -> None:
    engine = make(stable_substrate=False, staging=False, switch="sleep_wake")
    rates = SleepWakeRates()
    report = engine.activate(QWEN)
    assert report.kind == "activate_wake"
    assert report.seconds == pytest.approx(rates.wake_seconds(cost()), rel=1e-12)
    assert engine.activate(GLM).seconds == pytest.approx(
        rates.sleep_seconds(cost()) + rates.wake_seconds(cost(GLM)), rel=1e-12)
    assert engine.residency() == {QWEN: Residency.HOST, GLM: Residency.ACTIVE}
    with pytest.raises(ValueError, match="no staging region"):
        engine.stage(QWEN)
    # no staging region: the KV region is all the model's own weights leave
    assert engine.kv_capacity_blocks(QWEN) == cost().kv_capacity_tokens() // BS


def test_substrate_switch_is_host_then_staged_once_the_copy_completes() -> None:
    clock = Clock()
    engine = make(clock=clock)
    a = engine.activate(QWEN)
    assert (a.kind, a.seconds) == ("activate_h2d", pytest.approx(cost().switch_seconds_host()))
    clock.now = 100.0
    stage = engine.stage(GLM)
    ready = cost(GLM).switch_seconds_host()
    assert (stage.kind, stage.seconds) == ("stage", pytest.approx(ready))
    assert engine.residency()[GLM] == Residency.STAGING
    assert engine.stage(GLM).bytes == 0  # already staging: nothing new moves
    clock.now = 100.0 + ready
    assert engine.residency() == {QWEN: Residency.ACTIVE, GLM: Residency.STAGED}
    b = engine.activate(GLM)
    assert (b.kind, b.seconds) == ("activate_d2d", pytest.approx(cost(GLM).switch_seconds_staged()))
    # the staging region still holds GLM: switching back to it later is D2D again
    engine.activate(QWEN)
    assert engine.residency()[GLM] == Residency.STAGED
    with pytest.raises(ValueError, match="active model"):
        engine.stage(QWEN)


def test_activating_a_model_still_staging_waits_for_its_copy_then_copies_d2d() -> None:
    """As the live substrate does: the copy in flight is waited for, then the switch is D2D;
    the ledger books the D2D copy alone (the measured rate), the switch's seconds hold both."""
    clock = Clock()
    engine = make(clock=clock)
    engine.activate(QWEN)
    engine.stage(GLM)
    copy = cost(GLM).switch_seconds_host()
    clock.now = copy / 4
    report = engine.activate(GLM)
    d2d = cost(GLM).switch_seconds_staged()
    assert report.kind == "activate_d2d"
    assert report.seconds == pytest.approx(copy * 3 / 4 + d2d)
    assert report.seconds < copy  # the host copy it used to be priced at
    assert engine.memory.ledger.totals("activate_d2d").seconds == pytest.approx(d2d)
    assert engine.residency()[GLM] == Residency.ACTIVE


def test_lending_the_staging_region_waits_for_a_copy_in_flight() -> None:
    clock = Clock()
    engine = make((QWEN, GLM, MISTRAL), clock=clock)
    engine.activate(QWEN)
    engine.stage(GLM)
    copy = cost(GLM).switch_seconds_host()
    clock.now = copy / 2
    report = engine.activate(MISTRAL, lend_staging=True)
    assert report.kind == "activate_h2d"
    assert report.seconds == pytest.approx(copy / 2 + cost(MISTRAL).switch_seconds_host())
    assert engine.residency()[GLM] == Residency.HOST  # the lent region dropped the copy
    # a copy of another model in flight, not lending: the H2D switch does not wait for it
    engine.activate(QWEN)
    engine.stage(GLM)
    assert engine.activate(MISTRAL).seconds == pytest.approx(cost(MISTRAL).switch_seconds_host())
    assert engine.residency()[GLM] == Residency.STAGING  # its copy goes on


def test_staging_region_shrinks_kv_capacity() -> None:
    with_staging = make(staging=True)
    without = make(staging=False)
    largest = cost().weight_bytes_per_gpu()  # qwen is the largest shard of the catalog
    assert with_staging.kv_capacity_blocks(GLM) == (
        cost(GLM).kv_capacity_tokens(largest, largest) // BS)
    assert without.kv_capacity_blocks(GLM) == cost(GLM).kv_capacity_tokens(largest, 0) // BS
    assert with_staging.kv_capacity_blocks(GLM) < without.kv_capacity_blocks(GLM)
    with_staging.activate(GLM)
    assert with_staging.stats().num_total_blocks == with_staging.kv_capacity_blocks(GLM)


def test_too_many_long_requests_preempt_and_all_finish() -> None:
    engine = make()  # qwen with staging: ~194k tokens of KV
    capacity = engine.kv_capacity_blocks(QWEN) * BS
    engine.activate(QWEN)
    for i in range(3):
        engine.add_request(req(f"L{i}", tokens(90_000, 1000 * i), max_tokens=40))
    assert 3 * 90_000 > capacity
    _, events = drain(engine)
    assert engine.stats().extra["num_preemptions"] > 0
    for i in range(3):
        evs = events[f"L{i}"]
        assert len(output(evs)) == 40 and evs[-1].finish_reason == FinishReason.LENGTH
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_a_request_that_cannot_fit_the_kv_cache_is_refused() -> None:
    engine = make()
    engine.activate(QWEN)
    too_long = engine.kv_capacity_blocks(QWEN) * BS
    with pytest.raises(ValueError, match="KV cache holds at most"):
        engine.add_request(req("big", tokens(too_long)))


def test_abort_frees_blocks_and_reports_an_empty_finished_event() -> None:
    engine = make()
    engine.activate(QWEN)
    total = engine.stats().num_total_blocks
    engine.add_request(req("a", tokens(20_000)))
    engine.step()  # first prefill chunk holds blocks
    assert engine.stats().num_free_blocks < total
    engine.abort("a")
    engine.abort("unknown")  # ignored
    assert engine.stats().num_free_blocks == total
    step = engine.step()
    assert [(e.request_id, e.new_token_ids, e.finished, e.finish_reason) for e in step.events] == [
        ("a", [], True, FinishReason.ABORT)]
    assert not engine.has_unfinished()


def test_bad_requests_and_switches_raise_clear_errors() -> None:
    """The same checks, and the same errors, as the live multi-model engine (ServedModels)."""
    engine = make()
    with pytest.raises(ModelNotActiveError, match="the active model is None"):
        engine.add_request(req("x", tokens(10)))
    engine.activate(QWEN)
    with pytest.raises(ValueError, match="is for model 'glm-4.5-air'"):
        engine.add_request(req("x", tokens(10), model=GLM))
    max_len = ModelSpec.load(QWEN).max_position_embeddings
    with pytest.raises(ValueError, match=f"max_model_len is {max_len}"):
        engine.add_request(req("x", tokens(max_len)))
    with pytest.raises(ValueError, match="outside"):
        engine.add_request(req("x", [1, 2, 10**9]))
    with pytest.raises(ValueError, match="unknown model"):
        engine.activate("gpt-5")
    engine.add_request(req("x", tokens(100)))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(req("x", tokens(100)))
    with pytest.raises(RuntimeError, match="unfinished"):
        engine.activate(GLM)
    with pytest.raises(ValueError, match="staging needs the stable substrate"):
        SimEngineConfig(stable_substrate=False, staging=True)


def _two_sessions_then_pressure(pin: bool) -> SimEngine:
    """Sessions s then t finish (s's blocks are older, evicted first); a long request then
    needs 100 more blocks than were never used."""
    engine = make()
    engine.activate(QWEN)
    for sid, start in (("s", 0), ("t", 40_000)):
        engine.add_request(req(f"p{sid}", tokens(20_000, start), max_tokens=2, session=sid))
        drain(engine)
    if pin:
        assert engine.pin_session_kv("s") == 20_001 // BS
        assert engine.stats().extra["num_pinned_blocks"] == 20_001 // BS
    never_used = engine.kv_capacity_blocks(QWEN) - 2 * (20_002 // BS + 1)
    engine.add_request(req("q", tokens((never_used + 100) * BS - 1, 90_000), max_tokens=1))
    drain(engine)
    return engine


def test_pinned_session_kv_is_not_evicted_under_pressure() -> None:
    full = 20_001 // BS * BS
    unpinned = _two_sessions_then_pressure(pin=False)
    assert unpinned.session_kv_tokens("s")[0] < full  # the older session lost its tail
    assert unpinned.session_kv_tokens("t")[0] == full
    pinned = _two_sessions_then_pressure(pin=True)
    assert pinned.session_kv_tokens("s")[0] == full
    assert pinned.session_kv_tokens("t")[0] < full  # eviction went to the unpinned one
    pinned.unpin_session_kv("s")
    assert pinned.stats().extra["num_pinned_blocks"] == 0


def test_a_switch_drops_pinned_kv() -> None:
    engine = make()
    engine.activate(QWEN)
    engine.add_request(req("p", tokens(5000), max_tokens=2, session="s"))
    drain(engine)
    assert engine.pin_session_kv("s") > 0
    engine.activate(GLM)
    assert engine.session_kv_tokens("s") == (0, 0)
    assert engine.pin_session_kv("s") == 0
    assert engine.stats().extra["num_pinned_blocks"] == 0


def test_a_request_blocked_by_pinned_blocks_waits_at_the_step_overhead() -> None:
    engine = make()
    engine.activate(QWEN)
    capacity = engine.kv_capacity_blocks(QWEN)
    engine.add_request(req("p", tokens((capacity - 100) * BS), max_tokens=1, session="s"))
    drain(engine)
    engine.pin_session_kv("s")
    engine.add_request(req("q", tokens(20_000, 200_000), max_tokens=1))
    step = engine.step()  # its first 8192-token chunk needs 128 blocks; fewer are free
    assert (step.events, step.num_steps) == ([], 0)
    assert step.seconds == cost().eff.step_overhead_s
    engine.unpin_session_kv("s")
    _, events = drain(engine)
    assert events["q"][-1].finished


def test_synthetic_tokens_are_deterministic_and_in_vocabulary() -> None:
    outs = []
    for _ in range(2):
        engine = make(models=(MISTRAL,))
        engine.activate(MISTRAL)
        engine.add_request(req("same", tokens(500), max_tokens=30, model=MISTRAL))
        _, events = drain(engine)
        outs.append(output(events["same"]))
    assert outs[0] == outs[1]
    vocab = ModelSpec.load(MISTRAL).vocab_size
    assert all(0 <= t < vocab for t in outs[0])
    assert len(set(outs[0])) > 20
    shared = token_ids(vocab)  # each id the vocabulary's one object, not an int of its own
    assert all(t is shared[t] for t in outs[0])


def test_model_rates_come_from_the_cost_model() -> None:
    engine = make(models=(QWEN, GLM, MISTRAL))
    c = cost(GLM)
    rates = engine.model_rates(GLM, context_tokens=4096)
    assert rates["prefill_tokens_per_s"] == pytest.approx(
        8192 / c.chunks_step_seconds([(8192, 4096)]))
    assert rates["decode_step_s"] == pytest.approx(c.decode_step_seconds(1, 4096))
    assert rates["switch_host_s"] == pytest.approx(c.switch_seconds_host())
    assert rates["switch_staged_s"] == pytest.approx(c.switch_seconds_staged())
    assert rates["kv_bytes_per_token"] == c.kv_bytes_per_token_per_gpu()
    assert rates["kv_restore_bytes_per_s"] == c.kv_restore_bytes_per_s
    asleep = make(stable_substrate=False, staging=False, switch="sleep_wake")
    asleep.activate(QWEN)
    assert asleep.model_rates(GLM)["switch_host_s"] == pytest.approx(
        SleepWakeRates().sleep_seconds(cost()) + SleepWakeRates().wake_seconds(c))


def test_continuation_with_a_diverging_prompt_only_reuses_the_matching_blocks() -> None:
    engine = make()
    engine.activate(QWEN)
    prompt = tokens(4000)
    engine.add_request(req("c1", prompt, max_tokens=2, session="s"))
    drain(engine)
    changed = prompt[:1000] + [7] + prompt[1001:]  # block 15 (tokens 960..1023) differs
    engine.add_request(req("c2", changed, max_tokens=1, session="s"))
    _, events = drain(engine)
    assert events["c2"][-1].num_cached_tokens == 15 * BS


def test_an_answer_ends_where_its_length_says_as_at_an_eos() -> None:
    """The replay's registry ends an answer (finish reason stop) long before a generous
    max_tokens; without an entry the answer runs to max_tokens (length)."""
    answers = {"a": 5}
    engine = SimEngine(["glm-4.5-air"], SimEngineConfig(), clock=lambda: 0.0,
                       answer_lengths=answers)
    engine.activate("glm-4.5-air")
    for rid in ("a", "b"):
        engine.add_request(EngineRequest(rid, list(range(1, 200)), SamplingParams(max_tokens=12),
                                         model="glm-4.5-air"))
    done = {}
    while engine.has_unfinished():
        for ev in engine.step().events:
            if ev.finished:
                done[ev.request_id] = (ev.num_output_tokens, ev.finish_reason)
    assert done == {"a": (5, FinishReason.STOP), "b": (12, FinishReason.LENGTH)}
