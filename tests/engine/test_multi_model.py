"""The live multi-model engine on the substrate: switches keep outputs and addresses, staged
activation equals host activation, session KV survives a switch through the host store, host
KV exhaustion degrades to partial restores, and bad requests / catalogs fail clearly."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import engine_runs
import pytest
from engine_runs import Outputs, prompt, run

from engine.interface import EngineRequest, MoveReport, MultiModelEngineProtocol, Residency
from engine.models.tiny import build_tokenizer, make_tiny_models, write_random_checkpoint
from engine.multi_model import ModelNotActiveError, MultiModelConfig, MultiModelEngine
from engine.sampling_params import SamplingParams

BLOCK = 4
NUM_BLOCKS = 64
LLAMA, QWEN, MOE = "tiny-llama", "tiny-qwen3", "tiny-qwen3-moe"
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=True)

# the shared drivers with this module's settings
requests = partial(engine_runs.requests, params=GREEDY)
fresh = partial(engine_runs.fresh, block_size=BLOCK, num_blocks=NUM_BLOCKS)
assert_same = partial(engine_runs.assert_same, atol=1e-5)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_tiny_models(tmp_path_factory.mktemp("mm"))


def make_engine(models: dict[str, Path], **kw: object) -> MultiModelEngine:
    cfg = dict(device="cpu", block_size=BLOCK, num_kv_blocks=NUM_BLOCKS, host_kv_bytes=1 << 20)
    cfg.update(kw)
    return MultiModelEngine(models, MultiModelConfig(**cfg))  # type: ignore[arg-type]


PROMPTS = [prompt(1, 13), prompt(2, 22), prompt(3, 5)]


def test_a_b_a_matches_fresh_engines_at_fixed_addresses(models: dict[str, Path]) -> None:
    engine = make_engine(models, staging=False)
    assert isinstance(engine, MultiModelEngineProtocol)
    weight_ptr, kv_ptr = engine.weight_region.data_ptr(), engine.kv_region.data_ptr()
    kv_ptrs = {n: engine.rank.runners[n].kv_cache.data_ptr() for n in engine.model_names}
    want = {n: fresh(models[n], requests(n, n, PROMPTS)) for n in (LLAMA, QWEN)}
    seen: list[tuple[str, Outputs]] = []
    for i, name in enumerate([LLAMA, QWEN, LLAMA, QWEN]):
        report = engine.activate(name)
        assert report.kind == "activate_h2d"
        assert report.bytes == engine.catalog[name].layout.total_bytes and report.seconds > 0
        seen.append(
            (name, run(engine, requests(name, name if i < 2 else f"{name}-again", PROMPTS))[0])
        )
        assert engine.weight_region.data_ptr() == weight_ptr
        assert engine.kv_region.data_ptr() == kv_ptr
        assert all(engine.rank.runners[n].kv_cache.data_ptr() == kv_ptrs[n] for n in kv_ptrs)
        for param in engine.rank.runners[name].model.parameters():
            offset = param.data_ptr() - weight_ptr
            assert 0 <= offset < engine.weight_region.numel()
    for name, got in seen:
        assert_same(got, want[name])
    assert engine.activate(QWEN).kind == "none"  # already active: nothing moves
    assert engine.residency()[QWEN] is Residency.ACTIVE
    assert engine.residency()[LLAMA] is Residency.HOST
    assert not engine.can_stage(LLAMA)  # no staging region


def test_staged_activation_equals_host_activation(models: dict[str, Path]) -> None:
    engine = make_engine(models, wait_for_staging=True)
    assert all(engine.can_stage(n) for n in engine.model_names)  # sized for the largest
    engine.activate(LLAMA)
    stage = engine.stage(MOE)
    assert stage.kind == "stage" and stage.bytes == engine.catalog[MOE].layout.total_bytes
    assert engine.residency()[MOE] is Residency.STAGED
    staged_report = engine.activate(MOE)
    assert staged_report.kind == "activate_d2d"
    staged = run(engine, requests(MOE, "staged", PROMPTS))[0]
    engine.activate(LLAMA)
    host_report = engine.activate(MOE)  # staging still holds MOE: D2D again
    assert host_report.kind == "activate_d2d"
    engine.stage(QWEN)  # staging now holds another model
    engine.activate(LLAMA)
    assert engine.activate(MOE).kind == "activate_h2d"
    host = run(engine, requests(MOE, "host", PROMPTS))[0]
    assert_same(staged, host)
    assert_same(host, fresh(models[MOE], requests(MOE, "fresh", PROMPTS)))
    rates = engine.model_rates(MOE)
    assert rates["switch_staged_s"] > 0 and rates["switch_host_s"] > 0 and rates["stage_s"] > 0


def test_a_staging_region_for_the_second_largest_shard(models: dict[str, Path]) -> None:
    """``staging_region="second"``: every shard but the largest stages; the largest loads
    from host; lending adds the smaller region."""
    full = make_engine(models, wait_for_staging=True)
    second = make_engine(models, wait_for_staging=True, staging_region="second")
    sizes = sorted((second.catalog[n].layout.total_bytes, n) for n in second.model_names)
    (_, smallest), (mid_bytes, _), (_, largest) = sizes
    assert second.rank.memory.arena.staging_bytes == mid_bytes
    assert not second.can_stage(largest) and second.can_stage(smallest)
    assert second.kv_capacity_blocks(LLAMA, lent=True) < full.kv_capacity_blocks(LLAMA, lent=True)
    second.activate(largest)
    assert second.stage(smallest).kind == "stage"
    assert second.activate(smallest).kind == "activate_d2d"
    with pytest.raises(ValueError, match="does not fit the staging region"):
        second.stage(largest)
    with pytest.raises(ValueError, match="staging_region"):
        make_engine(models, staging_region="half")
    plain = make_engine(models, staging=False)
    plain.activate(LLAMA)
    with pytest.raises(ValueError, match="no staging region"):
        plain.activate(QWEN, lend_staging=True)  # refused before anything moves
    assert plain.active_model == LLAMA
    assert_same(run(plain, requests(LLAMA, "still", PROMPTS))[0],
                fresh(models[LLAMA], requests(LLAMA, "still", PROMPTS)))


def test_a_lent_staging_region_holds_kv_and_outputs_stay_exact(models: dict[str, Path]) -> None:
    """With the staging region lent, MOE's KV cache has more blocks than the KV region: a
    batch that needs them all at once runs in one wave, on blocks that live in the staging
    region, and matches a fresh engine; the next switch gives the region back."""
    engine = make_engine(models, wait_for_staging=True)
    lent = engine.kv_capacity_blocks(MOE, lent=True)
    assert engine.kv_capacity_blocks(MOE) == NUM_BLOCKS < lent
    engine.activate(LLAMA)
    engine.stage(MOE)
    assert engine.activate(MOE, lend_staging=True).kind == "activate_d2d"
    assert engine.stats().num_total_blocks == lent
    with pytest.raises(ValueError, match="lent"):
        engine.stage(LLAMA)
    batch = [prompt(40 + i, 30) for i in range(12)]  # 12 x 9 blocks > 64
    got = run(engine, requests(MOE, "lent", batch))[0]
    assert engine.stats().num_cached_blocks > NUM_BLOCKS  # blocks beyond the KV region held KV
    assert_same(got, fresh(models[MOE], requests(MOE, "fresh", batch)))
    assert engine.activate(LLAMA).kind == "activate_h2d"
    assert engine.stats().num_total_blocks == NUM_BLOCKS
    assert engine.stage(MOE).kind == "stage"
    assert_same(run(engine, requests(LLAMA, "after", PROMPTS))[0],
                fresh(models[LLAMA], requests(LLAMA, "after", PROMPTS)))


def test_the_active_model_borrows_the_staging_region_once_nothing_runs(
        models: dict[str, Path]) -> None:
    """A slot that meets KV pressure after it opened: the active model's KV cache is re-viewed
    over both regions without a weight copy, refused while a request is live; a session's
    KV offloaded first comes back from host, and outputs match a fresh engine."""
    engine = make_engine(models, wait_for_staging=True)
    lent = engine.kv_capacity_blocks(MOE, lent=True)
    engine.activate(LLAMA)
    engine.stage(MOE)
    assert engine.activate(MOE).kind == "activate_d2d"
    engine.stage(QWEN)
    first = prompt(5, 30)
    out = run(engine, [EngineRequest("s1", first, GREEDY, model=MOE, session_id="s")])[0]["s1"][0]
    engine.offload_kv(["s"])
    engine.add_request(EngineRequest("live", prompt(6, 9), GREEDY, model=MOE))
    with pytest.raises(RuntimeError, match="live"):
        engine.activate(MOE, lend_staging=True)
    assert engine.stats().num_total_blocks == NUM_BLOCKS  # refused before anything moved
    engine.abort("live")
    engine.step()
    weight_ptr = engine.weight_region.data_ptr()
    report = engine.activate(MOE, lend_staging=True)
    assert report.kind == "none" and report.bytes == 0
    assert engine.weight_region.data_ptr() == weight_ptr and engine.active_model == MOE
    assert engine.stats().num_total_blocks == lent
    assert engine.residency()[QWEN] is Residency.HOST  # the staged copy is gone
    assert engine.activate(MOE).kind == "none" and engine.stats().num_total_blocks == lent
    again = first + out + prompt(7, 5)
    restored = engine.stats().restored_tokens_total
    cont = run(engine, [EngineRequest("s2", again, GREEDY, model=MOE, session_id="s")])[0]
    assert engine.stats().restored_tokens_total - restored >= 28  # its whole blocks
    assert_same(cont, fresh(models[MOE], [EngineRequest("s2", again, GREEDY, model=MOE)]))
    batch = [prompt(40 + i, 30) for i in range(12)]  # 12 x 9 blocks > 64
    got = run(engine, requests(MOE, "lent", batch))[0]
    assert engine.stats().num_cached_blocks > NUM_BLOCKS
    assert_same(got, fresh(models[MOE], requests(MOE, "fresh", batch)))
    assert engine.activate(LLAMA).kind == "activate_h2d"
    assert engine.stats().num_total_blocks == NUM_BLOCKS


def _session_round(
    engine: MultiModelEngine, first_prompt: list[int], sid: str
) -> tuple[list[int], list[int]]:
    """First call of a session on LLAMA; returns (its output, the continuation prompt)."""
    engine.activate(LLAMA)
    first = EngineRequest("c1", first_prompt, GREEDY, model=LLAMA, session_id=sid)
    out = run(engine, [first])[0]["c1"][0]
    return out, first_prompt + out + prompt(99, 7)


def _switch_away_and_back(engine: MultiModelEngine, sid: str) -> MoveReport:
    offload = engine.offload_kv([sid])
    engine.activate(QWEN)
    run(engine, requests(QWEN, "other", [prompt(7, 30), prompt(8, 30)]))
    engine.kv_region.fill_(255)  # every KV byte now reads as NaN: only a restore brings it back
    engine.activate(LLAMA)
    return offload


def test_kv_restore_after_switch_equals_recompute(models: dict[str, Path]) -> None:
    engine = make_engine(models)
    _, cont_prompt = _session_round(engine, prompt(11, 29), "s")
    device_tokens, _ = engine.session_kv_tokens("s")
    assert device_tokens == 32  # 29 prompt + 6 output - 1 not yet computed, in full blocks
    offload = _switch_away_and_back(engine, "s")
    assert (
        offload.kind == "kv_offload"
        and offload.bytes == 8 * engine.catalog[LLAMA].kv_spec.block_bytes
    )
    assert engine.session_kv_tokens("s") == (0, 32)
    cont = EngineRequest("c2", cont_prompt, GREEDY, model=LLAMA, session_id="s")
    got, prefilled = run(engine, [cont])
    assert prefilled == len(cont_prompt) - 32
    restores = engine.take_restore_reports()
    assert [r.kind for r in restores] == ["kv_restore"]
    assert restores[0].bytes == offload.bytes
    assert engine.stats().restored_tokens_total == 32
    want = fresh(models[LLAMA], [EngineRequest("c2", cont_prompt, GREEDY, model=LLAMA)])
    assert_same(got, want)
    assert engine.model_rates(LLAMA)["kv_restore_bytes_per_s"] > 0


def test_a_step_that_fails_still_leaves_its_restored_blocks_whole(
    models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The restore is written by the forward pass; when that raises, the step still settles
    it, so no block in the prefix map is left holding another model's bytes."""
    engine = make_engine(models)
    _, cont_prompt = _session_round(engine, prompt(12, 29), "s")
    _switch_away_and_back(engine, "s")
    runner = engine.cores[LLAMA].runner

    def failing_forward(*args: object, **kwargs: object) -> None:
        raise RuntimeError("device fault in the forward pass")

    monkeypatch.setattr(runner, "forward_step", failing_forward)
    engine.add_request(EngineRequest("c2", cont_prompt, GREEDY, model=LLAMA, session_id="s"))
    with pytest.raises(RuntimeError, match="device fault"):
        engine.step()
    restored = engine.cores[LLAMA].kv.block_ids("c2")[:8]
    assert len(restored) == 8
    assert not runner.kv_loads.pending
    assert not runner.kv_cache[:, :, restored].isnan().any()
    assert [r.kind for r in runner.take_kv_load_records()] == ["kv_restore"]


