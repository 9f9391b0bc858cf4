"""The replay comparison's machinery (no timing is asserted): both sides get the same scaled
trace and the same limits, the live side is a real `talaria serve`, and the two report the
same calls and prompts, each with its cached and host-restored tokens."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from engine.models.tiny import make_tiny_models
from engine.sim.model_spec import ModelSpec
from router.metrics import RouterMetrics
from talaria.protocol import CallRequest, InstanceState, SamplingParams
from talaria.serving.config import load_serve_config
from workloads.fidelity.replays import (
    FIDELITY_POLICIES,
    ReplaySetup,
    cluster_spec,
    compare,
    fidelity_trace,
    format_replay_table,
    ranking,
    real_model_map,
    replay_pair,
    same_ranking,
    serve_config_text,
    told_apart,
)
from workloads.replay.cluster import ClusterTotals
from workloads.replay.driver import (
    CallOutcome,
    CallRecord,
    ReplayResult,
    SessionResult,
    StandInOutputs,
    run_sim,
)
from workloads.replay.live_serve import parse_counters
from workloads.replay.prompts import SessionTokens
from workloads.replay.systems import system

SETUP = ReplaySetup(sessions=3, max_calls=3, token_scale=0.01, time_scale=0.01,
                    slot_quantum_s=2.0, kv_blocks=128, host_kv_bytes=8 << 20)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_tiny_models(tmp_path_factory.mktemp("fidelity"), size="tiny")


def catalog(models: dict[str, Path]) -> dict[str, ModelSpec]:
    return {name: ModelSpec.from_hf_config(path, name) for name, path in models.items()}


def test_the_trace_is_the_default_one_scaled_to_the_tiny_models(models: dict[str, Path]) -> None:
    sessions = fidelity_trace(SETUP, catalog(models))
    assert [s.session_id for s in sessions] == ["swe-000", "swe-001", "swe-002"]
    assert {s.model for s in sessions} == {"tiny-qwen3-moe", "tiny-qwen3"}
    assert all(1 <= s.num_calls <= 3 and s.calls[-1].tool_gap_s is None for s in sessions)
    assert all(c.input_tokens + c.output_tokens <= 4096 for s in sessions for c in s.calls)


def test_both_sides_get_the_same_engine_limits(models: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "serve.toml"
    path.write_text(serve_config_text(SETUP, models, "+host_kv"))
    live = load_serve_config(path)
    assert live.policy_config() == system("+host_kv").with_policy(**SETUP.policy_overrides()).policy
    inst = live.instances[0]
    assert (inst.kv_blocks, inst.host_kv_bytes, inst.tensor_parallel_size) == (128, 8 << 20, 1)
    assert inst.device == "cpu"
    on_gpu = dataclasses.replace(SETUP, device="cuda:0")  # the device check's replay (tools/device_check.py)
    path.write_text(serve_config_text(on_gpu, models, "+host_kv"))
    assert load_serve_config(path).instances[0].device == "cuda:0"
    path.write_text(serve_config_text(SETUP, models, "+host_kv"))
    # the staging region as the simulated engine has it: with host KV, every shard stages
    assert (inst.staging, inst.staging_region) == (True, "largest")
    assert system("+host_kv").staging_region == "largest"
    assert live.model_paths() == {n: str(p) for n, p in models.items()}
    spec = cluster_spec(SETUP, "h200x8", catalog(models))
    sim = spec.engine_config(system("+host_kv"))
    assert sim.kv_tokens == inst.kv_blocks * live.engine.block_size
    assert sim.host_kv_bytes == inst.host_kv_bytes and sim.block_size == live.engine.block_size
    assert (sim.max_num_batched_tokens, sim.max_num_seqs) == (
        live.engine.max_num_batched_tokens, live.engine.max_num_seqs)
    assert spec.engine_config(system("baseline")).host_kv_bytes == 0  # no store, as live


def record(prompt: int, cached: int, restored: int, done: float) -> CallRecord:
    return CallRecord(0, 0.0, 0.1, done, prompt, 2, 0, cached, restored)


def test_compare_reports_both_sides_and_the_ranking() -> None:
    live = ReplayResult("live", [SessionResult("a", "m", 0, [record(10, 4, 2, 8.0)]),
                                 SessionResult("b", "m", 0, [record(12, 0, 0, 12.0)])])
    sim = ReplayResult("sim", [SessionResult("a", "m", 0, [record(10, 4, 0, 6.0)]),
                               SessionResult("b", "m", 0, [record(12, 8, 8, 10.0)])])
    live.totals = ClusterTotals(counters={"kv_demotions": 4})
    sim.totals = ClusterTotals(counters={"kv_demotions": 6, "staging_lends": 1})
    row = compare(live, sim)
    assert (row["live_kv_demotions"], row["sim_kv_demotions"]) == (4, 6)
    assert (row["live_staging_lends"], row["sim_staging_lends"]) == (0, 1)
    assert (row["live_p50_s"], row["sim_p50_s"]) == (10.0, 8.0)
    assert row["p50_rel_err"] == pytest.approx(-0.2)
    assert (row["live_calls"], row["sim_calls"], row["live_prompt_tokens"]) == (2, 2, 22)
    assert (row["live_restored_tokens"], row["sim_restored_tokens"]) == (2, 8)
    assert row["live_scts"] == [8.0, 12.0]  # by session id
    rows = {"baseline": row, "talaria": {**row, "live_p50_s": 5.0, "sim_p50_s": 9.0,
                                         "live_scts": [4.0, 6.0]}}
    assert ranking(rows, "live", "p50") == ["talaria", "baseline"]
    assert ranking(rows, "sim", "p50") == ["baseline", "talaria"]
    assert told_apart(rows, "p50") == [("talaria", "baseline")]
    assert not same_ranking(rows, "p50")
    assert "p50: live talaria < baseline; simulated baseline < talaria (DIFFERENT)" in \
        format_replay_table(rows)
    # the same live sessions' SCTs: the live replay cannot order them, so neither order
    # the simulation gives is wrong
    tied = {**rows, "talaria": {**rows["talaria"], "live_scts": [8.0, 12.0]}}
    assert told_apart(tied, "p50") == [] and same_ranking(tied, "p50")
    # one session much faster, the other a little slower: the order flips with the draw
    mixed = {**rows, "talaria": {**rows["talaria"], "live_scts": [2.0, 12.5]}}
    assert told_apart(mixed, "p50") == [] and same_ranking(mixed, "p50")


async def test_stand_in_outputs_come_from_the_session_generator_as_live_ones_do() -> None:
    class Engine:
        async def call(self, request: CallRequest, tokens: SessionTokens) -> CallOutcome:
            return CallOutcome(0.1, 0.2, [7, 7, 7], cached_tokens=5, restored_tokens=2)

    request = CallRequest("c", "s", "m", [1, 2], SamplingParams(max_tokens=3))
    outcome = await StandInOutputs(Engine()).call(request, SessionTokens("s", 0, 256))
    assert outcome.output_token_ids == SessionTokens("s", 0, 256).take(3)
    assert (outcome.cached_tokens, outcome.restored_tokens) == (5, 2)


def test_a_simulated_replay_with_stand_ins_keeps_the_prompts(models: dict[str, Path]) -> None:
    sessions = fidelity_trace(SETUP, catalog(models))
    spec = cluster_spec(SETUP, "h200x8", catalog(models))
    chosen = system("baseline").with_policy(**SETUP.policy_overrides())
    kept = run_sim(sessions, chosen, spec, vocab_size=SETUP.vocab, output_kv_reusable=False,
                   exact_max_tokens=True)
    reused = run_sim(sessions, chosen, spec, vocab_size=SETUP.vocab, exact_max_tokens=True)
    assert [c.prompt_tokens for c in kept.calls] == [c.prompt_tokens for c in reused.calls]
    assert kept.failed_calls == 0


def test_live_and_simulated_replays_count_the_same_calls_and_prompts(
    models: dict[str, Path], tmp_path: Path,
) -> None:
    assert FIDELITY_POLICIES == ("baseline", "+host_kv", "talaria")
    sessions = fidelity_trace(SETUP, catalog(models))
    live, sim = replay_pair(SETUP, "+host_kv", sessions, server="h200x8", models=models,
                            log=lambda _line: None)
    assert live.failed_calls == sim.failed_calls == 0
    assert [(s.session_id, len(s.calls)) for s in live.sessions] == \
        [(s.session_id, len(s.calls)) for s in sim.sessions]
    assert [c.prompt_tokens for c in live.calls] == [c.prompt_tokens for c in sim.calls]
    assert [c.output_tokens for c in live.calls] == [c.output_tokens for c in sim.calls]
    for c in live.calls + sim.calls:
        assert 0 <= c.restored_tokens <= c.cached_tokens < c.prompt_tokens
    row = compare(live, sim)
    assert row["live_calls"] == row["sim_calls"] == sum(s.num_calls for s in sessions)
    # +host_kv neither demotes nor lends: both sides count nothing (live: from /metrics)
    assert live.totals is not None and live.totals.counters == {"kv_demotions": 0,
                                                                "staging_lends": 0}
    assert row["sim_kv_demotions"] == row["sim_staging_lends"] == 0
    # the engine's time: the live engine thread's CPU seconds, the simulated busy seconds
    assert row["live_engine_s"] > 0 and row["sim_engine_s"] == sim.totals.busy_s > 0  # type: ignore[union-attr]


def test_live_counters_are_summed_over_the_instances_the_router_reports() -> None:
    states = {"i0": InstanceState("i0", kv_demotions=3, staging_lends=1),
              "i1": InstanceState("i1", kv_demotions=4)}
    text = RouterMetrics().render(states, {"i0", "i1"}, 0)
    assert parse_counters(text) == {"kv_demotions": 7, "staging_lends": 1}
    assert parse_counters("# HELP x\n") == {"kv_demotions": 0, "staging_lends": 0}


def test_the_real_model_run_gives_it_the_dense_models_sessions(models: dict[str, Path]) -> None:
    setup = dataclasses.replace(SETUP, sessions=16)
    plain = fidelity_trace(setup, catalog(models))
    with_real = catalog(models)
    with_real["real"] = with_real.pop("tiny-llama")
    real = fidelity_trace(setup, with_real, real_model_map("real"))
    assert "real" in {s.model for s in real}
    assert [s.model for s in real] == ["real" if s.model == "tiny-llama" else s.model
                                       for s in plain]
    assert [s.calls for s in real] == [s.calls for s in plain]
