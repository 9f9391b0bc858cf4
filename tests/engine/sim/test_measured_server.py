"""A measured server as the simulator sees it: the spec file round-trips, its efficiency
overrides reach the cost model, the terms a CPU needs price what they say and stay neutral
for the GPU presets, and a checkpoint's config.json becomes a ModelSpec."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import orjson
import pytest

from engine.sim.config import SimEngineConfig
from engine.sim.cost_model import CostModel, Efficiency, combine
from engine.sim.efficiency import OVERHEAD_TERMS
from engine.sim.engine import SimEngine
from engine.sim.model_spec import ModelSpec
from engine.sim.step_time import DecodeLine
from substrate.devices import (
    HOST_LINK_SHARE_ALL_GPUS,
    DeviceSpec,
    ServerSpec,
    load_server,
    server_from_dict,
    server_preset,
    server_to_dict,
)

CPU = DeviceSpec(
    name="cpu core", hbm_bytes=12 * 10**9, hbm_bytes_per_s=8e9, bf16_flops=60e9,
    nvlink_bytes_per_s=1.2e9, host_link_bytes_per_s=6e9, d2d_bytes_per_s=5e9,
    attention_flops=35e9, attention_scores_per_s=0.8e9, decode_scores_per_s=0.2e9,
    kv_read_bytes_per_s=7e9, kv_offload_bytes_per_s=0.5e9, kv_restore_bytes_per_s=0.8e9,
)
OVERHEADS = {"compute": 1.0, "memory": 1.0, "nvlink": 1.0, "memory_reserve_fraction": 0.0,
             "allreduce_latency_s": 2e-4, "overlap": 0.0, "step_overhead_s": 4e-4,
             "layer_overhead_s": 1.5e-4, "moe_layer_overhead_s": 1e-4, "seq_overhead_s": 1.5e-5,
             "tp_step_overhead_s": 2e-3, "moe_dense_max_tokens": 64.0,
             "elementwise_s_per_unit": 2e-8, "decode_seq_layer_overhead_s": 5e-6,
             "decode_context_overhead_s": 3e-9}
SERVER = ServerSpec("cpu-test", CPU, num_devices=2, host_memory_bytes=24 * 10**9,
                    efficiency=tuple(sorted(OVERHEADS.items())))


def small_llama(**overrides: object) -> ModelSpec:
    base = dict(
        name="llama-like", hf_repo="", source="test", architecture="LlamaForCausalLM",
        num_layers=8, hidden_size=512, num_attention_heads=8, num_kv_heads=4, head_dim=64,
        vocab_size=8192, tie_word_embeddings=False, attention_bias=False, num_dense_layers=8,
        dense_intermediate_size=1408, num_experts=0, num_experts_per_tok=0,
        moe_intermediate_size=0, num_shared_experts=0, max_position_embeddings=4096,
        weight_dtype="float32", kv_dtype="float32", activation_dtype="float32",
    )
    return ModelSpec(**{**base, **overrides})  # type: ignore[arg-type]


def small_moe() -> ModelSpec:
    return small_llama(name="moe-like", architecture="Qwen3MoeForCausalLM", num_dense_layers=0,
                       num_experts=8, num_experts_per_tok=2, moe_intermediate_size=352)


def test_the_spec_file_round_trips_and_loads_where_a_preset_name_does(tmp_path: Path) -> None:
    data = {**server_to_dict(SERVER), "calibration": {"threads_per_rank": 1}}
    assert server_from_dict(data) == SERVER
    path = tmp_path / "cpu.json"
    path.write_bytes(orjson.dumps(data))
    assert load_server(path) == server_preset(str(path)) == SERVER
    # the presets keep their sourced constants and serialise too
    h200 = server_preset("h200x8")
    assert server_from_dict(server_to_dict(h200)) == h200
    assert h200.efficiency == () and h200.device.attention_flops is None
    SimEngineConfig(server=str(path), tp=2)  # a path is accepted wherever a preset is


def test_bad_spec_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_server(tmp_path / "missing.json")
    data = server_to_dict(SERVER)
    with pytest.raises(ValueError, match="unknown keys \\['speed'\\]"):
        server_from_dict({**data, "speed": 1})
    with pytest.raises(ValueError, match="device: unknown keys"):
        server_from_dict({**data, "device": {**data["device"], "warp": 1}})
    with pytest.raises(ValueError, match="kv_read_bytes_per_s must be positive"):
        server_from_dict({**data, "device": {**data["device"], "kv_read_bytes_per_s": 0}})
    bad = tmp_path / "bad.json"
    bad.write_bytes(orjson.dumps({**data, "efficiency": {"warp_factor": 2.0}}))
    with pytest.raises(ValueError, match="unknown efficiency field 'warp_factor'"):
        CostModel(load_server(bad), small_llama(), 1)


def test_the_server_overrides_reach_the_cost_model() -> None:
    eff = CostModel(SERVER, small_llama(), 1).eff
    assert eff.overlap == 0.0 and eff.step_overhead_s == 4e-4
    assert eff.moe_dense_max_tokens == 64 and isinstance(eff.moe_dense_max_tokens, int)
    assert CostModel(server_preset("h200x8"), small_llama(), 1).eff == Efficiency()
    with pytest.raises(ValueError, match="overlap must be in"):
        Efficiency(overlap=1.5)


def test_overlap_moves_a_step_from_the_larger_term_to_the_sum() -> None:
    assert combine(3.0, 1.0, 1.0) == 3.0
    assert combine(3.0, 1.0, 0.0) == 4.0
    assert combine(1.0, 3.0, 0.5) == 3.5
    cost = CostModel(SERVER, small_llama(), 1).step_cost([(64, 0)])
    assert cost.seconds == pytest.approx(cost.compute_s + cost.memory_s + cost.overhead_s)


def test_the_terms_add_up_and_name_their_parts() -> None:
    m = small_llama()
    cost = CostModel(SERVER, m, 1).step_cost([], decode_seqs=4, decode_context=4000)
    parts = dict(cost.parts)
    assert cost.compute_s == pytest.approx(parts["linear"] + parts["attention"] + parts["scores"])
    assert cost.memory_s == pytest.approx(parts["weights"] + parts["kv"])
    scores = m.num_layers * m.num_attention_heads * (4000 + 4)
    assert parts["attention"] == pytest.approx(4 * m.head_dim * scores / CPU.attention_flops)
    # decodes are priced at the decode rate, prefill chunks at the prefill one
    assert parts["scores"] == pytest.approx(scores / CPU.decode_scores_per_s)
    chunk = dict(CostModel(SERVER, m, 1).step_cost([(16, 0)]).parts)
    pairs = 16 * 17 / 2
    assert chunk["scores"] == pytest.approx(m.num_layers * m.num_attention_heads * pairs
                                            / CPU.attention_scores_per_s)
    assert parts["kv"] == pytest.approx((4000 + 4) * m.kv_bytes_per_token / CPU.kv_read_bytes_per_s)
    e = OVERHEADS
    assert cost.overhead_s == pytest.approx(
        e["step_overhead_s"] + 8 * e["layer_overhead_s"] + 4 * e["seq_overhead_s"]
        + 4 * 8 * 512 * e["elementwise_s_per_unit"] + 4 * 8 * e["decode_seq_layer_overhead_s"]
        + 4000 * e["decode_context_overhead_s"])


@pytest.mark.parametrize("tp", [1, 2])
def test_a_steps_overhead_is_its_counts_times_the_terms(tp: int) -> None:
    """What the calibration fits the terms from (overhead_counts) is what a step pays."""
    eff = Efficiency.of_server(SERVER)
    for model in (small_llama(), small_moe()):
        cost = CostModel(SERVER, model, tp)
        for chunks, seqs, context in (([], 1, 64), ([(48, 0)], 0, 0), ([(32, 100), (8, 0)], 5, 900)):
            step = cost.step_cost(chunks, seqs, context)
            tokens, rows = sum(n for n, _ in chunks) + seqs, len(chunks) + seqs
            counts = cost.overhead_counts(tokens, rows, seqs, context)
            assert set(counts) == set(OVERHEAD_TERMS)
            assert step.overhead_s == pytest.approx(sum(getattr(eff, t) * n
                                                        for t, n in counts.items()))
    # a product of two or more rows pays its fixed work per weight byte; one row does not
    gemm = dataclasses.replace(SERVER, efficiency=tuple(sorted({
        **OVERHEADS, "gemm_s_per_weight_byte": 1e-11}.items())))
    model = small_llama()
    layers, head = model.always_active_linear_params * 4, model.vocab_size * model.hidden_size * 4
    # the layers' products have a row per token, the LM head one per sampling sequence
    for chunks, seqs, extra in (([], 1, 0.0), ([], 2, layers + head), ([(48, 0)], 0, layers)):
        with_gemm = dict(CostModel(gemm, model, 1).step_cost(chunks, seqs, seqs * 64).parts)
        without = dict(CostModel(SERVER, model, 1).step_cost(chunks, seqs, seqs * 64).parts)
        assert with_gemm["linear"] - without["linear"] == pytest.approx(extra * 1e-11, rel=1e-6)
    assert CostModel.from_names().step_cost([(64, 0)], 4, 400).overhead_s == pytest.approx(
        Efficiency().step_overhead_s)  # the GPU presets: one per-step overhead, nothing else


def test_tp_steps_pay_two_all_reduces_per_layer_plus_the_embedding_and_the_logits() -> None:
    m = small_llama()
    fast_link = dataclasses.replace(SERVER, device=dataclasses.replace(CPU, nvlink_bytes_per_s=1e30))
    one = CostModel(fast_link, m, 2).step_cost([], decode_seqs=1, decode_context=64)
    assert one.allreduce_s == pytest.approx((2 * m.num_layers + 2) * OVERHEADS["allreduce_latency_s"])
    single = CostModel(SERVER, m, 1).step_cost([], decode_seqs=1, decode_context=64)
    assert single.allreduce_s == 0.0
    assert one.overhead_s - single.overhead_s == pytest.approx(OVERHEADS["tp_step_overhead_s"])


def test_the_dense_moe_path_runs_every_expert_on_small_batches() -> None:
    moe = small_moe()
    dense = CostModel(SERVER, moe, 1)
    routed = CostModel(dataclasses.replace(SERVER, efficiency=()), moe, 1)
    assert dense._experts_touched_fraction(1) == 1.0
    assert routed._experts_touched_fraction(1) == pytest.approx(2 / 8)
    extra = moe.num_moe_layers * (moe.num_experts - moe.num_experts_per_tok) * moe.expert_params
    assert dense._linear_flops(64, 0) == pytest.approx(2 * (moe.active_linear_params + extra) * 64)
    assert dense._linear_flops(65, 0) == pytest.approx(2 * moe.active_linear_params * 65)
    overhead = dense.step_cost([], 1, 16).overhead_s - CostModel(SERVER, small_llama(), 1).step_cost(
        [], 1, 16).overhead_s
    assert overhead == pytest.approx(8 * OVERHEADS["moe_layer_overhead_s"])


@pytest.mark.parametrize("overlap", [0.0, 0.4, 1.0])
def test_fused_decode_steps_cost_the_sum_of_their_steps_at_any_overlap(overlap: float) -> None:
    server = dataclasses.replace(SERVER, efficiency=tuple(sorted({**OVERHEADS, "overlap": overlap}.items())))
    cost = CostModel(server, small_llama(), 1)
    line = DecodeLine.of(cost, 16)
    want = sum(cost.step_cost([], 16, 3000 + 16 * j).seconds for j in range(7))
    assert line.seconds(3000, 7) == pytest.approx(want, rel=1e-9)


def test_kv_moves_use_the_measured_rates_when_there_are_some() -> None:
    m = small_llama()
    cpu = CostModel(SERVER, m, 1)
    assert cpu.kv_offload_seconds(100) == pytest.approx(100 * m.kv_bytes_per_token / 0.5e9)
    assert cpu.kv_restore_seconds(100) == pytest.approx(100 * m.kv_bytes_per_token / 0.8e9)
    h200 = CostModel(server_preset("h200x8"), m, 1)
    assert h200.kv_restore_seconds(100) == pytest.approx(
        100 * m.kv_bytes_per_token / (50e9 * HOST_LINK_SHARE_ALL_GPUS))
    assert SERVER.host_link_share == 1.0  # measured rates already hold what sharing costs
    assert server_from_dict(server_to_dict(SERVER)) == SERVER
    shared = dataclasses.replace(SERVER, host_link_share=0.5)
    assert server_from_dict(server_to_dict(shared)).host_link_share == 0.5


def test_a_sim_engine_runs_the_tiny_catalog_on_the_measured_server(tmp_path: Path) -> None:
    path = tmp_path / "cpu.json"
    path.write_bytes(orjson.dumps(server_to_dict(SERVER)))
    engine = SimEngine({"llama-like": small_llama(), "moe-like": small_moe()},
                       SimEngineConfig(server=str(path), tp=1, block_size=16, kv_tokens=8192,
                                       host_kv_bytes=1 << 28, staging=True))
    assert engine.kv_capacity_blocks("llama-like") == 512
    engine.activate("llama-like")
    rates = engine.model_rates("llama-like")
    assert rates["kv_restore_bytes_per_s"] == CPU.kv_restore_bytes_per_s


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe", "mixtral"])
def test_a_checkpoint_config_becomes_a_model_spec(tmp_path: Path, arch: str) -> None:
    import transformers

    from engine.models.tiny import write_random_checkpoint

    path = write_random_checkpoint(tmp_path / arch, arch, size="tiny")
    spec = ModelSpec.from_hf_config(path)
    assert spec.name == arch and spec.weight_dtype == spec.kv_dtype == "float32"
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    # every parameter but the norms' (the spec counts matrices) and MoE routers' biases
    counted = sum(p.numel() for n, p in model.named_parameters() if "norm" not in n)
    assert spec.total_params == pytest.approx(counted, rel=0.01)
    assert spec.kv_bytes_per_token == 2 * model.config.num_hidden_layers * spec.num_kv_heads * spec.head_dim * 4
    with pytest.raises(ValueError, match="no config.json"):
        ModelSpec.from_hf_config(tmp_path)


def test_free_host_link_server_prices_every_host_copy_at_nothing_and_the_rest_as_the_preset() -> None:
    """``workloads/data/servers/h200x8-free-host-link.json`` (tools/saturation_gap.py's
    counterfactual) is the h200x8 preset with only its host link changed: every host copy
    (a switch from host, a staging copy, a KV offload and restore) takes under a
    microsecond, while a step and a D2D activation cost what the preset's do."""
    path = Path(__file__).parents[3] / "workloads" / "data" / "servers" / "h200x8-free-host-link.json"
    free, preset = load_server(path), server_preset("h200x8")
    assert dataclasses.replace(
        free, name=preset.name,
        device=dataclasses.replace(free.device,
                                   host_link_bytes_per_s=preset.device.host_link_bytes_per_s),
    ) == preset
    model = ModelSpec.load("qwen3-235b-a22b")
    cheap, real = CostModel(free, model, 8), CostModel(preset, model, 8)
    assert real.switch_seconds_host() > 1.0  # a 59 GB shard a GPU over PCIe
    assert cheap.switch_seconds_host() < 1e-6
    assert cheap.kv_offload_seconds(100_000) < 1e-6 and cheap.kv_restore_seconds(100_000) < 1e-6
    assert real.kv_restore_seconds(100_000) > 1e-2
    assert cheap.switch_seconds_staged() == real.switch_seconds_staged() > 0
    # a step's price does not read the host link
    assert cheap.step_seconds(2048, 30_000, 8, 8 * 4096) == real.step_seconds(2048, 30_000, 8, 8 * 4096)