def test_forgetting_a_session_forgets_it_on_every_model(models: dict[str, Path]) -> None:
    """A session that called two models and is forgotten leaves no record on either: the
    first model's chain is not kept until its host KV goes, and a new session under the
    same id starts with nothing cached."""
    engine = make_engine(models)
    _session_round(engine, prompt(13, 29), "s")
    engine.offload_kv(["s"])
    engine.activate(QWEN)
    run(engine, [EngineRequest("q1", prompt(14, 9), GREEDY, model=QWEN, session_id="s")])
    engine.forget_session("s")
    assert all("s" not in engine._sessions[name] for name in engine.model_names)
    engine.activate(LLAMA)
    engine.add_request(EngineRequest("n1", prompt(15, 9), GREEDY, model=LLAMA, session_id="s"))
    assert engine.session_kv_tokens("s") == (0, 0)


def test_host_kv_exhaustion_evicts_and_restores_partially(models: dict[str, Path]) -> None:
    block_bytes = 2 * 2 * BLOCK * 2 * 16 * 4  # layers * (K, V) * block * kv heads * head dim * fp32
    engine = make_engine(models, host_kv_bytes=5 * block_bytes)
    assert engine.catalog[LLAMA].kv_spec.block_bytes == block_bytes
    _, cont_prompt = _session_round(engine, prompt(21, 29), "s")
    _switch_away_and_back(engine, "s")
    assert engine.session_kv_tokens("s") == (0, 5 * BLOCK)  # the chain's head fitted
    cont = EngineRequest("c2", cont_prompt, GREEDY, model=LLAMA, session_id="s")
    got, prefilled = run(engine, [cont])
    assert prefilled == len(cont_prompt) - 5 * BLOCK
    want = fresh(models[LLAMA], [EngineRequest("c2", cont_prompt, GREEDY, model=LLAMA)])
    assert_same(got, want)
    # Another session's offload evicts the first one's blocks; the first still runs.
    other = EngineRequest("o1", prompt(31, 25), GREEDY, model=LLAMA, session_id="t")
    run(engine, [other])
    engine.offload_kv(["t"])
    assert engine.stats().extra["host_kv_used_bytes"] <= 5 * block_bytes
    engine.activate(QWEN)
    engine.activate(LLAMA)
    again = EngineRequest("c3", cont_prompt, GREEDY, model=LLAMA, session_id="s")
    assert run(engine, [again])[0]["c3"][0] == want["c2"][0]


def test_a_thinking_budget_reaches_the_active_models_core(models: dict[str, Path]) -> None:
    """A request's thinking budget is enforced by the active model's core: the end ids
    forced at the budget, the outputs those of a single-model engine given the same."""
    budgeted = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=True,
                              thinking_budget=2, thinking_end_ids=[7, 8], thinking_from_start=True)
    reqs = engine_runs.requests(QWEN, "think", PROMPTS, budgeted)
    engine = make_engine(models)
    engine.activate(QWEN)
    got = run(engine, reqs)[0]
    assert all(tokens[2:4] == [7, 8] for tokens, _ in got.values())
    assert_same(got, fresh(models[QWEN], reqs))


def test_request_for_non_active_model_raises(models: dict[str, Path]) -> None:
    engine = make_engine(models)
    req = EngineRequest("r", prompt(1, 5), GREEDY, model=LLAMA)
    with pytest.raises(ModelNotActiveError, match="active model is None"):
        engine.add_request(req)
    engine.activate(QWEN)
    with pytest.raises(ModelNotActiveError, match="'tiny-llama'.*active model is 'tiny-qwen3'"):
        engine.add_request(req)
    with pytest.raises(ModelNotActiveError, match="names no model"):
        engine.add_request(EngineRequest("r", prompt(1, 5), GREEDY))
    with pytest.raises(ValueError, match="unknown model"):
        engine.add_request(EngineRequest("r", prompt(1, 5), GREEDY, model="nope"))
    assert not engine.has_unfinished()
    engine.add_request(EngineRequest("q", prompt(1, 5), GREEDY, model=QWEN))
    with pytest.raises(RuntimeError, match="unfinished"):
        engine.activate(LLAMA)
    engine.abort("q")
    engine.step()
    engine.activate(LLAMA)


def test_a_carried_abort_event_survives_a_step_that_raises(
    models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An abort's event carried over a switch is delivered by the first step that completes,
    not lost with a step that raises."""
    engine = make_engine(models)
    engine.activate(LLAMA)
    engine.add_request(EngineRequest("q", prompt(1, 5), GREEDY, model=LLAMA))
    engine.abort("q")
    engine.activate(QWEN)

    def failing() -> None:
        raise RuntimeError("device fault")

    monkeypatch.setattr(engine.cores[QWEN], "step", failing)
    with pytest.raises(RuntimeError, match="device fault"):
        engine.step()
    monkeypatch.undo()
    assert engine.has_unfinished()
    [ev] = engine.step().events
    assert ev.request_id == "q" and ev.finished and ev.new_token_ids == []
    assert not engine.has_unfinished()


def test_shard_too_large_for_weight_region_fails_with_sizes(models: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match=r"weight shard of \d+ bytes .* weight region of 4096"):
        make_engine(models, weight_bytes=4096)


def test_tokenizer_larger_than_vocab_fails_with_sizes(tmp_path: Path) -> None:
    path = write_random_checkpoint(
        tmp_path / "m", "llama", tokenizer=build_tokenizer(512), vocab_size=256
    )
    with pytest.raises(
        ValueError, match="tokenizer has 512 tokens but the model's vocab_size is 256"
    ):
        make_engine({"m": path})


def test_config_vocab_not_matching_weights_fails_with_shapes(tmp_path: Path) -> None:
    path = write_random_checkpoint(tmp_path / "m", "llama", tokenizer=build_tokenizer(512))
    cfg = json.loads((path / "config.json").read_text())
    cfg["vocab_size"] = 640
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"model 'm'.*shape \(512, 64\).*\(640, 64\)"):
        make_engine({"m": path})


def test_offload_all_sessions_pins_and_rates(models: dict[str, Path]) -> None:
    engine = make_engine(models)
    engine.activate(LLAMA)
    run(engine, requests(LLAMA, "p", [prompt(41, 17), prompt(42, 9)]))
    assert engine.pin_session_kv("p-s0") == 5  # 17 + 6 - 1 computed tokens: 5 full blocks
    assert engine.stats().extra["num_pinned_blocks"] == 5
    engine.unpin_session_kv("p-s0")
    report = engine.offload_kv(None)
    assert report.bytes == (5 + 3) * engine.catalog[LLAMA].kv_spec.block_bytes
    assert engine.offload_kv(None).bytes == 0  # already stored: only touched
    engine.activate(QWEN)
    assert engine.session_kv_tokens("p-s0") == (0, 20)
    assert engine.session_kv_tokens("p-s1") == (0, 12)
    assert engine.pin_session_kv("p-s0") == 0  # its model is not active
    rates = engine.model_rates(LLAMA)
    assert rates["prefill_tokens_per_s"] > 0 and rates["decode_step_s"] > 0
    assert rates["kv_offload_bytes_per_s"] > 0
    assert rates["kv_bytes_per_token"] == engine.catalog[LLAMA].kv_spec.block_bytes / BLOCK
    assert rates["kv_capacity_tokens"] == NUM_BLOCKS * BLOCK
    assert engine.stats().extra["kv_offload_bytes_total"] == report.bytes


def test_kv_capacity_rate_is_the_plain_view_after_a_lent_slot(models: dict[str, Path]) -> None:
    """A model switched out after a lent slot gets the KV region's blocks at its next plain
    activation: its rates say so (as the simulated engine's do), not the lent view's count."""
    engine = make_engine(models)
    assert engine.kv_capacity_blocks(MOE, lent=True) > NUM_BLOCKS
    engine.activate(MOE, lend_staging=True)
    engine.activate(LLAMA)
    assert engine.model_rates(MOE)["kv_capacity_tokens"] == NUM_BLOCKS * BLOCK
    engine.activate(MOE)
    assert engine.stats().num_total_blocks == NUM_BLOCKS


def test_every_finished_staging_copy_is_metered_once(models: dict[str, Path]) -> None:
    """The staging rate counts each copy that ended exactly once, whichever poll saw it end:
    the engine's own, one inside the substrate (lending the region waits for the copy and
    books it), or a copy the engine waited for."""
    engine = make_engine(models)
    engine.activate(LLAMA)
    assert engine.stage(QWEN).kind == "stage"
    thread = engine.rank.memory.stager._thread
    assert thread is not None
    thread.join()  # done, and polled by nobody yet
    engine.activate(LLAMA, lend_staging=True)  # the substrate's poll books the copy
    assert engine.rank.move_totals("stage")[0] == engine.catalog[QWEN].layout.total_bytes
    assert engine.model_rates(QWEN)["stage_s"] > 0
    assert engine._meters[QWEN].moves["stage"].count == 1
    waited = make_engine(models, wait_for_staging=True)
    waited.activate(LLAMA)
    waited.stage(QWEN)
    waited.residency()
    waited.activate(QWEN)
    assert waited._meters[QWEN].moves["stage"].count == 1
    assert waited.rank.memory.ledger.totals("stage").count == 1


def test_a_held_session_is_let_go_when_forgotten(models: dict[str, Path]) -> None:
    """A session whose host KV is held (reserved) and then forgotten is held no more: a new
    session under its id starts as any other."""
    engine = make_engine(models)
    index = engine.rank.host_kv_index()
    engine.hold_host_kv("s")
    engine.hold_host_kv("t")
    engine.hold_host_kv("t", False)
    assert index._held == {"s"}
    engine.forget_session("s")
    assert not index._held


def test_a_forgotten_sessions_host_kv_is_not_held_for_a_new_session_under_its_id(
    models: dict[str, Path],
) -> None:
    """The host KV a forgotten session saved is no new session's: holding a new session
    under the same id keeps none of it before an unreserved session's KV."""
    engine = make_engine(models)
    _session_round(engine, prompt(13, 29), "s")
    engine.offload_kv(["s"])
    index = engine.rank.host_kv_index()
    old = [e for e in index.entries() if "s" in e.sessions]
    assert old
    engine.forget_session("s")
    engine.hold_host_kv("s")  # a new session "s", reserved before it saved anything
    assert all(index._held.isdisjoint(e.sessions) for e in old)
